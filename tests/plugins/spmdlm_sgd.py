"""An optimizer from outside the package, in one file: SGD (with momentum when --sgd_momentum is given), registered
under the `spmdlm.optimizers` entry-point group by its distribution's metadata, as `pip install` of a plugin would
leave it:

    [project.entry-points."spmdlm.optimizers"]
    sgd = "spmdlm_sgd:OPTIMIZER"

tests/test_plugin_optimizer.py trains with it through the launcher and checks its update rule.
"""

from __future__ import annotations

import optax

from spmdlm.bounds import Bounds
from spmdlm.optimizers.entries import Flag, Optimizer, OptimizerInputs

MOMENTUM = Flag(
    "sgd_momentum",
    float,
    0.0,
    "SGD's momentum; 0 = plain SGD (param -= lr · grad)",
    bounds=Bounds(0, 1, below=True, hint="0 = no momentum"),
)  # resume=True (the default): momentum or none changes the optimizer's state, so a resume must keep it


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    """Decoupled weight decay scaled by the learning rate, as every optimizer here, then SGD."""
    return optax.chain(
        optax.add_decayed_weights(inputs.weight_decay, inputs.decay_mask),
        optax.sgd(inputs.schedule, momentum=inputs.flags["sgd_momentum"] or None),
    )


OPTIMIZER = Optimizer("sgd", build, flags=(MOMENTUM,))
