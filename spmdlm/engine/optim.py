"""Optimizers (AdamW, Adafactor, Lion, Muon, schedule-free AdamW), the learning-rate schedule, gradient clipping and
weight decay masked by parameter kind; all built from optax's own transforms (docs/optimizers.md).

Weight decay (--weight_decay) is decoupled and scaled by the learning rate for every optimizer. Which parameters
decay, per optimizer:
- adamw, adafactor, lion, schedule_free_adamw: all but biases and norm scales (`weight_decay_mask`: by the
  parameter's type); embeddings decay, as in the HF scripts.
- muon: only the matrices Muon updates (`muon_dimension_numbers`); the rest, updated by AdamW (embeddings, LM head,
  biases, norm scales), never decays: optax.contrib.muon's default (adam_weight_decay 0), as in modded-nanogpt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmdlm.models.layers import Bias, Dense, Scale
from spmdlm.run_args import RunArgs
from spmdlm.run_args.choices import WSD_DECAY_RATIO
from spmdlm.run_args.sections import OptimizationArgs

INVERSE_SQRT_TIMESCALE = 10_000  # inverse_sqrt without warmup (transformers' get_inverse_sqrt_schedule)
# Muon's updates scaled to AdamW's typical RMS (Liu et al. 2025, "Muon is Scalable for LLM Training"), so one
# --learning_rate serves both the Muon matrices and the AdamW rest.
MUON_CONSISTENT_RMS = 0.2
MUON_BATCH_AXES = ("layers", "qkv")  # stacked copies of a matrix: each orthogonalised on its own


def optimization_of_run(run_config: dict) -> OptimizationArgs:
    """The optimisation section of a run as its run_config.json records it (a flag it predates: that flag's default)."""
    return RunArgs.of_run(run_config).optimization.resolved()


def wsd_decay_steps(cfg: OptimizationArgs, total_steps: int) -> int:
    """The steps of WSD's final decay: --decay_steps, else --decay_ratio of all the steps (at least one)."""
    if cfg.decay_steps is not None:
        return cfg.decay_steps
    ratio = WSD_DECAY_RATIO if cfg.decay_ratio is None else cfg.decay_ratio
    return max(1, round(ratio * total_steps))


def learning_rate_schedule(cfg: OptimizationArgs, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak over --warmup_steps, then (s: the steps since the warmup ended):
    linear: from the peak to the floor (min_lr_ratio x peak) at step total_steps; cosine: the same along a half
    cosine; constant, constant_with_warmup: the peak; inverse_sqrt: peak x sqrt(T / (s + T)), T = the warmup steps
    (or 10000 without warmup), never below the floor; wsd: the peak, then linearly to the floor over the last
    `wsd_decay_steps` steps. At min_lr_ratio 0, linear, cosine and constant are bitwise those of earlier versions
    (a resumed run's rate does not change)."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    if cfg.lr_scheduler_type == "linear":
        after = optax.linear_schedule(peak, floor, decay_steps)
    elif cfg.lr_scheduler_type == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.lr_scheduler_type == "inverse_sqrt":
        # Written here: optax has no inverse-square-root schedule (transformers' get_inverse_sqrt_schedule).
        # join_schedules evaluates it before the warmup ends too, at negative s: clipped (no division by zero).
        timescale = warmup or INVERSE_SQRT_TIMESCALE
        after = lambda s: peak * jnp.maximum(cfg.min_lr_ratio, jnp.sqrt(timescale / (jnp.maximum(s, 0) + timescale)))
    elif cfg.lr_scheduler_type == "wsd":
        cooldown = min(wsd_decay_steps(cfg, total_steps), decay_steps)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, cooldown)], [decay_steps - cooldown]
        )
    else:  # constant, constant_with_warmup: both warm up when --warmup_steps is given
        after = optax.constant_schedule(peak)
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


