"""--optim muon: optax.contrib.muon (Newton–Schulz orthogonalised Nesterov momentum) on the hidden matrices, its own
Nesterov AdamW (--adam_beta1/2, --adam_epsilon) on the rest (docs/optimizers.md, "Muon's split").

Muon's decay covers exactly its own matrices (all of them decay); the AdamW part (embeddings, LM head, biases, norm
scales) never decays: optax.contrib.muon's default (adam_weight_decay 0), as in modded-nanogpt.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from spmdlm.models.layers import Dense
from spmdlm.optimizers.entries import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, Optimizer, OptimizerInputs

# Muon's updates scaled to AdamW's typical RMS (Liu et al. 2025, "Muon is Scalable for LLM Training"), so one
# --learning_rate serves both the Muon matrices and the AdamW rest.
MUON_CONSISTENT_RMS = 0.2
MUON_BATCH_AXES = ("layers", "qkv")  # stacked copies of a matrix: each orthogonalised on its own


def muon_dimension_numbers(model: nnx.Module):
    """Per parameter, how Muon sees it as matrices (optax.contrib.MuonDimensionNumbers), or None for AdamW.

    Muon updates the kernels of Dense layers (the hidden matrices: attention and MLP projections), except those with
    a vocabulary axis (the LM head). A kernel's `layers` axis (scanned layers) and `qkv` axis (GPT-2's fused
    query/key/value) are batch axes: each layer's query, key and value matrix is orthogonalised on its own. The
    first other axis is the reduction (input) axis, the remaining ones the output. Everything else — embedding
    tables (token, position, T5's relative-attention bias), the LM head, biases, norm scales — goes to AdamW.
    """
    kernels = {path + ("kernel",) for path, node in nnx.iter_graph(model) if isinstance(node, Dense)}

    def dimension_numbers(path, variable):
        if path not in kernels:
            return None
        axes = variable.get_metadata()["logical_axes"]
        if "vocab" in axes:
            return None
        matrix = [i for i, axis in enumerate(axes) if axis not in MUON_BATCH_AXES]
        return optax.contrib.MuonDimensionNumbers(reduction_axis=matrix[0], output_axis=tuple(matrix[1:]))

    return nnx.map_state(dimension_numbers, nnx.state(model, nnx.Param))


def _plain_masked_nodes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Init `tx` on the Variable state (so its moments keep their parameter's sharding) but take the placeholders
    of the parameters a partition leaves out (optax.MaskedNode) out of their Variables: an nnx Variable must hold
    an array (nnx.eval_shape, the abstract state of a resume, reads its shape)."""
    is_variable = lambda x: isinstance(x, nnx.Variable)
    unwrap = lambda v: v.get_value() if is_variable(v) and isinstance(v.get_value(), optax.MaskedNode) else v
    return optax.GradientTransformation(
        lambda params: jax.tree.map(unwrap, tx.init(params), is_leaf=is_variable), tx.update
    )


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    """Momentum 0.95, Nesterov, 5 Newton–Schulz steps (optax's defaults), updates at AdamW's RMS."""
    return _plain_masked_nodes(
        optax.contrib.muon(
            inputs.schedule,
            eps=inputs.flags["adam_epsilon"],
            weight_decay=inputs.weight_decay,
            adam_b1=inputs.flags["adam_beta1"],
            adam_b2=inputs.flags["adam_beta2"],
            muon_weight_dimension_numbers=muon_dimension_numbers(inputs.model),
            consistent_rms=MUON_CONSISTENT_RMS,
        )
    )


OPTIMIZER = Optimizer("muon", build, flags=(ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON))
