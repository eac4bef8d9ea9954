"""Operating a run: the profiler (--profile_steps), goodput and slow-step warnings, the hang watchdog
(--hang_timeout_minutes). docs/operations.md."""

import json
import logging
import re
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO
from test_reliability import flags, launch

from spmdlm import storage
from spmdlm.cli.launch import parse_args
from spmdlm.errors import ArgumentError, RunError
from spmdlm.run_args.sections import OperationsArgs
from spmdlm.train.reporting import goodput, profiling
from spmdlm.train.safety import watchdog
from spmdlm.train.stages import outputs


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_goodput_splits_the_wall_time_and_counts_recomputed_steps_as_restart_loss():
    clock = FakeClock()
    account = goodput.Goodput(start=clock.now, clock=clock)
    clock.now += 3.0  # setup: other
    with account.span("compile"):
        clock.now += 5.0
    with account.span("checkpoint"):  # the restore
        clock.now += 1.0
    account.recompute_through = 2  # the run before reached step 2 after its checkpoint at 1
    for step in (2, 3, 4):
        with account.span("data_wait"):
            clock.now += 0.5
        account.step_done(step, None)
        clock.now += 2.0  # the step's own time, observed at the next one's dispatch
    account.steps_finished()
    summary = account.summary()
    assert summary["seconds"] == pytest.approx(
        {
            "steps": 4.0,
            "compile": 5.0,
            "checkpoint": 1.0,
            "evaluation": 0.0,
            "data_wait": 1.5,
            "restart_loss": 2.0,
            "other": 3.0,
        }
    )
    assert summary["wall_seconds"] == pytest.approx(16.5) and summary["recomputed_steps"] == 1
    assert sum(summary["fractions"].values()) == pytest.approx(1.0)
    assert goodput.describe(summary) == (
        "goodput 24% (compile 30%, checkpoint 6%, data wait 9%, restart loss 12%, other 18%)"
    )


def test_a_slow_step_is_warned_about_once_per_occurrence_and_rate_limited(caplog):
    clock = FakeClock()
    slow = goodput.SlowSteps(3.0, clock=clock)
    jitter = goodput.SlowSteps(3.0, clock=clock)  # 5x a millisecond step, but no second lost: no straggler
    assert not any(jitter.check(step, seconds) for step, seconds in enumerate([0.01] * 10 + [0.05], 1))
    times = [1.0] * 10 + [5.0, 6.0] + [1.0] * 3 + [4.0] + [1.0] * 3
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        flagged = [step for step, seconds in enumerate(times, 1) if slow.check(step, seconds)]
        clock.now += goodput.SLOW_STEP_QUIET_SECONDS
        assert slow.check(20, 9.0)
    assert flagged == [11, 12, 16]
    warnings = [r.getMessage() for r in caplog.records]
    # step 11 starts an occurrence (12 continues it); 16 is held back (within a minute); 20 says so
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("step 11 took 5 s, 5.0x the median of the last 10 steps (1 s)")
    assert warnings[1].startswith("step 20 took 9 s") and "(1 more since the last such warning)" in warnings[1]


def test_the_watchdog_writes_every_stack_and_exits_when_nothing_completes(tmp_path, capsys):
    exits = []
    beaten = watchdog.Watchdog(0.005, tmp_path, "beaten", exit=exits.append)  # 0.3 s
    silent = watchdog.Watchdog(0.002, tmp_path, "silent", exit=exits.append)  # 0.12 s
    silent.beat("step 7")
    for _ in range(30):  # 0.3 s: the silent one fires, the beaten one does not
        beaten.beat("a step")
        time.sleep(0.01)
    silent._thread.join(5)
    beaten.close()
    assert exits == [watchdog.HANG_EXIT_CODE]
    stacks = (tmp_path / "hang-silent.txt").read_text()
    assert stacks.startswith("no progress for 0 s after step 7")
    assert 'Thread "MainThread"' in stacks and "test_the_watchdog_writes_every_stack" in stacks
    assert not (tmp_path / "hang-beaten.txt").exists()
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: no step, save or evaluation completed for ") and "\n" not in line
    assert line.endswith("so the run can be restarted from its last checkpoint") and str(tmp_path) in line