def _plain_masked_nodes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Init `tx` on the Variable state (so its moments keep their parameter's sharding) but take the placeholders
    of the parameters a partition leaves out (optax.MaskedNode) out of their Variables: an nnx Variable must hold
    an array (nnx.eval_shape, the abstract state of a resume, reads its shape)."""
    is_variable = lambda x: isinstance(x, nnx.Variable)
    unwrap = lambda v: v.get_value() if is_variable(v) and isinstance(v.get_value(), optax.MaskedNode) else v
    return optax.GradientTransformation(
        lambda params: jax.tree.map(unwrap, tx.init(params), is_leaf=is_variable), tx.update
    )


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


def schedule_free_adamw(cfg: OptimizationArgs, schedule: optax.Schedule, mask) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw with its weight decay masked: the same chain (AdamW without momentum under
    optax.contrib.schedule_free), built here only because that function's decay takes no mask."""
    base = optax.chain(
        optax.scale_by_rms(decay=cfg.adam_beta2, eps=cfg.adam_epsilon, eps_in_sqrt=False, bias_correction=True),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(schedule),
    )
    return optax.contrib.schedule_free(base, schedule, b1=cfg.adam_beta1)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm as one scalar factor: updates x min(1, max_norm / norm) (exactly the updates below
    the threshold). Written here because optax's form selects between each update and `update / norm x max_norm`,
    a division XLA will not duplicate into the optimizer's several readers of each gradient, so it writes every
    clipped gradient out once more (a pass over all the parameters; ~10% of a T5-base step on CPU). The state is
    optax's (empty), so checkpoints are unchanged."""

    def update(updates, state, params=None):
        del params
        norm = optax.global_norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda u: u * factor.astype(u.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(cfg: OptimizationArgs, model: nnx.Module, total_steps: int) -> optax.GradientTransformation:
    """Gradient clipping (--max_grad_norm), then the optimizer cfg names; weight decay as the module docstring says.

    adamw: optax.adamw. adafactor: optax.adafactor per layer, plus lr-scaled decay (`decoupled_weight_decay`).
    lion: optax.lion, b1/b2 = --adam_beta1/--adam_beta2. muon: optax.contrib.muon on the matrices of
    `muon_dimension_numbers` (momentum 0.95, Nesterov, updates at AdamW's RMS), its own Nesterov AdamW
    (--adam_beta1/2, --adam_epsilon) on the rest. schedule_free_adamw: optax.contrib.schedule_free over AdamW
    without momentum, b1 = --adam_beta1 (the interpolation weight); evaluate with `evaluation_params`.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    mask = weight_decay_mask(model)
    if cfg.optimizer == "adafactor":
        # Factored second moments; unlike the HF scripts, weight decay is applied (decoupled, scaled by the lr).
        decay = [decoupled_weight_decay(schedule, cfg.weight_decay, mask)] if cfg.weight_decay else []
        adafactor = optax.adafactor(learning_rate=schedule)
        labels = stacked_labels(model)
        if "stacked" in jax.tree.leaves(labels):
            adafactor = optax.multi_transform({"stacked": per_layer(adafactor), "single": adafactor}, labels)
        core = _without_variable_metadata(optax.chain(adafactor, *decay))
    elif cfg.optimizer == "lion":
        core = optax.lion(schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.optimizer == "muon":
        # Muon's decay covers exactly its own matrices (all of them decay); AdamW's part keeps optax's decay of 0.
        core = _plain_masked_nodes(
            optax.contrib.muon(
                schedule,
                eps=cfg.adam_epsilon,
                weight_decay=cfg.weight_decay,
                adam_b1=cfg.adam_beta1,
                adam_b2=cfg.adam_beta2,
                muon_weight_dimension_numbers=muon_dimension_numbers(model),
                consistent_rms=MUON_CONSISTENT_RMS,
            )
        )
    elif cfg.optimizer == "schedule_free_adamw":
        core = schedule_free_adamw(cfg, schedule, mask)
    else:
        core = optax.adamw(
            schedule,
            b1=cfg.adam_beta1,
            b2=cfg.adam_beta2,
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
            mask=mask,
        )
    clip = [clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm and cfg.max_grad_norm > 0 else []
    tx = optax.chain(*clip, core)
    return skip_spikes(tx, cfg.skip_step_on_spike, cfg.spike_window) if cfg.skip_step_on_spike else tx


# -- loss spikes -------------------------------------------------------------------------------------------------------
SPIKE_HISTORY = 10  # accepted steps the window needs before it judges one (its mean and spread mean little before)


class SpikeState(NamedTuple):
    """The window of the last `window` accepted steps' losses and gradient norms (a ring), and the skip counts."""

    losses: jax.Array  # float32 [window]
    grad_norms: jax.Array  # float32 [window]
    accepted: jax.Array  # int32: steps taken so far (the ring's next slot is accepted % window)
    consecutive: jax.Array  # int32: steps skipped since the last accepted one
    skipped: jax.Array  # int32: steps skipped in all
    inner: optax.OptState


def skip_spikes(inner: optax.GradientTransformation, z: float, window: int) -> optax.GradientTransformationExtraArgs:
    """`inner`, except that a step whose loss (the `loss=` extra argument) or gradient norm lies more than `z`
    standard deviations above the mean of the window of accepted steps, or is not finite, changes nothing: zero
    updates and `inner`'s state kept (MaxText's and Levanter's spike skipping). Decided inside the jitted step.

    Written by hand: optax.apply_if_finite skips non-finite steps only, and no optax transform sees the loss.
    The state is part of the optimizer's, so it is checkpointed and a resumed run judges exactly as the first did.
    """

    def init(params):
        zeros = jnp.zeros((window,), jnp.float32)
        count = jnp.zeros((), jnp.int32)
        return SpikeState(zeros, zeros, count, count, count, inner.init(params))

    def update(updates, state: SpikeState, params=None, *, loss, **extra):
        grad_norm = optax.global_norm(updates)
        loss = jnp.asarray(loss, jnp.float32)
        filled = jnp.minimum(state.accepted, window)
        in_window = jnp.arange(window) < filled

        def above(values, value):
            mean = jnp.sum(jnp.where(in_window, values, 0.0)) / jnp.maximum(filled, 1)
            spread = jnp.sqrt(jnp.sum(jnp.where(in_window, jnp.square(values - mean), 0.0)) / jnp.maximum(filled, 1))
            return value > mean + z * spread

        spike = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm)) | (
            (filled >= SPIKE_HISTORY) & (above(state.losses, loss) | above(state.grad_norms, grad_norm))
        )
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        keep = lambda old, new: jnp.where(spike, old, new)
        slot = state.accepted % window
        return jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates), SpikeState(
            losses=keep(state.losses, state.losses.at[slot].set(loss)),
            grad_norms=keep(state.grad_norms, state.grad_norms.at[slot].set(grad_norm)),
            accepted=state.accepted + (~spike).astype(jnp.int32),
            consecutive=jnp.where(spike, state.consecutive + 1, 0),
            skipped=state.skipped + spike.astype(jnp.int32),
            inner=jax.tree.map(keep, state.inner, new_inner),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _states_of(opt_state, kind: type) -> list:
    """The `kind` states (a transform's NamedTuple) inside an optimizer state (nnx.Optimizer's, or pure arrays)."""
    is_kind = lambda x: isinstance(x, kind)
    return [s for s in jax.tree.leaves(nnx.as_pure(opt_state), is_leaf=is_kind) if is_kind(s)]


def spike_counts(opt_state) -> dict[str, jax.Array]:
    """{"skipped_steps", "consecutive_skips"} of an optimizer state made by skip_spikes; {} for others."""
    found = _states_of(opt_state, SpikeState)
    return {"skipped_steps": found[0].skipped, "consecutive_skips": found[0].consecutive} if found else {}


def evaluation_needs_optimizer(cfg: OptimizationArgs) -> bool:
    """Whether `evaluation_params` reads the optimizer's state (so a checkpoint's model alone is not the model)."""
    return cfg.optimizer == "schedule_free_adamw"


def evaluation_params(cfg: OptimizationArgs, opt_state, params):
    """The parameters to evaluate, export and sample from: for schedule_free_adamw the averaged sequence x
    (optax.contrib.schedule_free_eval_params) — the train state's parameters are the interpolation y where the
    gradients are taken; for every other optimizer `params` as they are.

    `opt_state`: the optimizer's (nnx.Optimizer.opt_state, or its pure arrays); `params`: the model's parameters
    (nnx.state(model, nnx.Param), or pure arrays). The result is for nnx.update(model, ...).
    """
    if not evaluation_needs_optimizer(cfg):
        return params
    state = _states_of(opt_state, optax.contrib.ScheduleFreeState)[0]
    return optax.contrib.schedule_free_eval_params(state, nnx.as_pure(params))
