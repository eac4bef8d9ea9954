"""The sharded train state and the one jitted train step (and eval step) shared by all four objectives.

Loss and metrics are token-weighted *sums* plus a token count, so means are exact across devices, gradient
accumulation micro-steps and padded eval batches: the gradient of the accumulated loss sum is divided by the number
of target tokens in the whole global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdlm.checkpoint import abstract_of
from spmdlm.data.objectives import IGNORE_INDEX
from spmdlm.devices import compiled_stats
from spmdlm.engine import faults, monitors
from spmdlm.engine.optim import ema_params, evaluation_params, spike_counts
from spmdlm.families.base import Batch, Forward
from spmdlm.mesh import batch_sharding, constrain
from spmdlm.run_args.sections import OptimizationArgs


def cross_entropy_sums(
    logits: jax.Array,
    labels: jax.Array,
    z_loss: float = 0.0,
    unscored: tuple[int, ...] = (),
    byte_lengths: jax.Array | None = None,
    monitor: bool = False,
) -> dict[str, jax.Array]:
    """Summed fp32 cross-entropy, optional T5X z-loss (coef · logsumexp²), token count and correct predictions.

    With `unscored` label ids (BART's special tokens), the same sums over the other labels too (`scored_*`): the
    figures a run reports, as the HF script does, while it trains on every label. With `byte_lengths` (int32 [V],
    data.tokenization.token_byte_lengths), the UTF-8 bytes the counted labels stand for (`bytes`): bits per byte's
    denominator. `monitor` (the stability monitors: engine/monitors.py): also the largest logit of the counted
    positions (`logits_max`, merged by `merge_sums` as a max) and the sum of their logsumexp² (`lse_square_sum`)."""
    logits = logits.astype(jnp.float32)
    valid = labels != IGNORE_INDEX
    safe_labels = jnp.where(valid, labels, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, safe_labels[..., None], axis=-1)[..., 0]
    # Reuses the row max logsumexp already took instead of a separate argmax pass (~5% of a CPU step);
    # an exact tie for the top logit counts as correct.
    row_max = jnp.max(logits, axis=-1)
    hit = target >= row_max

    def sums(counted, prefix=""):
        weights = counted.astype(jnp.float32)
        out = {
            f"{prefix}loss_sum": jnp.sum((lse - target) * weights),
            f"{prefix}tokens": jnp.sum(weights),
            f"{prefix}correct": jnp.sum(hit & counted).astype(jnp.float32),
        }
        if byte_lengths is not None:  # int32: exact where a float32 sum of a long evaluation would round
            out[f"{prefix}bytes"] = jnp.sum(jnp.where(counted, byte_lengths[safe_labels], 0), dtype=jnp.int32)
        return out

    out = {**sums(valid), "z_loss_sum": z_loss * jnp.sum(jnp.square(lse) * valid)}
    if monitor:
        out["logits_max"] = jnp.max(jnp.where(valid, row_max, -jnp.inf))
        out["lse_square_sum"] = jnp.sum(jnp.square(lse) * valid)
    if unscored:
        out.update(sums(valid & ~jnp.isin(labels, jnp.asarray(unscored, labels.dtype)), "scored_"))
    return out


def merge_sums(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two batches' (or chunks') sums as one batch's: added, but a `*_max` is the larger."""
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def empty_sums(shapes: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """What `merge_sums` starts from: zeros, and -inf for a `*_max`."""
    return {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0, v.dtype) for k, v in shapes.items()}


def chunked_cross_entropy_sums(
    head: Callable[[jax.Array], jax.Array],
    features: jax.Array,
    labels: jax.Array,
    chunk: int,
    z_loss: float = 0.0,
    unscored: tuple[int, ...] = (),
    byte_lengths: jax.Array | None = None,
    monitor: bool = False,
) -> dict[str, jax.Array]:
    """`cross_entropy_sums(head(features), labels)` computed `chunk` positions at a time, so only one chunk's
    logits [B, chunk, V] exist at once, forward and backward (each chunk's logits are recomputed for its gradient
    under jax.checkpoint). A length that `chunk` does not divide is padded with ignored positions."""
    batch, length = labels.shape
    pad = -length % chunk
    if pad:
        features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)), constant_values=IGNORE_INDEX)
    count = (length + pad) // chunk
    # [B, count * chunk, ...] -> [count, B, chunk, ...]: the scan runs over chunks, the batch axis keeps its sharding.
    features = jnp.moveaxis(features.reshape(batch, count, chunk, features.shape[-1]), 1, 0)
    labels = jnp.moveaxis(labels.reshape(batch, count, chunk), 1, 0)

    @jax.checkpoint
    def chunk_sums(x, y):
        return cross_entropy_sums(head(x), y, z_loss, unscored, byte_lengths, monitor)

    def body(total, xy):
        return merge_sums(total, chunk_sums(*xy)), None

    zeros = empty_sums(jax.eval_shape(chunk_sums, features[0], labels[0]))
    return jax.lax.scan(body, zeros, (features, labels))[0]


