"""--lr_scheduler_type linear (the default): from the peak to the floor (--min_lr_ratio x peak) at the run's last
step; at --min_lr_ratio 0 bitwise the schedule of earlier versions (a resumed run's rate does not change)."""

from __future__ import annotations

import optax

from spmdlm.optimizers.entries import Schedule, ScheduleInputs


def after(inputs: ScheduleInputs) -> optax.Schedule:
    return optax.linear_schedule(inputs.peak, inputs.floor, inputs.decay_steps)


SCHEDULE = Schedule("linear", after, decays=True)
