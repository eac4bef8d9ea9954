"""The sharded train state and the one jitted train step (and eval step) shared by all four objectives.

Loss and metrics are token-weighted *sums* plus a token count, so means are exact across devices, gradient
accumulation micro-steps and padded eval batches: the gradient of the accumulated loss sum is divided by the number
of target tokens in the whole global batch.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdlm.data.objectives import IGNORE_INDEX
from spmdlm.mesh import batch_sharding, constrain

Batch = dict[str, jax.Array]


def cross_entropy_sums(logits: jax.Array, labels: jax.Array, z_loss: float = 0.0) -> dict[str, jax.Array]:
    """Summed fp32 cross-entropy, optional T5X z-loss (coef · logsumexp²), token count and correct predictions."""
    logits = logits.astype(jnp.float32)
    valid = labels != IGNORE_INDEX
    safe_labels = jnp.where(valid, labels, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, safe_labels[..., None], axis=-1)[..., 0]
    weights = valid.astype(jnp.float32)
    return {
        "loss_sum": jnp.sum((lse - target) * weights),
        "z_loss_sum": z_loss * jnp.sum(jnp.square(lse) * weights),
        "tokens": jnp.sum(weights),
        # Reuses the row max logsumexp already took instead of a separate argmax pass (~5% of a CPU step);
        # an exact tie for the top logit counts as correct.
        "correct": jnp.sum((target >= jnp.max(logits, axis=-1)) & valid).astype(jnp.float32),
    }


def forward(model: nnx.Module, batch: Batch, rngs: nnx.Rngs | None = None, *, features_only: bool = False
            ) -> jax.Array:
    """Logits (or the features the LM head reads) for a batch of any objective: encoder-decoders also take decoder
    inputs."""
    if "decoder_input_ids" in batch:
        return model(batch["input_ids"], batch["decoder_input_ids"], attention_mask=batch.get("attention_mask"),
                     decoder_attention_mask=batch.get("decoder_attention_mask"), rngs=rngs,
                     features_only=features_only)
    return model(batch["input_ids"], attention_mask=batch.get("attention_mask"), rngs=rngs,
                 features_only=features_only)


def chunked_cross_entropy_sums(head: Callable[[jax.Array], jax.Array], features: jax.Array, labels: jax.Array,
                               chunk: int, z_loss: float = 0.0) -> dict[str, jax.Array]:
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
        return cross_entropy_sums(head(x), y, z_loss)

    def body(total, xy):
        return jax.tree.map(jnp.add, total, chunk_sums(*xy)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(chunk_sums, features[0], labels[0]))
    return jax.lax.scan(body, zeros, (features, labels))[0]


def head_sums(head: Callable[[jax.Array], jax.Array], features: jax.Array, labels: jax.Array, *, z_loss: float = 0.0,
              loss_chunk: int = 0) -> dict[str, jax.Array]:
    """Loss sums of the LM head over `features` [B, T, d], all positions at once or `loss_chunk` at a time."""
    if 0 < loss_chunk < labels.shape[1]:
        return chunked_cross_entropy_sums(head, features, labels, loss_chunk, z_loss)
    return cross_entropy_sums(head(features), labels, z_loss)


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


def loss_sums(model: nnx.Module, batch: Batch, rngs: nnx.Rngs | None = None, *, z_loss: float = 0.0,
              loss_chunk: int = 0, label_capacity: int | None = None) -> dict[str, jax.Array]:
    """The token-summed loss and metrics of one batch. `loss_chunk` > 0 computes them a chunk of positions at a time
    (`chunked_cross_entropy_sums`); `label_capacity` (the objective's) runs the LM head on labelled positions only
    (`labelled_positions_sums`). Both give the same sums as the plain loss."""
    labels = batch["labels"]
    gather = bool(label_capacity) and label_capacity < labels.shape[1]
    if not gather and not 0 < loss_chunk < labels.shape[1]:
        return cross_entropy_sums(forward(model, batch, rngs), labels, z_loss)
    features = forward(model, batch, rngs, features_only=True)
    if gather:
        return labelled_positions_sums(model.head, features, labels, label_capacity, z_loss=z_loss,
                                       loss_chunk=loss_chunk)
    return head_sums(model.head, features, labels, z_loss=z_loss, loss_chunk=loss_chunk)


def create_train_state(build: Callable[[], tuple[nnx.Module, nnx.Optimizer]], mesh: Mesh, *, abstract=False):
    """Build (model, optimizer) inside jit under the mesh so every array is born sharded (no replicated copy).

    `abstract=True` allocates nothing: it returns shapes with the exact shardings the initialiser would produce
    (read from its compiled program), a restore target that keeps a resume at one copy of the state.
    """
    with jax.set_mesh(mesh):
        graphdef, _ = nnx.split(nnx.eval_shape(build))
        init = jax.jit(lambda: nnx.state(build()))
        if not abstract:
            return graphdef, init()
        shapes = jax.eval_shape(init)
        shardings = init.lower().compile().output_shardings
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return graphdef, state


def state_shardings(state) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)


class Stepper:
    """Compiles and runs the train and eval steps over the flat (model, optimizer) state, which it donates."""

    def __init__(self, graphdef, state, mesh: Mesh, *, grad_accum: int = 1, z_loss: float = 0.0,
                 dropout_seed: int = 0, schedule: optax.Schedule | None = None, loss_chunk: int = 0,
                 label_capacity: int | None = None):
        self.graphdef, self.mesh = graphdef, mesh
        self.grad_accum, self.schedule = grad_accum, schedule
        self.loss = dict(z_loss=z_loss, loss_chunk=loss_chunk, label_capacity=label_capacity)
        self.dropout_key = jax.random.key(dropout_seed)
        self.shardings = state_shardings(state)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._train = self._eval = None
        self.compile_stats: dict[str, Any] = {}

    # -- the step functions (pure; traced once) ------------------------------------------------------------------
    def _train_step(self, state, batch: Batch, step: jax.Array):
        model, optimizer = nnx.merge(self.graphdef, state)
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        step_key = jax.random.fold_in(self.dropout_key, step)

        def micro_grads(p, micro: Batch, index):
            def loss_of(p):
                m = nnx.merge(graph, p, rest)
                rngs = nnx.Rngs(dropout=jax.random.fold_in(step_key, index))
                sums = loss_sums(m, micro, rngs, **self.loss)
                return sums["loss_sum"] + sums["z_loss_sum"], sums
            return jax.grad(loss_of, has_aux=True)(p)

        if self.grad_accum == 1:
            grads, sums = micro_grads(params, batch, 0)
        else:
            # Row r of device-local data goes to micro-step r % k, so every micro-batch stays evenly sharded.
            k = self.grad_accum
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)

            def body(carry, inputs):
                acc, p = carry
                # The barrier keeps XLA from hoisting fsdp's weight all-gathers out of the loop, which would hold
                # a whole unsharded copy of the parameters for the entire step.
                p = jax.lax.optimization_barrier(p)
                return (jax.tree.map(jnp.add, acc, micro_grads(p, *inputs)), p), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: micro_grads(
                params, jax.tree.map(lambda x: x[0], micro), 0)))
            ((grads, sums), _), _ = jax.lax.scan(body, (zeros, params), (micro, jnp.arange(k)))
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
        metrics = dict(sums, grad_norm=optax.global_norm(grads))
        if self.schedule is not None:
            metrics["learning_rate"] = self.schedule(step)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), metrics

    def _eval_step(self, state, batch: Batch):
        model, _ = nnx.merge(self.graphdef, state)
        return loss_sums(model, batch, **self.loss)

    # -- compilation ---------------------------------------------------------------------------------------------
    def _batch_shardings(self, batch_spec: dict[str, jax.ShapeDtypeStruct]):
        return {k: batch_sharding(self.mesh, len(v.shape)) for k, v in batch_spec.items()}

    def compile_train(self, state, batch_spec: dict[str, jax.ShapeDtypeStruct]):
        """AOT-compile the train step once; record compile time, memory and XLA's FLOP count."""
        fn = jax.jit(self._train_step, in_shardings=(self.shardings, self._batch_shardings(batch_spec),
                                                     self.replicated),
                     out_shardings=(self.shardings, self.replicated), donate_argnums=0)
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            self._train = fn.lower(abstract_state, batch_spec, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        self.compile_stats = {"compile_seconds": time.perf_counter() - start, **compiled_stats(self._train)}
        return self.compile_stats

    def train_step(self, state, batch: Batch, step: int):
        with jax.set_mesh(self.mesh):
            return self._train(state, batch, np.int32(step))

    def eval_step(self, state, batch: Batch):
        if self._eval is None:
            self._eval = jax.jit(self._eval_step, in_shardings=(self.shardings, self._batch_shardings(batch)),
                                 out_shardings=self.replicated)
        with jax.set_mesh(self.mesh):
            return self._eval(state, batch)


def compiled_stats(compiled) -> dict[str, Any]:
    """Per-device memory of a compiled step and XLA's own FLOP estimate (None where the backend does not say)."""
    out: dict[str, Any] = {}
    try:
        mem = compiled.memory_analysis()
        out.update(argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                   temp_bytes=mem.temp_size_in_bytes, alias_bytes=mem.alias_size_in_bytes)
    except Exception:  # some backends have no memory analysis
        pass
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        out["xla_flops_per_device"] = float(cost.get("flops", 0.0)) if cost else None
    except Exception:
        pass
    return out