def head_sums(
    head: Callable[[jax.Array], jax.Array],
    features: jax.Array,
    labels: jax.Array,
    *,
    z_loss: float = 0.0,
    loss_chunk: int = 0,
    unscored: tuple[int, ...] = (),
    byte_lengths: jax.Array | None = None,
    monitor: bool = False,
) -> dict[str, jax.Array]:
    """Loss sums of the LM head over `features` [B, T, d], all positions at once or `loss_chunk` at a time."""
    if 0 < loss_chunk < labels.shape[1]:
        return chunked_cross_entropy_sums(head, features, labels, loss_chunk, z_loss, unscored, byte_lengths, monitor)
    return cross_entropy_sums(head(features), labels, z_loss, unscored, byte_lengths, monitor)


def labelled_positions_sums(head, features: jax.Array, labels: jax.Array, capacity: int, **loss) -> dict:
    """`head_sums` computed on each row's labelled positions only (the first `capacity`, in order; the rest of the
    gathered positions are unlabelled and add nothing), as BERT's pretraining code does: for MLM (15% labelled)
    the vocabulary projection shrinks ~3x. A batch with a row of more than `capacity` labels takes the exact
    all-positions path, so the result always equals `head_sums(head, features, labels)`."""
    valid = labels != IGNORE_INDEX
    positions = jnp.argsort(~valid, axis=-1, stable=True)[:, :capacity]  # labelled positions first, in order
    positions = constrain(positions, "batch", None)

    def gathered():
        # Rows stay where they are (a per-row gather): without the constraint XLA replicates the features first.
        picked = constrain(jnp.take_along_axis(features, positions[..., None], axis=1), "batch", None, "act_embed")
        return head_sums(head, picked, jnp.take_along_axis(labels, positions, axis=1), **loss)

    return jax.lax.cond(valid.sum(-1).max() <= capacity, gathered, lambda: head_sums(head, features, labels, **loss))


@dataclasses.dataclass(frozen=True)
class Loss:
    """How a step sums the loss. `loss_chunk` > 0 (--loss_chunk_size) computes it a chunk of positions at a time
    (`chunked_cross_entropy_sums`); `label_capacity` (the objective's) runs the LM head on labelled positions only
    (`labelled_positions_sums`): both give the same sums as the plain loss. `unscored`: the objective's label ids
    left out of the reported figures (`cross_entropy_sums`); `z_loss`: --z_loss; `monitor`: the sums the stability
    monitors read too (the monitor steps' variant: Stepper)."""

    z_loss: float = 0.0
    loss_chunk: int = 0
    label_capacity: int | None = None
    unscored: tuple[int, ...] = ()
    monitor: bool = False


