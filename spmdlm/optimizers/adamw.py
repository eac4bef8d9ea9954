"""--optim adamw (the default): optax.adamw, decaying all but biases and norm scales."""

from __future__ import annotations

import optax

from spmdlm.optimizers.entries import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, Optimizer, OptimizerInputs


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    return optax.adamw(
        inputs.schedule,
        b1=inputs.flags["adam_beta1"],
        b2=inputs.flags["adam_beta2"],
        eps=inputs.flags["adam_epsilon"],
        weight_decay=inputs.weight_decay,
        mask=inputs.decay_mask,
    )


OPTIMIZER = Optimizer("adamw", build, flags=(ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON))
