"""Optimizer: AdamW or Adafactor, learning-rate schedule, gradient clipping, weight decay masked by parameter kind."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmdlm.models.layers import Bias, Scale


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    adafactor: bool = False
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "linear"  # linear | cosine | constant

    def __post_init__(self):
        if self.lr_scheduler_type not in ("linear", "cosine", "constant"):
            raise ValueError(
                f"--lr_scheduler_type {self.lr_scheduler_type!r} is not supported; use linear, cosine or constant"
            )


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then linear decay to 0, cosine decay to 0, or constant."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    if cfg.lr_scheduler_type == "linear":
        after = optax.linear_schedule(cfg.learning_rate, 0.0, decay_steps)
    elif cfg.lr_scheduler_type == "cosine":
        after = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps)
    else:
        after = optax.constant_schedule(cfg.learning_rate)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, warmup), after], [warmup])


def weight_decay_mask(model: nnx.Module):
    """True for parameters that decay: not biases or norm scales (decided by the parameter's type, not its name).

    A tree of bools that is a prefix of both the Variable state optax sees at init and the arrays it sees later.
    """
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: not isinstance(v, (Bias, Scale)), params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def stacked_labels(model: nnx.Module):
    """'stacked' for parameters of scanned layers (leading `layers` axis), 'single' for the others."""
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda v: "stacked" if v.get_metadata().get("logical_axes", ("",))[0] == "layers"
                        else "single", params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to each layer's slice of a stacked parameter separately (vmapped over the layers axis).

    For optimizers that look at a whole tensor: Adafactor factors its second moments over a matrix's rows and
    columns, and scales and clips updates by the tensor's RMS; stacked, these must stay per layer.
    """
    return optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))


def _without_variable_metadata(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Init `tx` on plain arrays: nnx.Optimizer copies a parameter's sharding metadata onto every state leaf made
    from it, which breaks Adafactor's factored moments (a row vector cannot take a matrix's PartitionSpec)."""
    unwrap = lambda tree: jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                                       is_leaf=lambda x: isinstance(x, nnx.Variable))
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


def make_optimizer(cfg: OptimConfig, model: nnx.Module, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    mask = weight_decay_mask(model)
    if cfg.adafactor:
        # Factored second moments; unlike the HF scripts, weight decay is applied (decoupled, scaled by the lr).
        decay = [decoupled_weight_decay(schedule, cfg.weight_decay, mask)] if cfg.weight_decay else []
        adafactor = optax.adafactor(learning_rate=schedule)
        labels = stacked_labels(model)
        if "stacked" in jax.tree.leaves(labels):
            adafactor = optax.multi_transform({"stacked": per_layer(adafactor), "single": adafactor}, labels)
        core = _without_variable_metadata(optax.chain(adafactor, *decay))
    else:
        core = optax.adamw(
            schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay,
            mask=mask,
        )
    clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm and cfg.max_grad_norm > 0 else []
    return optax.chain(*clip, core)
