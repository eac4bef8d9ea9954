"""A finite divergence stops a run like a NaN (exit 3): the loss bound of spmdlm/train/safety/divergence.py, judged on
synthetic loss curves (a normal curve and spikes that recover never fire; a runaway does), its stop (the diverged
checkpoints set aside, one line), and one tiny run with an absurd learning rate and no clipping."""

import math
import types

import numpy as np
import pytest
from conftest import read_metrics
from test_reliability import flags, launch

from spmdlm import checkpoint
from spmdlm.errors import DivergenceError
from spmdlm.train.safety.divergence import CONSECUTIVE, LossBound

VOCAB = 50257  # the floor: ln(50257) + 10 = 20.8


def fired(losses, bound: LossBound | None = None, every: int = 10) -> list[tuple[int, str]]:
    """(step, line) of each log the bound calls a divergence."""
    bound = bound or LossBound(None, VOCAB)
    judged = [(step * every, bound.judge(step * every, loss)) for step, loss in enumerate(losses, 1)]
    return [(step, line) for step, line in judged if line]


def curve(logs: int = 200, seed: int = 0) -> np.ndarray:
    """A pretraining loss: ln(vocabulary) down to ~3, with noise."""
    rng = np.random.default_rng(seed)
    return 3.0 + (math.log(VOCAB) - 3.0) * np.exp(-np.arange(logs) / 20) + rng.normal(0, 0.05, logs)


def test_a_normal_loss_curve_never_fires():
    assert fired(curve()) == []
    assert fired(curve(), LossBound(None, 256)) == []  # a small vocabulary: a lower floor, still far above


def test_spikes_that_recover_never_fire():
    losses = list(curve(100))
    losses[40:42] = [60.0, 1e4]  # past the bound, but for fewer than CONSECUTIVE logs
    losses[60:70] = [15.0] * 10  # a long spike, below the floor (ln(V) + 10)
    losses[80:82] = [1e6, 50.0]
    assert fired(losses) == []


def test_a_start_far_above_the_uniform_loss_that_falls_never_fires():
    """A badly scaled initialization: its first step's loss, 26, 20 nats above ln(256); the floor starts there."""
    bound = LossBound(None, 256, start_loss=26.0)
    assert bound.bound() == (36.0, "the first step's loss 26 + 10")
    assert fired([25.0, 24.0, 22.0, 21.0, 18.0, 12.0, 8.0, 6.0], bound) == []
    assert fired([25.0, 24.0, 22.0], LossBound(None, 256))  # without it: past ln(256) + 10, 3 logs in a row


@pytest.mark.parametrize(
    "tail",
    [
        [1e3, 1e6, 9.6e13, 9.6e13],  # the audit's: learning rate 1e6 without clipping
        [1e4] * 40,  # a plateau far above: it never raises its own bound
        [40.0, 45.0, 50.0, 60.0],  # slow, but past the floor
    ],
    ids=["runaway", "plateau", "slow"],
)
def test_a_runaway_fires_on_the_third_log_past_the_bound(tail):
    losses = list(curve(50)) + tail
    found = fired(losses)
    assert found, "a runaway must fire"
    step, line = found[0]
    assert step == (50 + CONSECUTIVE) * 10
    assert line.startswith(f"training diverged at step {step}: the logged loss went past its bound")
    assert f"{CONSECUTIVE} logs in a row" in line and f"{tail[CONSECUTIVE - 1]:.4g} at step {step}" in line
    assert "ln(vocabulary 50257) + 10" in line and "--max_loss" in line


def test_the_bound_follows_the_history_above_the_floor():
    bound = LossBound(None, 256)  # floor: ln(256) + 10 = 15.5
    bound.history.extend([40.0] * 5)  # a run whose losses sit at 40: its bound is 3 x 40
    assert bound.bound() == (120.0, "3 x 40, the median of the last 5 logged losses")
    assert [bound.judge(step, 100.0) for step in range(1, 4)] == [None] * 3


def test_max_loss_is_an_absolute_bound_and_0_turns_it_off():
    assert [s for s, _ in fired([2.0, 6.0, 6.0, 6.0], LossBound(5.0, VOCAB), every=1)] == [4]
    assert "its bound 5 (--max_loss)" in fired([6.0] * 3, LossBound(5.0, VOCAB))[0][1]
    assert fired([9.6e13] * 10, LossBound(0.0, VOCAB)) == []
    assert fired([math.nan, math.inf] * 5) == []  # not finite: the loop's check_finite stops those


