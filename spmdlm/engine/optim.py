"""The optimizer of a run: the registered optimizer (--optim) at the learning-rate schedule (--lr_scheduler_type)
after its warmup, with gradient clipping and loss-spike skipping around it (docs/optimizers.md). The optimizers and
schedules themselves, each with its flags and its build, are the entries of spmdlm/optimizers.

Weight decay (--weight_decay) is decoupled and scaled by the learning rate for every optimizer; which parameters
decay is each optimizer's (docs/optimizers.md, "Which parameters decay").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmdlm.data.batch_ramp import BatchRamp, RampedSteps
from spmdlm.optimizers import lr_schedules, optimizers
from spmdlm.optimizers.entries import OptimizerInputs, ScheduleInputs, states_of
from spmdlm.optimizers.muon import MUON_CONSISTENT_RMS, muon_dimension_numbers  # noqa: F401 (the tests' names)
from spmdlm.run_args import RunArgs
from spmdlm.run_args.sections import OptimizationArgs


def optimization_of_run(run_config: dict) -> OptimizationArgs:
    """The optimisation section of a run as its run_config.json records it (a flag it predates: that flag's default)."""
    return RunArgs.of_run(run_config).optimization.resolved()


def learning_rate_schedule(cfg: OptimizationArgs, total_steps: int | RampedSteps) -> optax.Schedule:
    """Linear warmup from 0 to the peak over --warmup_steps, then the schedule --lr_scheduler_type names (its `after`,
    spmdlm/optimizers/schedules/) from the end of the warmup on. A run whose batch ramps (`RampedSteps`) runs it in
    final-batch steps: step s is at examples_before(s) / the final batch, the warmup and the decay counted so too.
    A run whose length a resume changed continues from the rate it had reached (`continued`), unless restarted."""
    if isinstance(total_steps, RampedSteps):
        lengths = total_steps.lengths()
        schedule = of_length(cfg, lengths[0], total_steps.ramp)
        for extension, length in zip(total_steps.extensions, lengths[1:]):
            if extension.steps_before == length:  # resumed without a change of length
                continue
            new = of_length(cfg, length, total_steps.ramp)
            schedule = new if extension.restart else continued(schedule, new, extension.at_step, cfg)
        return schedule
    warmup = min(cfg.warmup_steps, total_steps)
    schedule = lr_schedules()[cfg.lr_scheduler_type]
    after = schedule.after(
        ScheduleInputs(cfg.learning_rate, cfg.min_lr_ratio, warmup, total_steps, cfg.flags_of(schedule))
    )
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, warmup), after], [warmup])


def of_length(cfg: OptimizationArgs, total_steps: int, ramp: BatchRamp) -> optax.Schedule:
    """The schedule of a run of `total_steps` optimizer steps of `ramp`'s batches (in final-batch steps if it ramps)."""
    if not ramp.ramps:
        return learning_rate_schedule(cfg, total_steps)
    in_final_batches = learning_rate_schedule(cfg, ramp.schedule_steps(total_steps))
    return lambda count: in_final_batches(ramp.final_batch_steps(count))


def continued(before: optax.Schedule, after: optax.Schedule, at_step: int, cfg: OptimizationArgs) -> optax.Schedule:
    """A run resumed at step `at_step` with another length (--lr_scheduler_on_extension continue, the default): the
    steps before it keep the rates they had (`before`); from it on, the schedule of the new length (`after`), scaled
    about the floor so that it starts from the rate the run had reached and still ends at the floor:

        rate(s) = floor + (after(s) - floor) x (before(at_step - 1) - floor) / (after(at_step - 1) - floor)

    So the rate never jumps: a finished linear or cosine run decays from its last rate to the floor over the added
    steps; WSD in its stable phase keeps the peak and decays at the new end (as `after` alone), and once decaying
    stays at the rate reached until the new decay; constant and inverse_sqrt, which the length does not change, are
    `after` itself."""
    floor = cfg.learning_rate * cfg.min_lr_ratio
    with jax.ensure_compile_time_eval():  # concrete numbers, also when built inside a traced function
        reached, then = float(before(at_step - 1)) - floor, float(after(at_step - 1)) - floor
    scale = reached / then if then > 0 else 1.0
    if scale == 1.0:
        return after
    return lambda count: jnp.where(count < at_step, before(count), floor + (after(count) - floor) * scale)


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


