"""--lr_scheduler_type cosine: from the peak to the floor (--min_lr_ratio x peak) along a half cosine; at
--min_lr_ratio 0 bitwise the schedule of earlier versions."""

from __future__ import annotations

import optax

from spmdlm.optimizers.entries import Schedule, ScheduleInputs


def after(inputs: ScheduleInputs) -> optax.Schedule:
    return optax.cosine_decay_schedule(inputs.peak, inputs.decay_steps, alpha=inputs.min_lr_ratio)


SCHEDULE = Schedule("cosine", after, decays=True)
