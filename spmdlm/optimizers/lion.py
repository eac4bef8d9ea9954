"""--optim lion: optax.lion (the sign of an interpolated momentum), b1/b2 = --adam_beta1/--adam_beta2."""

from __future__ import annotations

import optax

from spmdlm.optimizers.entries import ADAM_BETA1, ADAM_BETA2, Optimizer, OptimizerInputs


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    return optax.lion(
        inputs.schedule,
        b1=inputs.flags["adam_beta1"],
        b2=inputs.flags["adam_beta2"],
        weight_decay=inputs.weight_decay,
        mask=inputs.decay_mask,
    )


OPTIMIZER = Optimizer("lion", build, flags=(ADAM_BETA1, ADAM_BETA2))