def make_optimizer(
    cfg: OptimizationArgs, model: nnx.Module, total_steps: int | RampedSteps
) -> optax.GradientTransformation:
    """Gradient clipping (--max_grad_norm), then the optimizer cfg names (its `build`, spmdlm/optimizers/), the
    parameters' average (--ema_decay) after them, then --skip_step_on_spike around all (a skipped step leaves the
    average as it was)."""
    optimizer = optimizers()[cfg.optimizer]
    inputs = OptimizerInputs(model, learning_rate_schedule(cfg, total_steps), cfg.weight_decay, cfg.flags_of(optimizer))
    clip = [clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm and cfg.max_grad_norm > 0 else []
    tx = optax.chain(*clip, optimizer.build(inputs))
    if cfg.ema_decay is not None:
        tx = keep_average(tx, cfg.ema_decay, cfg.ema_start)
    return skip_spikes(tx, cfg.skip_step_on_spike, cfg.spike_window) if cfg.skip_step_on_spike else tx


# -- the parameters' exponential moving average ------------------------------------------------------------------------
class EmaState(NamedTuple):
    """The average of the parameters (float32, in their tree, so sharded as they are) and the updates it has seen."""

    count: jax.Array  # int32: updates applied so far
    average: optax.Params
    inner: optax.OptState


def keep_average(inner: optax.GradientTransformation, decay: float, start: int) -> optax.GradientTransformation:
    """`inner`, keeping an exponential moving average of the parameters it produces: after update n (1, 2, ...) the
    average is the new parameters while n <= `start`, else decay x average + (1 - decay) x new parameters (from the
    initial parameters, without bias correction). In the optimizer state: checkpointed, sharded like the
    parameters (a tree of their shapes) and resumed exactly, at no cost to code outside the optimizer."""

    def init(params):
        average = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
        return EmaState(jnp.zeros((), jnp.int32), average, inner.init(params))

    def update(updates, state: EmaState, params=None, **extra):
        if params is None:
            raise ValueError("keep_average needs the parameters (optax's update(..., params))")
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra)
        count = state.count + 1

        def averaged(average, p, u):  # the parameters exactly as optax.apply_updates makes them, in float32
            new = (p + u).astype(jnp.float32)
            return jnp.where(count > start, decay * average + (1.0 - decay) * new, new)

        average = jax.tree.map(averaged, state.average, params, new_updates)
        return new_updates, EmaState(count, average, new_inner)

    return optax.GradientTransformationExtraArgs(init, update)


def ema_params(opt_state):
    """The parameters' average (pure arrays in the parameters' tree) of an optimizer state made with --ema_decay;
    None for others."""
    found = states_of(opt_state, EmaState)
    return found[0].average if found else None


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


def spike_counts(opt_state) -> dict[str, jax.Array]:
    """{"skipped_steps", "consecutive_skips"} of an optimizer state made by skip_spikes; {} for others."""
    found = states_of(opt_state, SpikeState)
    return {"skipped_steps": found[0].skipped, "consecutive_skips": found[0].consecutive} if found else {}


def evaluation_needs_optimizer(cfg: OptimizationArgs) -> bool:
    """Whether `evaluation_params` reads the optimizer's state (so a checkpoint's model alone is not the model)."""
    return optimizers()[cfg.optimizer].evaluation_params is not None


def evaluation_params(cfg: OptimizationArgs, opt_state, params):
    """The parameters to evaluate, export and sample from: the optimizer's `evaluation_params` (schedule_free_adamw:
    the averaged sequence x, optax.contrib.schedule_free_eval_params — the train state's parameters are the
    interpolation y where the gradients are taken); for every other optimizer `params` as they are.

    `opt_state`: the optimizer's (nnx.Optimizer.opt_state, or its pure arrays); `params`: the model's parameters
    (nnx.state(model, nnx.Param), or pure arrays). The result is for nnx.update(model, ...).
    """
    if not evaluation_needs_optimizer(cfg):
        return params
    return optimizers()[cfg.optimizer].evaluation_params(opt_state, nnx.as_pure(params))
