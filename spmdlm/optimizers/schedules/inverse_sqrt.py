"""--lr_scheduler_type inverse_sqrt: peak x sqrt(T / (s + T)) for the s steps since the warmup, T = the warmup's steps
(or 10000 without warmup), never below the floor: transformers' get_inverse_sqrt_schedule, with a floor."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from spmdlm.optimizers.entries import Schedule, ScheduleInputs

INVERSE_SQRT_TIMESCALE = 10_000  # inverse_sqrt without warmup (transformers' get_inverse_sqrt_schedule)


def after(inputs: ScheduleInputs) -> optax.Schedule:
    # Written here: optax has no inverse-square-root schedule. join_schedules evaluates it before the warmup ends
    # too, at negative s: clipped (no division by zero).
    peak, ratio, timescale = inputs.peak, inputs.min_lr_ratio, inputs.warmup or INVERSE_SQRT_TIMESCALE
    return lambda s: peak * jnp.maximum(ratio, jnp.sqrt(timescale / (jnp.maximum(s, 0) + timescale)))


SCHEDULE = Schedule("inverse_sqrt", after, decays=True)
