"""--optim adafactor (also --adafactor, the HF scripts' flag): optax.adafactor per layer, plus weight decay scaled by
the learning rate. It takes optax's defaults; the --adam_* flags do not apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmdlm.optimizers.entries import Optimizer, OptimizerInputs


def stacked_labels(model: nnx.Module):
    """'stacked' for parameters of scanned layers (leading `layers` axis), 'single' for the others."""
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: "stacked" if v.get_metadata().get("logical_axes", ("",))[0] == "layers" else "single",
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to each layer's slice of a stacked parameter separately (vmapped over the layers axis).

    For optimizers that look at a whole tensor: Adafactor factors its second moments over a matrix's rows and
    columns, and scales and clips updates by the tensor's RMS; stacked, these must stay per layer.
    """
    return optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))


def _without_variable_metadata(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Init `tx` on plain arrays: nnx.Optimizer copies a parameter's sharding metadata onto every state leaf made
    from it, which breaks Adafactor's factored moments (a row vector cannot take a matrix's PartitionSpec)."""
    unwrap = lambda tree: jax.tree.map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return optax.GradientTransformation(lambda params: tx.init(unwrap(params)), tx.update)


def decoupled_weight_decay(schedule: optax.Schedule, rate: float, mask) -> optax.GradientTransformation:
    """updates -= lr(step) · rate · param, after the optimizer's own (already lr-scaled) update.

    Written by hand because optax.adafactor's own `weight_decay_rate` is not scaled by the learning rate (T5X's
    convention): the recipe's --weight_decay 0.001 would then shrink every weight by 0.1% per step. This matches
    AdamW's and transformers' Adafactor semantics instead.
    """

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        lr = schedule(state.count)
        updates = jax.tree.map(lambda u, p: u - lr * rate * p, updates, params)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.masked(optax.GradientTransformation(init, update), mask)


def build(inputs: OptimizerInputs) -> optax.GradientTransformation:
    """Factored second moments; unlike the HF scripts, weight decay is applied (decoupled, scaled by the lr)."""
    decay = (
        [decoupled_weight_decay(inputs.schedule, inputs.weight_decay, inputs.decay_mask)] if inputs.weight_decay else []
    )
    adafactor = optax.adafactor(learning_rate=inputs.schedule)
    labels = stacked_labels(inputs.model)
    if "stacked" in jax.tree.leaves(labels):
        adafactor = optax.multi_transform({"stacked": per_layer(adafactor), "single": adafactor}, labels)
    return _without_variable_metadata(optax.chain(adafactor, *decay))


OPTIMIZER = Optimizer("adafactor", build)
