"""--optim schedule_free_adamw: optax.contrib.schedule_free over AdamW without momentum, b1 = --adam_beta1 (the
interpolation weight between the iterate and its average). The train state holds the interpolation y, where the
gradients are taken; evaluation, the export and samples use the average x (`evaluation_params`)."""

from __future__ import annotations

import optax

from spmdlm.errors import ArgumentError
from spmdlm.optimizers.entries import (
    ADAM_BETA1,
    ADAM_BETA2,
    ADAM_EPSILON,
    Optimizer,
    OptimizerInputs,
    Values,
    states_of,
)


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw with its weight decay masked: the same chain, built here only because that
    function's decay takes no mask."""
    flags = inputs.flags
    base = optax.chain(
        optax.scale_by_rms(
            decay=flags["adam_beta2"], eps=flags["adam_epsilon"], eps_in_sqrt=False, bias_correction=True
        ),
        optax.add_decayed_weights(inputs.weight_decay, inputs.decay_mask),
        optax.scale_by_learning_rate(inputs.schedule),
    )
    return optax.contrib.schedule_free(base, inputs.schedule, b1=flags["adam_beta1"])


def check(values: Values) -> None:
    if values["adam_beta1"] == 0:
        raise ArgumentError(
            "--optim schedule_free_adamw needs --adam_beta1 above 0 (its weight between the iterate and its average)"
        )


def evaluation_params(opt_state, params):
    """The averaged sequence x, (y − (1 − b1) · z) / b1 (optax.contrib.schedule_free_eval_params)."""
    state = states_of(opt_state, optax.contrib.ScheduleFreeState)[0]
    return optax.contrib.schedule_free_eval_params(state, params)


OPTIMIZER = Optimizer(
    "schedule_free_adamw",
    build,
    flags=(ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON),
    check=check,
    evaluation_params=evaluation_params,
)