def loss_sums(
    model: nnx.Module,
    batch: Batch,
    forward: Forward,
    rngs: nnx.Rngs | None = None,
    *,
    loss: Loss = Loss(),
    byte_lengths: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The token-summed loss and metrics of one batch, the model called by its family's `forward`, summed as `loss`
    says; `byte_lengths`: each id's UTF-8 bytes, for bits per byte (`cross_entropy_sums`)."""
    labels, capacity, chunk = batch["labels"], loss.label_capacity, loss.loss_chunk
    gather = bool(capacity) and capacity < labels.shape[1]
    if not gather and not 0 < chunk < labels.shape[1]:
        logits = forward(model, batch, rngs)
        return cross_entropy_sums(logits, labels, loss.z_loss, loss.unscored, byte_lengths, loss.monitor)
    features = forward(model, batch, rngs, features_only=True)
    head = dict(
        z_loss=loss.z_loss, loss_chunk=chunk, unscored=loss.unscored, byte_lengths=byte_lengths, monitor=loss.monitor
    )
    if gather:
        return labelled_positions_sums(model.head, features, labels, capacity, **head)
    return head_sums(model.head, features, labels, **head)


# Each model input and the fields that mark its padding (the first the batch has; none: every token is real).
INPUT_PADDING = (
    ("input_ids", ("attention_mask", "segment_ids")),
    ("decoder_input_ids", ("decoder_attention_mask", "decoder_segment_ids")),
)


def real_tokens(batch: Batch) -> jax.Array:
    """The non-padding tokens of a batch's model inputs (encoder and decoder): what packing raises per step."""
    total = jnp.zeros((), jnp.float32)
    for field, markers in INPUT_PADDING:
        if field in batch:
            marker = next((batch[m] for m in markers if m in batch), None)
            total += batch[field].size if marker is None else jnp.sum(marker > 0, dtype=jnp.float32)
    return total


def model_for_evaluation(graphdef, state, optim: OptimizationArgs | None = None):
    """(model, optimizer) of the train state, the model holding the parameters to evaluate, sample from and export:
    schedule-free AdamW's averaged sequence (optim.evaluation_params); for other optimizers the trained ones. The
    state of a model alone (spmdlm.evaluate) gives (model, None)."""
    merged = nnx.merge(graphdef, state, copy=True)  # its own Variables: the averaged parameters must not land in
    # `state`, the train state sampling, task evaluation and hub pushes hand in mid-run (training goes on from it)
    if isinstance(merged, nnx.Module):
        return merged, None
    model, optimizer = merged
    if optim is not None:
        nnx.update(model, evaluation_params(optim, optimizer.opt_state, nnx.state(model, nnx.Param)))
    return model, optimizer


def with_average(graphdef, state):
    """The train state with its model's parameters replaced by their average (--ema_decay: optim.keep_average), for
    the same eval step, export or samples as the parameters themselves; None when the run keeps no average. The
    optimizer state is shared, not copied: the result costs no memory beyond the average it already holds."""
    model, optimizer = nnx.merge(graphdef, state, copy=True)
    average = ema_params(optimizer.opt_state)
    if average is None:
        return None
    nnx.update(model, average)
    return nnx.state((model, optimizer))


def state_shardings(state) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)


@dataclasses.dataclass(frozen=True)
class Training:
    """What the train step adds to the eval step: the optimisation section (evaluation reads its evaluation
    parameters too: model_for_evaluation), the learning-rate schedule it logs, the accumulation micro-steps, the
    dropout seed and --monitor_every (the steps that run the monitor variant: Stepper.train_step)."""

    optim: OptimizationArgs | None = None
    schedule: optax.Schedule | None = None
    grad_accum: int = 1
    dropout_seed: int = 0
    monitor_every: int = 0


