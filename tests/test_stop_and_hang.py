"""A stop signal or a hang that finds a step stuck in a collective (simulated: spmdlm/engine/faults.py) still ends
the process in bounded time, in the launcher and in the evaluator; evaluation never stalls on a simulated mesh (one
program per batch); and what a stopped run leaves (no checkpoint yet, the lock of a process that is gone) never
blocks the same command run again."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import test_refusals_evaluator
from conftest import REPO
from test_refusals_evaluator import evaluator_argv
from test_reliability import flags, launch

from spmdlm import checkpoint, storage
from spmdlm.engine import faults
from spmdlm.engine.step import Stepper
from spmdlm.mesh import make_mesh
from spmdlm.train.safety import guard, watchdog

gpt2_export = test_refusals_evaluator.gpt2_export  # its module-scoped fixture, shared


BLOCKS = "this step blocks now"


def start(module: str, argv: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the launcher logs to stdout, the evaluator to stderr
        text=True,
    )


def wait_until_stuck(proc: subprocess.Popen) -> list[str]:
    """The output's lines up to the fault hook's warning (the step is blocked from then on)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if BLOCKS in line:
            time.sleep(2)  # into the blocked call
            return lines
    pytest.fail(f"the step never blocked: {''.join(lines)[-2000:]}")


@pytest.mark.slow
def test_a_sigterm_that_finds_a_train_step_stuck_leaves_within_60_s_keeping_the_last_checkpoint(
    tmp_path, cache_dir, tiny_gpt2_config
):
    out = tmp_path / "run"
    argv = flags(out, cache_dir, tiny_gpt2_config, "--export_hf", "false", "--do_eval", "false")
    proc = start("spmdlm.launch", argv, **{faults.STUCK_STEP_ENV: "train:3", guard.STOP_GRACE_ENV: "5"})
    wait_until_stuck(proc)  # step 3 is dispatched after the save at step 2
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    err, _ = proc.communicate(timeout=120)
    assert time.monotonic() - sent < 60
    assert proc.returncode == 143, err[-2000:]
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("error: SIGTERM received, but the step in progress did not end within 5 s (stuck in a collective?)")
    )
    assert "Traceback" not in err
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [2]


@pytest.mark.slow
def test_the_evaluator_has_the_hang_watchdog(tmp_path, cache_dir, gpt2_export):
    results = tmp_path / "results.json"
    argv = evaluator_argv(gpt2_export, cache_dir, "--hang_timeout_minutes", "0.05", "--output_file", str(results))
    proc = start("spmdlm.evaluate", argv, **{faults.STUCK_STEP_ENV: "eval:1"})
    err, _ = proc.communicate(timeout=240)
    assert proc.returncode == watchdog.HANG_EXIT_CODE, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: no step, save or evaluation completed for 0.05")
    (stacks,) = tmp_path.glob("hang-*.txt")  # beside --output_file
    assert "maybe_stuck" in stacks.read_text()
    assert not results.exists()


@pytest.mark.slow
def test_a_sigterm_that_finds_the_evaluator_stuck_ends_it_within_60_s(cache_dir, gpt2_export):
    proc = start("spmdlm.evaluate", evaluator_argv(gpt2_export, cache_dir), **{faults.STUCK_STEP_ENV: "eval:1"})
    wait_until_stuck(proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert time.monotonic() - sent < 60
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)


def test_the_eval_step_adds_its_sums_to_the_totals_in_one_program():
    """The sums a batch adds are the eval function's, whatever totals they are added to (no eager add between)."""
    mesh = make_mesh("data=8")
    calls = []

    class Tiny(Stepper):
        def eval_fn(self, state, batch):
            calls.append(1)  # traced once: one program for every batch
            return {"loss_sum": jax.numpy.sum(batch["x"] * state["w"]), "tokens": jax.numpy.sum(batch["x"] > 0)}

    state = {"w": jax.device_put(np.float32(2.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}
    stepper = Tiny(None, state, mesh, None)
    batches = [{"x": np.arange(8, dtype=np.float32) + i} for i in range(3)]
    totals = stepper.eval_zeros(state, batches[0])
    for batch in batches:
        totals = stepper.eval_step(state, batch, totals)
    assert float(totals["loss_sum"]) == 2.0 * sum(float(b["x"].sum()) for b in batches)
    assert int(totals["tokens"]) == 23  # 7 + 8 + 8 positive entries
    assert stepper._eval._cache_size() == 1


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_is_started_over_by_the_same_command(
    capsys, tmp_path, cache_dir, tiny_gpt2_config
):
    out = tmp_path / "run"
    argv = flags(out, cache_dir, tiny_gpt2_config, "--save_steps", "100", "--logging_steps", "1")
    argv += ["--export_hf", "false"]
    proc = start("spmdlm.launch", [*argv, "--hang_timeout_minutes", "0.05"], **{faults.STUCK_STEP_ENV: "train:3"})
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == watchdog.HANG_EXIT_CODE, output[-2000:]
    assert (out / "metrics.jsonl").exists() and (out / "highest_step.json").exists()
    assert not checkpoint.make_manager(out, read_only=True).all_steps()

    code, logged, _ = launch(capsys, *argv)
    assert code == 0 and "stopped before its first checkpoint: starting it over" in logged
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [4]
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]  # the stopped run's records were removed with it

    other = flags(out, cache_dir, tiny_gpt2_config, "--save_steps", "100", "--seed", "7", "--export_hf", "false")
    (out / "checkpoints").rename(tmp_path / "moved")
    (out / "eval_results.json").unlink(missing_ok=True)
    code, _, err = launch(capsys, *other)  # other settings: not this run, refused as before
    assert code == 2 and "holds outputs of an earlier run but no checkpoint to resume" in err


def test_the_lock_of_a_process_that_is_gone_but_not_yet_collected_never_blocks_a_run(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # ends at once; not collected until wait()
    deadline = time.monotonic() + 60
    while not storage.is_zombie(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert storage.is_zombie(child.pid) and not storage.pid_alive(child.pid)
    lock = {"host": socket.gethostname(), "pid": child.pid, "started": "just now"}
    (tmp_path / guard.LOCK_NAME).write_text(json.dumps(lock))
    with guard.RunLock(tmp_path):
        assert json.loads((tmp_path / guard.LOCK_NAME).read_text())["pid"] == os.getpid()
    child.wait()
    assert storage.pid_alive(os.getpid())
