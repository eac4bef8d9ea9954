"""Every signal that ends a run saves first: schedulers and terminals send more than SIGTERM, and an evaluation in
progress gives way to the save (a preemption's grace period is often 30 s)."""

import json
import os
import signal

import pytest
from test_reliability import flags, launch

from spmdlm import checkpoint
from spmdlm.engine.step import Stepper
from spmdlm.train.safety.guard import STOP_SIGNALS


@pytest.mark.parametrize(
    "signum",
    [s for s in STOP_SIGNALS if s not in (signal.SIGINT, signal.SIGTERM)],
    ids=lambda s: signal.Signals(s).name,
)
def test_each_stop_signal_saves_at_the_current_step(signum, capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config):
    out = tmp_path / "run"
    original = Stepper.train_step

    def step_then_signal(self, state, batch, step):
        result = original(self, state, batch, step)
        if step == 0:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(Stepper, "train_step", step_then_signal)
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--save_steps", "100"))
    name = signal.Signals(signum).name
    assert code == 128 + signum and err.strip() == err.strip().splitlines()[0]
    assert err.startswith(f"spmdlm: stopped by {name} at step 1")
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [1]


@pytest.mark.slow
def test_a_stop_during_evaluation_abandons_it_and_saves(capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config):
    out = tmp_path / "run"
    original, batches = Stepper.eval_step, []

    def eval_then_sigterm(self, state, batch, totals):
        batches.append(1)
        if len(batches) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during the first eval batch
        return original(self, state, batch, totals)

    monkeypatch.setattr(Stepper, "eval_step", eval_then_sigterm)
    code, _, err = launch(
        capsys,
        *flags(
            out,
            cache_dir,
            tiny_gpt2_config,
            "--save_steps",
            "100",
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "1",
            "--validation_split_percentage",
            "40",
        ),
    )
    assert code == 143 and err.startswith("spmdlm: stopped by SIGTERM at step 2")
    assert len(batches) == 1  # the evaluation stopped at once; it would have run many more batches
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [2]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval_loss" in r for r in records), records  # nothing half-evaluated is reported


def test_the_stop_deadline_leaves_no_descriptor_behind():
    """The deadline's pipe is closed once, after its thread has ended: a thread closing it by number while the
    main thread still writes to it closed whatever file had meanwhile reused the number (the next test's)."""
    from spmdlm.train.safety.guard import StopOnSignal

    opened = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with StopOnSignal() as stop:
            deadline = stop._deadline
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.should_stop(0) and stop.signum == signal.SIGUSR1
            assert not deadline._thread.is_alive()
        with StopOnSignal():  # no signal: left on exit
            pass
    assert set(os.listdir("/proc/self/fd")) == opened
    assert signal.set_wakeup_fd(-1) == -1  # the process's wakeup fd is restored
