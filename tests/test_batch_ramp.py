"""--batch_size_ramp's arithmetic without a run: its spec, the stages a mesh takes it in, the examples each step
consumes, the run's length in steps and the learning-rate schedule it counts in final-batch steps. The pipeline's
side is in test_pipeline.py, a run resumed mid-ramp in test_train.py, refusals in test_errors.py."""

import math

import numpy as np
import pytest

from spmdlm.data import pipeline
from spmdlm.data.batch_ramp import BatchRamp, BatchStage, RampedSteps, largest_stage, plan_stages, stage_at
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.errors import ArgumentError
from spmdlm.run_args.sections import ControlArgs, OptimizationArgs


def test_the_spec_is_parsed_and_bad_ones_are_refused_naming_the_entry():
    ramp = BatchRamp.parse("0:64, 2000:256,8000:512")
    assert (ramp.steps, ramp.sizes, ramp.final, ramp.ramps) == ((0, 2000, 8000), (64, 256, 512), 512, True)
    assert ramp.spec() == "0:64,2000:256,8000:512" and not BatchRamp.parse("0:8").ramps
    for text, said in [
        ("0:64,2000", "entry '2000' is not STEP:SEQUENCES"),
        ("0:64,x:8", "entry 'x:8'"),
        ("0:0", "entry '0:0'"),
        ("0:8,-5:16", "entry '-5:16'"),
        ("0:8,2147483648:16", "entry '2147483648:16'"),
        ("10:64,20:128", "the first entry must be at step 0"),
        ("0:64,20:128,20:256", "entry '20:256' does not come after step 20"),
        ("0:64,30:128,20:256", "entry '20:256' does not come after step 30"),
    ]:
        with pytest.raises(ArgumentError, match=said):
            BatchRamp.parse(text)


def test_flags_that_set_the_batch_too_are_refused():
    assert ControlArgs(batch_size_ramp="0:8,4:16", per_device_train_batch_size=2).batch_size_ramp == "0:8,4:16"
    with pytest.raises(ArgumentError, match="leave --gradient_accumulation_steps out"):
        ControlArgs(batch_size_ramp="0:8,4:16", gradient_accumulation_steps=2)
    with pytest.raises(ArgumentError, match="leave --global_batch_size out"):
        ControlArgs(batch_size_ramp="0:8,4:16", global_batch_size=16)
    with pytest.raises(ArgumentError, match="is not STEP:SEQUENCES"):
        ControlArgs(batch_size_ramp="0:8;4:16")


def test_each_stage_takes_the_largest_per_device_batch_that_divides_it():
    ramp = BatchRamp.parse("0:64,2000:256,8000:512,9000:96")
    stages = plan_stages(ramp, batch_devices=8, processes=2, max_per_device=16)
    assert stages == (
        BatchStage(0, 64, 8, 1),
        BatchStage(2000, 256, 16, 2),
        BatchStage(8000, 512, 16, 4),
        BatchStage(9000, 96, 12, 1),
    )
    assert plan_stages(BatchRamp.parse("0:96"), 8, 1, 8) == (BatchStage(0, 96, 6, 2),)  # 12 a device: 6 x 2
    assert plan_stages(BatchRamp.parse("0:56"), 8, 1, 4) == (BatchStage(0, 56, 1, 7),)  # 7 a device: 1 x 7
    assert largest_stage(stages) == stages[2]  # 16 a device, the most accumulation
    assert [stage_at(stages, s).global_batch for s in (0, 1999, 2000, 8999, 9000, 10**6)] == [64, 64, 256, 512, 96, 96]


def test_a_batch_the_devices_or_processes_do_not_divide_is_refused_with_the_fix():
    with pytest.raises(ArgumentError, match=r"entry 2000:100: 100 sequences do not divide among the 8 batch devices"):
        plan_stages(BatchRamp.parse("0:64,2000:100"), 8, 1, 8)
    with pytest.raises(ArgumentError, match=r"use a multiple of 8 \(e.g. 2000:104\)"):
        plan_stages(BatchRamp.parse("0:64,2000:100"), 8, 1, 8)
    with pytest.raises(ArgumentError, match=r"entry 0:6: 6 sequences do not divide among the 4 processes.*of 4"):
        plan_stages(BatchRamp.parse("0:6"), 2, 4, 8)


def test_examples_and_steps_follow_the_batch_of_each_step():
    ramp = BatchRamp.parse("0:4,3:8,5:16")
    sizes = [ramp.batch_at(s) for s in range(12)]
    assert sizes == [4, 4, 4, 8, 8] + [16] * 7
    starts = np.concatenate([[0], np.cumsum(sizes)])
    assert [ramp.examples_before(s) for s in range(13)] == starts.tolist()
    for examples in range(0, 156):  # the most steps whose examples fit (within the 12 steps of `starts`)
        assert ramp.steps_within(examples) == int(np.searchsorted(starts, examples, side="right")) - 1
    np.testing.assert_allclose([float(ramp.final_batch_steps(s)) for s in range(13)], starts / 16, rtol=1e-7)
    assert ramp.schedule_steps(6) == math.ceil(starts[6] / 16) == 3
    fixed = BatchRamp.fixed(8)
    assert [fixed.examples_before(s) for s in (0, 5)] == [0, 40] and fixed.steps_within(41) == 5


def test_entries_a_run_never_reaches_are_named():
    ramp = BatchRamp.parse("0:4,3:8,5:16")
    assert ramp.unreached(6) is None  # step 5, the last entry, is the run's last step
    line = ramp.unreached(5)
    assert line.startswith("--batch_size_ramp 0:4,3:8,5:16: the run ends at step 5, so the entries from step 5 on")
    assert "(its last global batch is 8)" in line and "--max_steps" in line
    assert "from step 3 on" in ramp.unreached(2) and "(its last global batch is 4)" in ramp.unreached(2)


def test_a_ramps_length_in_epochs_counts_examples():
    ramp = BatchRamp.parse("0:4,5:8")
    schedule = pipeline.make_schedule(100, ramp, 2.0, -1)  # 200 examples: 5 x 4, then 22 x 8 (180 of them)
    assert (schedule.total_steps, schedule.num_epochs, schedule.steps_per_epoch) == (27, 2, 12)
    assert pipeline.make_schedule(100, ramp, 1.0, 40).num_epochs == math.ceil(ramp.examples_before(40) / 100)
    assert pipeline.make_schedule(100, 8, 3.0, -1) == pipeline.Schedule(12, 36, 3)  # no ramp: as it was


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_schedule_runs_in_final_batch_steps(kind):
    """The learning rate at step s is the schedule at x = examples before s / the final batch, over a run of
    T = ceil(examples of the run / the final batch) such steps: GPT-3's token-based warmup and decay."""
    ramp, total, peak, warmup = BatchRamp.parse("0:4,10:8,20:32"), 40, 1e-3, 3
    cfg = OptimizationArgs(learning_rate=peak, warmup_steps=warmup, lr_scheduler_type=kind)
    schedule = learning_rate_schedule(cfg, RampedSteps(total, ramp))
    x = np.array([ramp.examples_before(s) for s in range(total)], np.float64) / 32
    horizon = math.ceil(ramp.examples_before(total) / 32)
    decayed = np.clip((x - warmup) / (horizon - warmup), 0, 1)
    after = 1 - decayed if kind == "linear" else 0.5 * (1 + np.cos(np.pi * decayed))
    expected = np.where(x < warmup, peak * x / warmup, peak * after)
    np.testing.assert_allclose([float(schedule(s)) for s in range(total)], expected, rtol=2e-6, atol=1e-12)