def test_at_the_last_step_one_loss_past_the_bound_is_enough():
    bound = LossBound(None, VOCAB, total_steps=30)
    assert bound.judge(10, 5.0) is None and bound.judge(20, 5.0) is None
    assert "at the last step (1e+04 at step 30)" in bound.judge(30, 1e4)


class Manager:
    """The checkpoint manager's part a stop uses: step folders under `directory`."""

    def __init__(self, directory, steps):
        self.directory = directory
        directory.mkdir(parents=True)
        for step in steps:
            (directory / str(step)).mkdir()

    def all_steps(self):
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def wait_until_finished(self):
        pass

    reload = wait_until_finished


def run_args(**optimization):
    defaults = dict(learning_rate=1e6, max_grad_norm=0.0, z_loss=0.0)
    return types.SimpleNamespace(
        optimization=types.SimpleNamespace(**{**defaults, **optimization}),
        model=types.SimpleNamespace(dtype="float32"),
        operations=types.SimpleNamespace(max_loss=None),
    )


def metrics(loss: float, tokens: int = 100, skips: int = 0) -> dict:
    return {"loss_sum": loss * tokens, "tokens": tokens, "grad_norm": 1.0, "consecutive_skips": skips}


def test_the_stop_sets_aside_the_checkpoints_saved_after_the_last_good_log(tmp_path):
    manager = Manager(tmp_path / "checkpoints", [10, 20, 30])
    bound = LossBound.for_run(run_args(), VOCAB, total_steps=100)
    bound.check([metrics(3.0)] * 2, 10, manager, run_args())
    bound.check([metrics(1e6), metrics(1.0, skips=1)], 20, manager, run_args())  # the skipped step is left out
    bound.check([metrics(1e9)] * 2, 30, manager, run_args())
    with pytest.raises(DivergenceError) as stop:
        bound.check([metrics(9.6e13)] * 2, 40, manager, run_args())
    line = str(stop.value)
    assert "\n" not in line and line.startswith("training diverged at step 40:")
    assert "(1e+06 at step 20, 1e+09 at step 30, 9.6e+13 at step 40)" in line
    assert "the last good checkpoint (step 10) is kept" in line
    assert f"the diverged ones (steps 20, 30) moved to OUTPUT_DIR/{checkpoint.DAMAGED_DIR}" in line
    assert "try a lower --learning_rate (now 1e+06), --max_grad_norm 1.0 (now 0)" in line
    assert manager.all_steps() == [10]
    moved = sorted((tmp_path / checkpoint.DAMAGED_DIR).iterdir())
    assert [(p.name.split("-")[0], p.name.endswith("-diverged")) for p in moved] == [("20", True), ("30", True)]


def test_a_stop_before_any_good_checkpoint_says_so(tmp_path):
    manager = Manager(tmp_path / "checkpoints", [])
    bound = LossBound(None, VOCAB)
    with pytest.raises(DivergenceError, match="no good checkpoint was written; nothing after it"):
        for step in (2, 4, 6):  # the first step's loss is the initial model's (before any update)
            bound.check([metrics(6.0 if step == 2 else 1e8), metrics(1e8)], step, manager, run_args())


@pytest.mark.slow
def test_an_absurd_learning_rate_without_clipping_stops_as_a_divergence(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    """The audit's run: --learning_rate 1e6 without clipping took the loss to 9.6e13, exited 0 and exported. Logged
    and saved at every step: step 1's loss (the initial model's) is within the bound, the next ones are not."""
    out = tmp_path / "run"
    argv = ["--learning_rate", "1e6", "--max_grad_norm", "0", "--max_steps", "12", "--logging_steps", "1"]
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, *argv, "--save_steps", "1"))
    lines = err.strip().splitlines()
    assert code == 3, err
    assert len(lines) == 1 and "training diverged at step 4: the logged loss went past its bound" in lines[0], lines
    assert "the last good checkpoint (step 1) is kept, the diverged ones (steps 2, 3) moved to" in lines[0]
    assert "try a lower --learning_rate (now 1e+06)" in lines[0]
    assert not (out / "hf").exists()
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [1]
    moved = sorted((out / checkpoint.DAMAGED_DIR).iterdir())
    assert [(p.name.split("-")[0], p.name.endswith("-diverged")) for p in moved] == [("2", True), ("3", True)]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]