@pytest.mark.parametrize("text", ["0-2", "5-3", "a-b", "3-", "-"])
def test_profile_steps_outside_a_window_of_steps_are_refused(text):
    with pytest.raises(ArgumentError, match="--profile_steps must be A-B with 1 <= A <= B"):
        OperationsArgs(profile_steps=text)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--profile_every", "10"], "--profile_every and --profile_all_hosts apply to --profile_steps"),
        (
            ["--profile_steps", "3-5", "--profile_every", "2"],
            "--profile_every 2 must be at least the --profile_steps window (3 steps)",
        ),
        (["--slow_step_factor", "0.5"], "--slow_step_factor must be 0 (off) or above 1, got 0.5"),
        (["--hang_timeout_minutes", "-1"], "--hang_timeout_minutes must be at least 0, got -1.0"),
    ],
)
def test_operations_flags_are_checked_before_anything_runs(argv, problem):
    with pytest.raises(ArgumentError, match=re.escape(problem)):
        parse_args(argv)


def test_the_hang_timeout_defaults_to_on_with_several_processes_only():
    ops = parse_args([])[0].operations
    assert (ops.hang_timeout(1), ops.hang_timeout(4)) == (0.0, OperationsArgs.HANG_TIMEOUT_MULTI_HOST_MINUTES)
    assert parse_args(["--hang_timeout_minutes", "0"])[0].operations.hang_timeout(4) == 0.0


def test_profile_windows_repeat_every_n_steps(tmp_path):
    profiler = profiling.Profiler((3, 4), 10, False, tmp_path, 0)
    starts = {step: profiler.window_starting(step) for step in range(1, 30) if profiler.window_starting(step)}
    assert starts == {3: (3, 4), 13: (13, 14), 23: (23, 24)}
    assert not profiling.Profiler((3, 4), None, False, tmp_path, 1).active  # process 1 without --profile_all_hosts


def trace_viewer_steps(folder) -> list[int]:
    """The train steps of a profile folder, as the profile plugin's own converter (xprof) reads its .xplane.pb."""
    from xprof.convert import raw_to_tool_data

    files = sorted(str(p) for p in folder.glob("*.xplane.pb"))
    assert files, list(folder.iterdir())
    data, content_type = raw_to_tool_data.xspace_to_tool_data(files, "trace_viewer", {})
    assert content_type == "application/json"
    events = json.loads(data)["traceEvents"]
    return sorted(
        {int(e["args"]["step_num"]) for e in events if e.get("args", {}).get("step_name", "").startswith("train")}
    )


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_profile_of_two_steps_is_read_by_the_profile_plugin(where, tmp_path, caplog, request):
    out = storage.path(f"{request.getfixturevalue('gcs_bucket')}/profiled") if where == "bucket" else tmp_path
    step = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((32, 32))
    profiler = profiling.Profiler((2, 3), None, False, out, 0)
    with caplog.at_level(logging.INFO, logger="spmdlm"), profiler:
        for number in range(1, 6):
            with profiler.at_step(number, x):
                x = step(x)
        profiler.close(x)
    folder = out / "tensorboard" / "plugins" / "profile" / "steps_2-3"
    trace = f"{watchdog.host_label(0)}.xplane.pb"
    assert trace in {p.name for p in folder.iterdir()}  # (and a .trace.json.gz)
    if where == "bucket":
        storage.download(folder / trace, tmp_path / "downloaded" / trace, progress=False)
    assert trace_viewer_steps(tmp_path / "downloaded" if where == "bucket" else folder) == [2, 3]
    said = [r.getMessage() for r in caplog.records if "profile of steps" in r.getMessage()]
    logdir = out / "tensorboard"
    assert said == [
        f"profile of steps 2-3 in {folder}; view it with: tensorboard --logdir {logdir} (its Profile tab: pip "
        f"install tensorboard xprof) or xprof --logdir={logdir} --port=6006"
    ]


