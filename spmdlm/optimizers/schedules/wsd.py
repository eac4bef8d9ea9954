"""--lr_scheduler_type wsd (warmup, stable, decay: transformers' warmup_stable_decay): the peak, then linearly to the
floor (--min_lr_ratio x peak) over the last --decay_steps steps, or --decay_ratio of all the steps (default 0.1)."""

from __future__ import annotations

import optax

from spmdlm.bounds import Bounds
from spmdlm.errors import ArgumentError
from spmdlm.optimizers.entries import Flag, Schedule, ScheduleInputs, Values

WSD_DECAY_RATIO = 0.1  # wsd without --decay_steps or --decay_ratio: the last 10% of the steps decay
DECAY_STEPS = Flag(
    "decay_steps",
    int,
    None,
    "wsd: the steps of the final decay (default: --decay_ratio of the steps)",
    resume=False,
    bounds=Bounds(1),
)
DECAY_RATIO = Flag(
    "decay_ratio",
    float,
    None,
    f"wsd: the fraction of the steps spent decaying (default: {WSD_DECAY_RATIO})",
    resume=False,
    bounds=Bounds(0, 1, above=True, hint="a fraction of the steps"),
)


def wsd_decay_steps(values: Values, total_steps: int) -> int:
    """The steps of WSD's final decay: --decay_steps, else --decay_ratio of all the steps (at least one)."""
    if values["decay_steps"] is not None:
        return values["decay_steps"]
    ratio = WSD_DECAY_RATIO if values["decay_ratio"] is None else values["decay_ratio"]
    return max(1, round(ratio * total_steps))


def after(inputs: ScheduleInputs) -> optax.Schedule:
    cooldown = min(wsd_decay_steps(inputs.flags, inputs.total_steps), inputs.decay_steps)
    return optax.join_schedules(
        [optax.constant_schedule(inputs.peak), optax.linear_schedule(inputs.peak, inputs.floor, cooldown)],
        [inputs.decay_steps - cooldown],
    )


def check(values: Values) -> None:
    if values["decay_steps"] is not None and values["decay_ratio"] is not None:
        raise ArgumentError("give one of --decay_steps and --decay_ratio")


def check_steps(values: Values, warmup_steps: int, max_steps: int) -> None:
    """The warmup and the final decay fit in --max_steps."""
    decay_steps = values["decay_steps"]
    if decay_steps and 0 < max_steps < warmup_steps + decay_steps:
        raise ArgumentError(
            f"--warmup_steps {warmup_steps} and --decay_steps {decay_steps} exceed "
            f"--max_steps {max_steps}; give fewer decay steps (or --decay_ratio)"
        )


SCHEDULE = Schedule("wsd", after, decays=True, flags=(DECAY_STEPS, DECAY_RATIO), check=check, check_steps=check_steps)
