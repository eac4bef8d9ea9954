"""What the learning rate does when a resume changes the run's length (issue 61), without a run: the schedule of a
run extended or shortened (--lr_scheduler_on_extension continue, the default, or restart), chained extensions,
batch-size ramps, and what run_config.json records. The launcher's side (a 6-step run extended to 9, the one line it
logs, the rates metrics.jsonl logs) is in test_resume_rules.py."""

import numpy as np
import pytest

from spmdlm.data.batch_ramp import BatchRamp, Extension, RampedSteps
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.errors import ArgumentError
from spmdlm.run_args.sections import OptimizationArgs

PEAK = 1e-3
FIXED = BatchRamp.fixed(8)


def rates(cfg, steps, count) -> np.ndarray:
    """The rate of each of `count` steps (step s + 1 of metrics.jsonl runs at schedule(s))."""
    schedule = learning_rate_schedule(cfg, steps)
    return np.array([float(schedule(s)) for s in range(count)])


def test_a_finished_linear_run_extended_decays_on_from_its_last_rate():
    cfg = OptimizationArgs(learning_rate=PEAK)
    before = rates(cfg, 6, 6)
    extended = rates(cfg, RampedSteps(9, FIXED, (Extension(6, 6),)), 9)
    np.testing.assert_array_equal(extended[:6], before)  # the steps taken keep their rates
    scale = (1 / 6) / (4 / 9)  # the rate reached over the 9-step schedule's at step 6
    np.testing.assert_allclose(extended[6:], PEAK * (1 - np.arange(6, 9) / 9) * scale, rtol=1e-6)
    assert extended[6] <= 1.5 * extended[5] and np.all(np.diff(extended) < 0)
    restarted = rates(cfg, RampedSteps(9, FIXED, (Extension(6, 6, restart=True),)), 9)
    np.testing.assert_array_equal(restarted, rates(cfg, 9, 9))  # as before: the schedule of 9 steps from step 0
    assert restarted[6] > 1.5 * before[5]


def test_a_resume_that_keeps_the_length_or_a_length_free_schedule_changes_nothing():
    cfg = OptimizationArgs(learning_rate=PEAK, warmup_steps=2)
    np.testing.assert_array_equal(rates(cfg, RampedSteps(9, FIXED, (Extension(4, 9),)), 9), rates(cfg, 9, 9))
    for kind in ("constant", "inverse_sqrt"):  # the length does not change them: continue is restart
        cfg = OptimizationArgs(learning_rate=PEAK, warmup_steps=2, lr_scheduler_type=kind)
        np.testing.assert_array_equal(rates(cfg, RampedSteps(20, FIXED, (Extension(6, 10),)), 20), rates(cfg, 20, 20))


def test_wsd_keeps_its_stable_phase_and_decays_at_the_new_end():
    cfg = OptimizationArgs(learning_rate=PEAK, lr_scheduler_type="wsd", decay_steps=4)
    mid = rates(cfg, RampedSteps(30, FIXED, (Extension(10, 20),)), 30)  # extended while stable
    np.testing.assert_array_equal(mid, rates(cfg, 30, 30))  # the 30-step WSD itself: the peak, then the last 4 decay
    done = rates(cfg, RampedSteps(30, FIXED, (Extension(20, 20),)), 30)  # extended after its decay
    np.testing.assert_allclose(done[20:27], done[19], rtol=1e-6)  # stays at the rate reached ...
    assert np.all(np.diff(done[26:]) < 0) and done[-1] < done[19]  # ... and decays again over the last 4 steps


def test_a_mid_run_extension_and_a_shortened_run_are_continuous_and_chain():
    cfg = OptimizationArgs(learning_rate=PEAK, warmup_steps=3, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    for steps in (RampedSteps(40, FIXED, (Extension(12, 20),)), RampedSteps(15, FIXED, (Extension(12, 20),))):
        got = rates(cfg, steps, steps.total)
        np.testing.assert_array_equal(got[:12], rates(cfg, 20, 12))
        assert got[-1] >= PEAK * 0.1 * (1 - 1e-6) and np.all(np.diff(got[11:]) <= 0)  # down to the floor, no jump up
    extended, restarted = rates(cfg, RampedSteps(40, FIXED, (Extension(12, 20),)), 40), rates(cfg, 40, 40)
    assert abs(extended[12] - extended[11]) <= 0.05 * extended[11] and restarted[12] > 1.3 * extended[11]
    chained = RampedSteps(60, FIXED, (Extension(12, 20), Extension(30, 40)))
    twice, once = rates(cfg, chained, 60), rates(cfg, RampedSteps(40, FIXED, (Extension(12, 20),)), 40)
    np.testing.assert_array_equal(twice[:30], once[:30])
    assert abs(twice[30] - twice[29]) <= 0.1 * twice[29]
    # run_config.json records the extensions that shape the schedule: none that kept the length, none before a restart
    assert chained.recorded() == [{"at_step": 12, "steps_before": 20}, {"at_step": 30, "steps_before": 40}]
    noted = RampedSteps(60, FIXED, (Extension(12, 20), Extension(30, 40, restart=True), Extension(50, 60)))
    assert noted.recorded() == []
    np.testing.assert_array_equal(rates(cfg, noted, 60), rates(cfg, 60, 60))


def test_a_ramped_run_extended_continues_in_final_batch_steps():
    ramp = BatchRamp.parse("0:4,3:8")
    cfg = OptimizationArgs(learning_rate=PEAK)
    got = rates(cfg, RampedSteps(12, ramp, (Extension(8, 8),)), 12)
    np.testing.assert_array_equal(got[:8], rates(cfg, RampedSteps(8, ramp), 8))
    assert got[8] <= 1.5 * got[7] and np.all(np.diff(got) < 0)


def test_the_flag_takes_continue_or_restart():
    assert OptimizationArgs().lr_scheduler_on_extension == "continue"
    assert OptimizationArgs(lr_scheduler_on_extension="restart").lr_scheduler_on_extension == "restart"
    with pytest.raises(ArgumentError, match="--lr_scheduler_on_extension 'again': use one of continue, restart"):
        OptimizationArgs(lr_scheduler_on_extension="again")