# A run whose data iterator blocks at the 4th step: Grain's reader thread never returns that batch.
BLOCKED_RUN = """
import sys, threading
from spmdlm.data import pipeline
from spmdlm.launch import main
read = pipeline.HostBatches.__getitem__
def blocked(self, step):
    if step >= 3:
        threading.Event().wait()
    return read(self, step)
pipeline.HostBatches.__getitem__ = blocked
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_hung_run_exits_with_its_stacks_and_the_rerun_resumes_counting_its_restart_loss(
    tmp_path, capsys, cache_dir, tiny_gpt2_config
):
    out = tmp_path / "run"
    argv = flags(out, cache_dir, tiny_gpt2_config, "--max_steps", "5", "--logging_steps", "5", "--export_hf", "false")
    hung = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, *argv, "--hang_timeout_minutes", "0.1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert hung.returncode == watchdog.HANG_EXIT_CODE, hung.stderr[-2000:]
    assert hung.stderr.strip().splitlines()[-1].startswith("error: no step, save or evaluation completed for 0.1")
    (stacks,) = out.glob("hang-*.txt")
    # the reader thread blocked in the data, the main thread waiting for its batch
    assert "in blocked" in stacks.read_text() and "batch = pipeline.to_global(next(iterator)" in stacks.read_text()
    assert json.loads((out / "highest_step.json").read_text()) == {"step": 3}  # the checkpoint is at step 2

    code, logged, _ = launch(capsys, *argv, "--profile_steps", "4-5")
    assert code == 0 and "resumed from the checkpoint at step 2" in logged
    results = json.loads((out / "eval_results.json").read_text())["goodput"]
    assert sum(results["fractions"].values()) == pytest.approx(1.0, abs=0.01)
    assert results["recomputed_steps"] == 1 and results["seconds"]["restart_loss"] > 0
    assert all(results["seconds"][kind] > 0 for kind in ("steps", "compile", "checkpoint", "evaluation"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in records if "loss" in r]  # the throughput beside the loss (Reporter.rates)
    assert train["step"] == 5 and train["tokens_per_second"] > 0 and train["tflops_per_device"] > 0
    (record,) = [r for r in records if "goodput/steps" in r]
    assert record["step"] == 5 and record["goodput/restart_loss"] == results["fractions"]["restart_loss"]
    assert "| goodput " in next(line for line in logged.splitlines() if "summary:" in line)
    assert trace_viewer_steps(out / "tensorboard" / "plugins" / "profile" / "steps_4-5") == [4, 5]


def test_hang_files_are_a_runs_own_outputs_that_overwrite_removes(tmp_path):
    """A hung run's stacks neither make its output dir look like someone else's data nor survive
    --overwrite_output_dir (kept when resuming: they are the evidence)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "hang-host-0.txt").write_text("stacks")
    (out / "run_config.json").write_text("{}")
    (out / "notes.txt").write_text("someone's")
    with pytest.raises(RunError, match="is not empty and holds no run to resume"):
        outputs.refuse_what_is_not_ours(out)
    (out / "notes.txt").unlink()
    with pytest.raises(RunError, match=r"holds outputs of an earlier run .*\(run_config.json\)"):
        outputs.refuse_what_is_not_ours(out)
    control = types.SimpleNamespace(dry_running=False)
    run = types.SimpleNamespace(args=types.SimpleNamespace(control=control), out=out)
    assert outputs.prepare_output_dir(run, outputs.OutputDir("clear", {"max_steps": 2})).previous == {}
    assert out.is_dir() and not any(out.iterdir())
