"""The encoder-decoder plumbing T5 and BART share: encode, decode (teacher-forced), the forward pass of training, and
generation's cache (`init_cache`, `extend`).

A model subclasses `EncoderDecoder` and builds `shared` (the token table), `encoder` and `decoder` (its stacks) and
`head` (features -> logits); what differs between models stays in its folder (spmdlm/families/<name>/model.py):
how a stack embeds positions and what its layers are. A stack is called as
`stack(embedded, mask, context, context_mask, positions=, rngs=)` -> features, and the decoder also has
`extend(embedded, cache)` (generation) and `cross_keys_values(encoded)` (the cross-attention keys and values of every
layer, for the cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from flax import nnx

from spmdlm.models.attention import make_attention_mask, segment_positions
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.kv_cache import Cache


@dataclasses.dataclass(frozen=True)
class EncoderDecoderConfig(HFConfig):
    """Base of an encoder-decoder's config: transformers reads `is_encoder_decoder` from config.json (the last key)."""

    is_encoder_decoder: ClassVar[bool] = True

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "is_encoder_decoder": True}


@dataclasses.dataclass(frozen=True)
class Packing:
    """A packed batch's fields (docs/packing.md), each [B, T] or [B, T_dec]; all None for unpacked rows.

    `segment_ids` (0 = padding): attention stays within a segment, and the decoder's segment k reads the encoder's
    segment k. `positions`: each token's position within its segment (default: counted from the segment ids)."""

    segment_ids: jax.Array | None = None
    decoder_segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    decoder_positions: jax.Array | None = None

    @property
    def encoder_positions(self) -> jax.Array | None:
        return _within_segments(self.segment_ids, self.positions)

    @property
    def decoder_positions_within(self) -> jax.Array | None:
        return _within_segments(self.decoder_segment_ids, self.decoder_positions)


UNPACKED = Packing()


def _within_segments(segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array | None:
    """Positions within packed segments (given, or from the segment ids); None for unpacked rows (0..T-1)."""
    return positions if positions is not None or segment_ids is None else segment_positions(segment_ids)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The decoder's self-attention cache: one entry per layer of `heads` heads of `head_dim`."""

    layers: int
    heads: int
    head_dim: int


class EncoderDecoder(nnx.Module):
    """`model(input_ids, decoder_input_ids, attention_mask=None, decoder_attention_mask=None, packing=, rngs=)`
    -> logits [B, T_dec, V]; dropout only when rngs are given. Masks are 1 for real tokens, 0 for padding."""

    def embed(self, ids: jax.Array) -> jax.Array:
        """Token ids -> the embeddings the stacks read (both stacks share the table)."""
        return self.shared(ids)

    def head(self, x: jax.Array) -> jax.Array:
        """The decoder's final features [..., d] -> logits [..., V]."""
        raise NotImplementedError

    @property
    def cache_layout(self) -> CacheLayout:
        raise NotImplementedError

    def encode(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        packing: Packing = UNPACKED,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        segments = packing.segment_ids
        mask = make_attention_mask(attention_mask, q_segments=segments, kv_segments=segments)
        return self.encoder(self.embed(input_ids), mask, positions=packing.encoder_positions, rngs=rngs)

    def decode(
        self,
        decoder_input_ids: jax.Array,
        encoded: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        packing: Packing = UNPACKED,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        segments = packing.decoder_segment_ids
        mask = make_attention_mask(decoder_attention_mask, causal=True, q_segments=segments, kv_segments=segments)
        context_mask = make_attention_mask(attention_mask, q_segments=segments, kv_segments=packing.segment_ids)
        x = self.decoder(
            self.embed(decoder_input_ids),
            mask,
            encoded,
            context_mask,
            positions=packing.decoder_positions_within,
            rngs=rngs,
        )
        return x if features_only else self.head(x)

    def __call__(
        self,
        input_ids: jax.Array,
        decoder_input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        packing: Packing = UNPACKED,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        encoded = self.encode(input_ids, attention_mask, packing=packing, rngs=rngs)
        return self.decode(
            decoder_input_ids,
            encoded,
            attention_mask,
            decoder_attention_mask,
            packing=packing,
            rngs=rngs,
            features_only=features_only,
        )

    def init_cache(self, encoded: jax.Array, attention_mask: jax.Array, slots: int) -> Cache:
        """An empty decoder cache of `slots` tokens holding the cross-attention keys and values of `encoded`."""
        layout = self.cache_layout
        cross = self.decoder.cross_keys_values(encoded)
        batch, dtype = encoded.shape[0], self.shared.dtype
        return Cache.empty(layout.layers, batch, slots, layout.heads, layout.head_dim, dtype, cross, attention_mask)

    def extend(self, decoder_input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Generation: the next decoder tokens [B, T] attend to the cached ones -> logits [B, T, V] and the cache."""
        x, cache = self.decoder.extend(self.embed(decoder_input_ids), cache)
        return self.head(x), cache
