"""The generation (KV) cache: a decoder stack's keys and values of the tokens so far, which spmdlm.generate carries
through `LayerStack.scan_with_cache` and each `attention.Attention` writes to and reads from."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spmdlm.mesh import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """A decoder stack's state during generation, preallocated for the whole generation so that every decode step
    has the same shapes (one compilation).

    Slots are the positions of the cache: every row writes its next token to the same slot `index`; rows differ only
    in which slots hold real tokens (`valid`: a left-padded prompt's padding never does). Per-layer arrays are
    stacked on a leading layers axis. `LayerStack.scan_with_cache` carries the whole cache through the layer scan
    with `layer` set to the running layer, whose attention writes its new keys and values into it (updating this
    record while it is traced) and reads its own slice. Heads come before slots: the layout attention's matmuls
    read without a transpose.
    """

    key: jax.Array  # [layers, batch, heads, slots, head_dim]: self-attention keys of the tokens so far
    value: jax.Array
    valid: jax.Array  # [batch, slots] bool: the slot holds a real token
    index: jax.Array  # int32 scalar: the next token's slot
    cross_key: jax.Array | None = None  # [layers, batch, heads, source, head_dim]: the encoder output's, projected once
    cross_value: jax.Array | None = None
    cross_valid: jax.Array | None = None  # [batch, source] bool: the encoder input's non-padding tokens
    layer: jax.Array | None = None  # inside the layer scan: the index of the layer being run

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        slots: int,
        heads: int,
        head_dim: int,
        dtype,
        cross: tuple[jax.Array, jax.Array] | None = None,
        cross_valid: jax.Array | None = None,
    ) -> Cache:
        """`cross`: the stacked cross-attention keys and values [layers, batch, source, heads, head_dim]."""
        shape = (layers, batch, heads, slots, head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), "layers", "batch", "act_heads", "length", None)
        cross_key, cross_value = (jnp.swapaxes(a, 2, 3) for a in cross) if cross else (None, None)
        return cls(
            zeros(),
            zeros(),
            jnp.zeros((batch, slots), bool),
            jnp.zeros((), jnp.int32),
            cross_key,
            cross_value,
            None if cross_valid is None else cross_valid.astype(bool),
        )

    def advance(self, length: int, attention_mask: jax.Array | None = None):
        """For the next `length` tokens, about to go to slots index..index+length-1 (`attention_mask` [B, length]:
        0 marks padding): their positions [B, length], which slots each may see ([B, 1, length, slots] bool: the real
        tokens up to itself; an `AttentionMask(dense=)`), and the cache with their slots marked valid.

        A position counts the row's real tokens before it, so left padding shifts nothing (transformers' generate
        derives position_ids from the attention mask the same way; padding gets position 0).
        """
        real = jnp.ones((self.valid.shape[0], length), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = self.valid.sum(-1, keepdims=True) + jnp.cumsum(real, axis=1) - 1
        valid = jax.lax.dynamic_update_slice_in_dim(self.valid, real, self.index, axis=1)
        slots = jnp.arange(valid.shape[1])
        causal = slots[None, :] <= self.index + jnp.arange(length)[:, None]
        visible = valid[:, None, None, :] & causal[None, None]
        return jnp.maximum(positions, 0), visible, dataclasses.replace(self, valid=valid)

    def write(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The running layer's new keys and values [B, T, heads, head_dim] go to slots index..; returns all its
        slots' [B, heads, slots, head_dim]."""

        def put(stacked, new):
            new = jnp.swapaxes(new, 1, 2)[None].astype(stacked.dtype)
            return jax.lax.dynamic_update_slice(stacked, new, (self.layer, 0, 0, self.index, 0))

        self.key, self.value = put(self.key, key), put(self.value, value)
        return self.key[self.layer], self.value[self.layer]