class Stepper:
    """Compiles and runs the train and eval steps over the flat (model, optimizer) state, which it donates.

    With --monitor_every N a second variant of the train step, compiled beside it, runs every Nth step: the same
    step that also returns the stability monitors (engine/monitors.py) among its metrics. The other steps run the
    plain program, unchanged: no monitor is computed or fetched there (benchmarks/bench_monitors.py)."""

    def __init__(
        self,
        graphdef,
        state,
        mesh: Mesh,
        forward: Forward,
        *,
        loss: Loss = Loss(),
        training: Training = Training(),
        byte_lengths: np.ndarray | None = None,
    ):
        """`state`: the train state, or the state of a model alone to evaluate (no train step then). `byte_lengths`:
        each vocabulary id's UTF-8 bytes, which evaluation sums for bits per byte."""
        self.graphdef, self.mesh, self.forward = graphdef, mesh, forward
        self.optim = training.optim  # evaluation reads its evaluation parameters (model_for_evaluation)
        self.grad_accum, self.schedule = training.grad_accum, training.schedule
        self.monitor_every = training.monitor_every
        self.loss = loss
        self.byte_lengths = None if byte_lengths is None else np.asarray(byte_lengths, np.int32)
        self.dropout_key = jax.random.key(training.dropout_seed)
        self.shardings = state_shardings(state)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.compiled_train = self.compiled_monitor = self._eval = None
        self.compile_stats: dict[str, Any] = {}
        # (global batch, accumulation) -> its (train, monitor) programs and their stats: a batch-size ramp's stages
        self._programs: dict[tuple[int, int], tuple[Any, Any, dict[str, Any]]] = {}

    # -- the step functions (pure; traced once) ------------------------------------------------------------------
    def train_fn(self, state, batch: Batch, step: jax.Array, monitor: bool = False, grad_accum: int | None = None):
        """One optimizer step: (state, global batch, step number) -> (new state, metric sums); `monitor`: with the
        stability monitors (`monitor/...`) among the metrics; `grad_accum`: its micro-steps (default: Training's)."""
        model, optimizer = nnx.merge(self.graphdef, state)
        loss = dataclasses.replace(self.loss, monitor=True) if monitor else self.loss
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        step_key = jax.random.fold_in(self.dropout_key, step)
        # The loss is divided by the global batch's target tokens before differentiating, not the gradients after:
        # the same gradients, without one more pass over every parameter-sized gradient (a divide XLA does not
        # fuse into the optimizer's several consumers of each gradient).
        per_token = 1.0 / jnp.maximum(jnp.sum(batch["labels"] != IGNORE_INDEX, dtype=jnp.float32), 1.0)

        def micro_grads(p, micro: Batch, index):
            def loss_of(p):
                m = nnx.merge(graph, p, rest)
                rngs = nnx.Rngs(dropout=jax.random.fold_in(step_key, index))
                sums_of = lambda: loss_sums(m, micro, self.forward, rngs, loss=loss)
                sums = monitors.with_probes(m, sums_of) if monitor else sums_of()
                return (sums["loss_sum"] + sums["z_loss_sum"]) * per_token, sums

            return jax.grad(loss_of, has_aux=True)(p)

        k = grad_accum or self.grad_accum
        if k == 1:
            grads, sums = micro_grads(params, batch, 0)
        else:
            # Row r of device-local data goes to micro-step r % k, so every micro-batch stays evenly sharded.
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)

            def body(carry, inputs):
                acc, p = carry
                # The barrier keeps XLA from hoisting fsdp's weight all-gathers out of the loop, which would hold
                # a whole unsharded copy of the parameters for the entire step.
                p = jax.lax.optimization_barrier(p)
                grads, sums = micro_grads(p, *inputs)
                return ((jax.tree.map(jnp.add, acc[0], grads), merge_sums(acc[1], sums)), p), None

            shapes = jax.eval_shape(lambda: micro_grads(params, jax.tree.map(lambda x: x[0], micro), 0))
            zeros = (jax.tree.map(jnp.zeros_like, shapes[0]), empty_sums(shapes[1]))
            ((grads, sums), _), _ = jax.lax.scan(body, (zeros, params), (micro, jnp.arange(k)))
        metrics = dict(sums, grad_norm=optax.global_norm(grads), real_tokens=real_tokens(batch))
        if self.schedule is not None:
            metrics["learning_rate"] = self.schedule(step)
        before = monitors.named_leaves(params) if monitor else None  # (captured: the update replaces them)
        if self.optim is not None and self.optim.skip_step_on_spike:  # optim.skip_spikes judges this loss
            optimizer.update(model, grads, loss=sums["loss_sum"] / jnp.maximum(sums["tokens"], 1.0))
            metrics.update(spike_counts(optimizer.opt_state))
        else:
            optimizer.update(model, grads)
        if monitor:
            metrics = monitors.with_monitors(metrics, grads, before, nnx.state(model, nnx.Param), k)
        return nnx.state((model, optimizer)), metrics

    def eval_fn(self, state, batch: Batch):
        """The loss sums of a batch under the current (evaluation) parameters, with the bytes its labels stand for."""
        model, _ = model_for_evaluation(self.graphdef, state, self.optim)
        byte_lengths = None if self.byte_lengths is None else jnp.asarray(self.byte_lengths)
        return loss_sums(model, batch, self.forward, loss=self.loss, byte_lengths=byte_lengths)

    def accumulate_eval_fn(self, state, batch: Batch, totals: dict[str, jax.Array]):
        """`totals` plus eval_fn's sums of `batch`, in the one program: no eager add of sharded arrays between two
        steps, one program a batch (evaluation.eval_step_in_turn says why evaluation keeps programs few and in turn)."""
        return jax.tree.map(jnp.add, totals, self.eval_fn(state, batch))

    def eval_zeros(self, state, batch: Batch) -> dict[str, jax.Array]:
        """Zero sums in the eval step's shapes, replicated: copied from the host, no program run on the devices."""
        with jax.set_mesh(self.mesh):
            shapes = jax.eval_shape(self.eval_fn, state, batch)
        return jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), self.replicated)

    # -- compilation ---------------------------------------------------------------------------------------------
    def batch_shardings(self, batch_spec: dict[str, jax.ShapeDtypeStruct]):
        return {k: batch_sharding(self.mesh, len(v.shape)) for k, v in batch_spec.items()}

    def lower_train(
        self,
        state,
        batch_spec: dict[str, jax.ShapeDtypeStruct],
        *,
        donate: bool = True,
        compiler_options: dict[str, Any] | None = None,
        monitor: bool = False,
        grad_accum: int | None = None,
    ):
        """The train step lowered for `state`'s shapes and shardings (arrays or ShapeDtypeStructs) and a batch of
        `batch_spec`; `.compile()` it. `compiler_options`: XLA's, e.g. for benchmarks; `monitor`: the variant with
        the stability monitors; `grad_accum`: its micro-steps (default: Training's)."""
        fn = jax.jit(
            functools.partial(self.train_fn, monitor=monitor, grad_accum=grad_accum),
            in_shardings=(self.shardings, self.batch_shardings(batch_spec), self.replicated),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=0 if donate else (),
            compiler_options=compiler_options,
        )
        with jax.set_mesh(self.mesh):
            return fn.lower(abstract_of(state), batch_spec, jax.ShapeDtypeStruct((), jnp.int32))

    def jit_eval(self, batch_spec: dict[str, jax.ShapeDtypeStruct]):
        return jax.jit(
            self.accumulate_eval_fn,
            in_shardings=(self.shardings, self.batch_shardings(batch_spec), self.replicated),
            out_shardings=self.replicated,
        )

    def lower_eval(self, state, batch_spec: dict[str, jax.ShapeDtypeStruct]):
        state = abstract_of(state)
        with jax.set_mesh(self.mesh):
            totals = jax.eval_shape(self.eval_fn, state, batch_spec)
            return self.jit_eval(batch_spec).lower(state, batch_spec, totals)

    def compile_train(
        self, state, batch_spec: dict[str, jax.ShapeDtypeStruct], grad_accum: int | None = None
    ) -> dict[str, Any]:
        """AOT-compile the train step for batches of `batch_spec` in `grad_accum` micro-steps (default: Training's),
        and its monitor variant with --monitor_every: what `train_step` runs from now on. Each (global batch,
        accumulation) is compiled once and kept (a batch-size ramp returns to none, but switches between them);
        -> compile time, memory (the larger of the two programs') and XLA's cost (the plain step's)."""
        k = grad_accum or self.grad_accum
        key = (next(iter(batch_spec.values())).shape[0], k)
        if key not in self._programs:
            start = time.perf_counter()
            train = self.lower_train(state, batch_spec, grad_accum=k).compile()
            stats, monitor = compiled_stats(train), None
            if self.monitor_every:
                monitor = self.lower_train(state, batch_spec, monitor=True, grad_accum=k).compile()
                for name, value in compiled_stats(monitor).items():
                    if name.endswith("_bytes"):
                        stats[name] = max(stats.get(name, 0), value)
            self._programs[key] = (train, monitor, {"compile_seconds": time.perf_counter() - start, **stats})
        self.compiled_train, self.compiled_monitor, self.compile_stats = self._programs[key]
        return self.compile_stats

    def monitors_at(self, step: int) -> bool:
        """Whether the step from `step` (0-based; logged as step + 1) runs the monitor variant."""
        return bool(self.monitor_every) and (step + 1) % self.monitor_every == 0

    def train_step(self, state, batch: Batch, step: int):
        faults.maybe_stuck("train")
        compiled = self.compiled_monitor if self.monitors_at(step) else self.compiled_train
        with jax.set_mesh(self.mesh):
            return compiled(state, batch, np.int32(step))

    def eval_step(self, state, batch: Batch, totals: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`totals` (eval_zeros at the first batch) plus the sums of `batch`."""
        if self._eval is None:  # compiled at the first batch: evaluation may never run
            self._eval = self.jit_eval(batch)
        faults.maybe_stuck("eval")
        with jax.set_mesh(self.mesh):
            return self._eval(state, batch, totals)
