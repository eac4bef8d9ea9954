"""The one rule that turns logits into the next token, for every family: greedy, temperature, top-k, top-p.

transformers' semantics and order (temperature, then top-k, then top-p on what top-k kept): top-k keeps every token
tied with the k-th; top-p keeps the most likely tokens until their mass reaches p, and always the most likely one.
The settings are traced values, so changing them does not recompile the decode step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (top_k and top_p are then ignored, as with do_sample=False)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def check(self) -> None:
        """One-line errors named after the command-line flags."""
        if not self.temperature >= 0:
            raise ValueError(f"--temperature {self.temperature} must be >= 0 (0 decodes greedily)")
        if self.top_k < 0:
            raise ValueError(f"--top_k {self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p {self.top_p} must be in (0, 1] (1 keeps every token)")


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` [..., V] with the tokens that top-k and then top-p remove set to -inf."""
    vocab = logits.shape[-1]
    ranked = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jax.lax.dynamic_index_in_dim(ranked, k - 1, axis=-1)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # of the tokens ranked above each one
    kept = jnp.sum((mass_before < top_p) | (top_p >= 1), axis=-1, keepdims=True)  # at least the most likely one
    cutoff = jnp.take_along_axis(ranked, kept - 1, axis=-1)
    return jnp.where(logits < jnp.maximum(kth, cutoff), -jnp.inf, logits)


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V]; rows draw independently from one key."""

    def sample(logits):
        scaled = logits / sampling.temperature
        filtered = jax.lax.cond(
            (sampling.top_k > 0) | (sampling.top_p < 1),
            filter_logits,
            lambda x, *_: x,
            scaled,
            sampling.top_k,
            sampling.top_p,
        )  # sorting V costs
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    greedy = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.cond(sampling.temperature == 0, greedy, sample, logits)
