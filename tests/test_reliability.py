"""Faults a run meets in practice, and what it does: stop in one line, keep every checkpoint, fall back, resume exactly.

Every launcher run here is in-process on a 0.14M-parameter GPT-2 (block 16, 8 devices as data=4,fsdp=2), so a run
costs a few seconds, most of it compiling. `base_run` (4 steps, checkpoints at 2 and 4, evaluated and exported) is
the uninterrupted reference the faulted runs are compared with, bit for bit.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, final_params, read_metrics, run_argv

import spmdlm.cli.launch
from spmdlm import checkpoint, devices
from spmdlm.engine.step import Stepper
from spmdlm.launch import main
from spmdlm.train import run as train_run
from spmdlm.train.safety.guard import RunLock
from spmdlm.train.stages import corpora, resolve
from spmdlm.train.stages.outputs import OutputDir
from spmdlm.train.stages.program import setup_state


def flags(out, cache_dir, config, *extra) -> list[str]:
    sizes = dict(block_size=16, per_device_train_batch_size=1, mesh="data=4,fsdp=2")
    steps = dict(max_steps=4, save_steps=2, logging_steps=2, learning_rate="1e-3")
    return run_argv(out, config, cache_dir, *extra, train_file=FIXTURES / "overfit.txt", **sizes, **steps)


def launch(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_dir, tiny_gpt2_config):
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(flags(out, cache_dir, tiny_gpt2_config)) == 0
    return out


def same_params(a, b) -> bool:
    pa, pb = final_params(a), final_params(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def copy_run(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


# -- divergence ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_divergence_stops_with_exit_3_and_saves_nothing_non_finite(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    out = tmp_path / "run"
    code, _, err = launch(
        capsys,
        *flags(
            out,
            cache_dir,
            tiny_gpt2_config,
            "--learning_rate",
            "1e30",
            "--max_steps",
            "30",
            "--logging_steps",
            "5",
            "--save_steps",
            "5",
            "--max_grad_norm",
            "0",
        ),
    )
    assert code == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "diverged at step" in lines[0] and "--learning_rate (now 1e+30)" in lines[0], lines
    assert not (out / "hf").exists()
    for record in read_metrics(out):  # strict JSON, finite values only
        assert all(np.isfinite(v) for v in record.values() if isinstance(v, float))
    if checkpoint.make_manager(out, read_only=True).all_steps():
        assert all(np.isfinite(v).all() for v in final_params(out).values())


# -- damaged checkpoints -----------------------------------------------------------------------------------------------
def _largest_array_file(step_dir):
    return max((step_dir / "model").rglob("d/*"), key=lambda p: p.stat().st_size)


DAMAGE = {
    "0xff_bytes": lambda step: _overwrite(_largest_array_file(step), 1000, b"\xff" * 4096),
    "data_file_deleted": lambda step: _largest_array_file(step).unlink(),
    "data_file_truncated": lambda step: os.truncate(_largest_array_file(step), 1000),
    "metadata_emptied": lambda step: (step / "model" / "_METADATA").write_text(""),
    "iterator_state_deleted": lambda step: next((step / "data").glob("process_*.json")).unlink(),
    "step_dir_emptied": lambda step: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in step.iterdir()],
    "fingerprint_mismatch": lambda step: _edit_fingerprint(step / "config" / "metadata"),
}


def _overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _edit_fingerprint(path):
    """Bytes that still decode but are not what was saved: what the fingerprints are for."""
    saved = json.loads(path.read_text())
    key = next(k for k in saved["fingerprints"] if "wte" in k)
    saved["fingerprints"][key] ^= 1
    path.write_text(json.dumps(saved))


@pytest.fixture(scope="module")
def restore_target(base_run, cache_dir, tiny_gpt2_config):
    """The run's abstract (model, optimizer) state and data iterator, built by the loop's own stages."""
    from spmdlm.cli.launch import parse_args
    from spmdlm.data import pipeline

    args, _ = parse_args(flags(base_run, cache_dir, tiny_gpt2_config))
    run = resolve.resolve(args, 0.0)
    prepared = train_run.prepare(run, OutputDir("fresh"), corpora.read_corpora(args.data))
    vocabulary, objective = prepared.vocabulary, prepared.data.objective
    total_steps, tokenizer = prepared.total_steps, vocabulary.tokenizer
    model = setup_state(run, vocabulary.config, objective, total_steps, tokenizer=tokenizer, abstract=True)
    iterator = pipeline.train_batches(
        prepared.data.train,
        objective,
        seed=args.control.seed,
        global_batch=run.global_batch,
        num_epochs=prepared.schedule.num_epochs,
    )
    return model.state, iterator


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_restored(
    damage, base_run, restore_target, tmp_path, caplog
):
    """At the checkpoint level for every kind of damage (cheap); the launcher does the same (next test)."""
    out = copy_run(base_run, tmp_path)
    DAMAGE[damage](out / "checkpoints" / "4")
    manager = checkpoint.make_manager(out)
    with caplog.at_level("WARNING", logger="spmdlm"):
        _, step = checkpoint.restore_newest_good(manager, *restore_target)
    assert step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "spmdlm"]
    assert len(warnings) == 1 and "step 4" in warnings[0] and "moved it to" in warnings[0], warnings
    (aside,) = (out / checkpoint.DAMAGED_DIR).iterdir()
    assert aside.name.startswith("4-") and not (out / "checkpoints" / "4").exists()


def test_the_launcher_falls_back_and_resumes_exactly(capsys, base_run, tmp_path, cache_dir, tiny_gpt2_config):
    out = copy_run(base_run, tmp_path)
    DAMAGE["0xff_bytes"](out / "checkpoints" / "4")
    (out / "eval_results.json").unlink()  # so the finished run has something left to do: it must restore
    code, stdout, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 0, err
    # whether the flipped bytes still decode (then the fingerprints catch them) depends on the file layout
    assert "the checkpoint at step 4 " in stdout and "moved it to" in stdout
    assert "resumed from the checkpoint at step 2" in stdout
    assert same_params(out, base_run)  # retrained 2 -> 4 from the good checkpoint: the same weights
    assert any((out / checkpoint.DAMAGED_DIR).iterdir())


# -- finished runs, locks ------------------------------------------------------------------------------------------
def test_rerunning_a_finished_run_redoes_only_what_is_missing(capsys, base_run, tmp_path, cache_dir, tiny_gpt2_config):
    out = copy_run(base_run, tmp_path)
    results, metrics = (out / "eval_results.json").read_bytes(), (out / "metrics.jsonl").read_bytes()
    # a lock left by a dead process on this host is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    code, stdout, _ = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 0 and "taking over the lock" in stdout and "nothing to do" in stdout
    assert (out / "eval_results.json").read_bytes() == results and (out / "metrics.jsonl").read_bytes() == metrics
    assert not (out / "run.lock").exists()

    shutil.rmtree(out / "hf")
    code, stdout, _ = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 0 and (out / "hf" / "model.safetensors").is_file()
    assert "compiled" not in stdout  # nothing to train: the train step is not compiled
    assert json.loads((out / "eval_results.json").read_text()) == json.loads(results)  # the goodput of the training
    assert (out / "metrics.jsonl").read_bytes() == metrics  # no duplicate compile or eval events


def test_a_second_run_in_the_same_output_dir_is_refused(capsys, base_run, tmp_path, cache_dir, tiny_gpt2_config):
    out = copy_run(base_run, tmp_path)
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "started": "2026-11-30 10:00:00"}
    (out / "run.lock").write_text(json.dumps(holder))
    before = sorted(p.name for p in out.rglob("*"))
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--overwrite_output_dir"))
    assert code == 2
    assert err.strip() == (
        f"error: --output_dir {out} is in use by another run (pid {os.getppid()} on host "
        f"{socket.gethostname()}, started 2026-11-30 10:00:00); wait for it to finish or choose "
        "another --output_dir"
    )
    assert sorted(p.name for p in out.rglob("*")) == before  # --overwrite_output_dir removed nothing


def test_a_refused_run_leaves_no_directory_it_made(tmp_path):
    out = tmp_path / "runs" / "gpt2-tiny-corpus"  # runs/ did not exist either: the default output dir's parent
    with pytest.raises(RuntimeError):
        with RunLock(out):
            assert (out / "run.lock").is_file()
            raise RuntimeError("refused after the lock was taken (a layout the dataset does not have)")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()
    with RunLock(out):
        pass
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["other"]  # what was there before stays


# -- save failures, preemption -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_failed_save(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        out = disk / "run"
        code, _, err = launch(
            capsys,
            *flags(out, cache_dir, tiny_gpt2_config, "--max_steps", "8", "--save_steps", "1", "--logging_steps", "1"),
        )
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0] and str(out) in lines[0], lines
        saved = checkpoint.make_manager(out, read_only=True).all_steps()
        steps = [r["step"] for r in read_metrics(out) if "loss" in r]
        assert saved and max(steps) <= max(saved) + 2  # stopped at the failed save, not at the end of the run
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # orbax's writer threads may still hold files


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_and_the_resume_is_exact(
    capsys, monkeypatch, base_run, tmp_path, cache_dir, tiny_gpt2_config
):
    out = tmp_path / "run"
    original = Stepper.train_step

    def step_then_sigterm(self, state, batch, step):
        result = original(self, state, batch, step)
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the handler between two steps
        return result

    monkeypatch.setattr(Stepper, "train_step", step_then_sigterm)
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--save_steps", "100"))
    assert code == 143 and err.strip().startswith("spmdlm: stopped by SIGTERM at step 1")
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [1]
    monkeypatch.undo()
    code, stdout, _ = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--logging_steps", "1"))
    assert code == 0 and "resuming with changed settings: logging_steps 2 -> 1" in stdout
    assert same_params(out, base_run)


def test_a_second_ctrl_c_quits_at_once():
    from spmdlm.train.safety.guard import StopOnSignal

    # Python's own Ctrl-C handler, as in a terminal (a shell's background job starts with SIGINT ignored).
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.should_stop(0) and stop.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outside)


def test_ctrl_c_outside_training_is_one_line(capsys, monkeypatch, tmp_path):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(spmdlm.cli.launch, "run", interrupted)
    code, _, err = launch(capsys, "--output_dir", str(tmp_path / "x"), "--train_file", str(FIXTURES / "overfit.txt"))
    assert code == 130 and len(err.strip().splitlines()) == 1


# -- memory and mesh checks ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_step_that_does_not_fit_is_refused_before_anything_is_written(
    capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    monkeypatch.setattr(devices, "device_memory_bytes", lambda: (2**20, "device"))  # a 1 MiB accelerator
    out = tmp_path / "run"
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 2
    assert "per device" in err and "but has the device's 0.0 GiB" in err and "--gradient_checkpointing" in err
    assert not out.exists()


@pytest.mark.slow
def test_a_tensor_axis_that_shards_nothing_is_an_error(capsys, tmp_path, cache_dir):
    config = tmp_path / "odd.json"  # no dimension divisible by 8: heads x head size 36, MLP 100, vocab 510
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": 510,
                "n_positions": 64,
                "n_embd": 36,
                "n_layer": 1,
                "n_head": 4,
                "n_inner": 100,
            }
        )
    )
    out = tmp_path / "run"
    code, _, err = launch(capsys, *flags(out, cache_dir, config, "--mesh", "tensor=8"))
    assert code == 2 and "the tensor axis (8) divides none of the model's sharded dimensions" in err
    assert not out.exists()


def test_a_changed_global_batch_is_refused_with_the_one_that_resumes(
    capsys, base_run, tmp_path, cache_dir, tiny_gpt2_config
):
    out = copy_run(base_run, tmp_path)
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--per_device_train_batch_size", "2"))
    assert code == 2 and "resume with --global_batch_size 8" in err
