"""--lr_scheduler_type constant: the peak after the warmup (unlike transformers', it warms up when --warmup_steps is
given, as it always did here)."""

from __future__ import annotations

import optax

from spmdlm.optimizers.entries import Schedule, ScheduleInputs


def after(inputs: ScheduleInputs) -> optax.Schedule:
    return optax.constant_schedule(inputs.peak)


SCHEDULE = Schedule("constant", after, decays=False)
