"""BART: a post-LayerNorm encoder-decoder with learned positions, trained as a denoising autoencoder.

Mirrors transformers' `BartForConditionalGeneration`; `spmdlm/families/bart.py` holds the rename table. Each stack
(encoder, decoder) has its own learned position table and a LayerNorm right after the embeddings
(`layernorm_embedding`); positions are plain 0..T-1 read at rows offset by 2 (a fairseq legacy: the table has
max_position_embeddings + 2 rows and is not padding-aware, unlike RoBERTa's). Token embeddings are shared by both
stacks and the LM head (tied), times sqrt(d_model) when scale_embedding. The head adds `final_logits_bias`, which HF
keeps as a (1, vocab) buffer and never trains (nor do we). Layers are stacked and scanned (`encoder.layers.layers`,
`decoder.layers.layers`).

Generation: `encode` once, `init_cache` (the encoder output's cross-attention keys and values, projected once), then
`extend` one decoder token at a time through a preallocated KV cache (`kv_cache.Cache`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import AttentionMask, make_attention_mask, segment_positions
from spmdlm.models.blocks import PostNormBlock, PostNormSpec
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import ACTIVATIONS, Bias, Embed, LayerNorm, dropout, make_param
from spmdlm.models.stack import LayerStack

POSITION_OFFSET = 2  # position t reads row t + 2 of the table
LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default, which BART uses everywhere


@dataclasses.dataclass(frozen=True)
class BartConfig(HFConfig):
    model_type: ClassVar[str] = "bart"
    architecture: ClassVar[str] = "BartForConditionalGeneration"
    is_encoder_decoder: ClassVar[bool] = True

    vocab_size: int = 50265
    d_model: int = 1024
    encoder_layers: int = 12
    decoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    decoder_ffn_dim: int = 4096
    activation_function: str = "gelu"  # exact (erf) GELU, as torch's
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_position_embeddings: int = 1024
    init_std: float = 0.02
    scale_embedding: bool = False
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    decoder_start_token_id: int = 2
    forced_eos_token_id: int | None = 2
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for stack in ("encoder", "decoder"):
            heads = getattr(self, f"{stack}_attention_heads")
            if self.d_model % heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by {stack}_attention_heads {heads}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(
                f"activation_function {self.activation_function!r} is not supported; use one of "
                f"{', '.join(ACTIVATIONS)}"
            )
        if not self.tie_word_embeddings:
            raise ValueError(
                "BART with an LM head untied from the shared embeddings is not supported; set "
                "tie_word_embeddings to true"
            )
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings {self.max_position_embeddings} must be at least 1")

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "is_encoder_decoder": True}

    @property
    def max_length(self) -> int:
        """Longest sequence either stack can read (the offset rows are extra)."""
        return self.max_position_embeddings


def _positions(segment_ids: jax.Array | None, positions: jax.Array | None) -> jax.Array | None:
    """Positions within packed segments (given, or from the segment ids); None for unpacked rows (0..T-1)."""
    return positions if positions is not None or segment_ids is None else segment_positions(segment_ids)


class BartStack(nnx.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention): positions, layernorm_embedding,
    then post-LN layers. It takes the (scaled) token embeddings: the table is shared, so it lives in the model."""

    def __init__(
        self, config: BartConfig, *, is_decoder: bool, dtype, rngs: nnx.Rngs, remat: str, scan_unroll: int | bool = 1
    ):
        self.config = config
        d, std = config.d_model, config.init_std
        stack = "decoder" if is_decoder else "encoder"
        self.embed_positions = Embed(
            config.max_position_embeddings + POSITION_OFFSET,
            d,
            init_std=std,
            dtype=dtype,
            axes=("positions", "embed"),
            rngs=rngs,
        )
        self.layernorm_embedding = LayerNorm(d, eps=LAYER_NORM_EPS, rngs=rngs)
        self.layers = LayerStack(
            lambda r: PostNormBlock(
                PostNormSpec(
                    d,
                    getattr(config, f"{stack}_attention_heads"),
                    getattr(config, f"{stack}_ffn_dim"),
                    activation=config.activation_function,
                    eps=LAYER_NORM_EPS,
                    dropout_rate=config.dropout,
                    attention_dropout=config.attention_dropout,
                    activation_dropout=config.activation_dropout,
                    init_std=std,
                ),
                cross_attention=is_decoder,
                dtype=dtype,
                rngs=r,
            ),
            getattr(config, f"{stack}_layers"),
            rngs=rngs,
            remat=remat,
            unroll=scan_unroll,
        )

    def __call__(self, embedded, mask, context=None, context_mask=None, *, positions=None, rngs=None):
        """`positions` [B, T]: each token's position within its packed segment (default: 0..T-1)."""
        length = embedded.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        positions = jnp.arange(length) if positions is None else positions
        x = dropout(self.with_positions(embedded, positions), self.config.dropout, rngs)
        return self.layers(x, mask, context, context_mask, rngs=rngs)

    def with_positions(self, embedded, positions):
        """Add the position embeddings of `positions` ([T], or [B, T] in generation) and normalise."""
        x = embedded + self.embed_positions(positions + POSITION_OFFSET)
        return self.layernorm_embedding(constrain(x, "batch", "length", "act_embed"))

    def extend(self, embedded, cache: Cache) -> tuple[jax.Array, Cache]:
        """The decoder during generation: the next tokens' embeddings [B, T, d] through the cache (no padding)."""
        positions, visible, cache = cache.advance(embedded.shape[1])
        return self.layers.scan_with_cache(
            self.with_positions(embedded, positions),
            cache,
            AttentionMask(dense=visible),
            None,
            make_attention_mask(cache.cross_valid),
        )


class BartForConditionalGeneration(nnx.Module):
    """`model(input_ids, decoder_input_ids, attention_mask=None, decoder_attention_mask=None, rngs=None)`
    -> logits [B, T_dec, V]; dropout only when rngs are given. Masks are 1 for real tokens, 0 for padding.

    Packed rows (training) also pass `segment_ids` [B, T] and `decoder_segment_ids` [B, T_dec] (0 = padding), and
    optionally `positions` / `decoder_positions` within each segment: each attention stays within a segment, the
    decoder's segment k reads the encoder's segment k, and the learned positions restart in each segment."""

    config_class = BartConfig

    def __init__(
        self, config: BartConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, remat: str = "dots", scan_unroll: int | bool = 1
    ):
        self.config = config
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.shared = Embed(config.vocab_size, config.d_model, init_std=config.init_std, dtype=dtype, rngs=rngs)
        stack = lambda is_decoder: BartStack(
            config, is_decoder=is_decoder, dtype=dtype, rngs=rngs, remat=remat, scan_unroll=scan_unroll
        )
        self.encoder, self.decoder = stack(False), stack(True)
        self.final_logits_bias = make_param(
            nnx.initializers.zeros, rngs.params(), (config.vocab_size,), ("vocab",), kind=Bias
        )

    def embed(self, ids: jax.Array) -> jax.Array:
        return self.shared(ids) * self.embed_scale

    def encode(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        mask = make_attention_mask(attention_mask, q_segments=segment_ids, kv_segments=segment_ids)
        return self.encoder(self.embed(input_ids), mask, positions=_positions(segment_ids, positions), rngs=rngs)

    def decode(
        self,
        decoder_input_ids: jax.Array,
        encoded: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
        decoder_positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        mask = make_attention_mask(
            decoder_attention_mask, causal=True, q_segments=decoder_segment_ids, kv_segments=decoder_segment_ids
        )
        context_mask = make_attention_mask(attention_mask, q_segments=decoder_segment_ids, kv_segments=segment_ids)
        x = self.decoder(
            self.embed(decoder_input_ids),
            mask,
            encoded,
            context_mask,
            positions=_positions(decoder_segment_ids, decoder_positions),
            rngs=rngs,
        )
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The decoder's final features [..., d] -> logits [..., V]."""
        # Tied head: the unscaled shared table. final_logits_bias is not trained, as in transformers (a buffer in
        # PyTorch, stop_gradient in Flax); a Param all the same, so checkpoints keep their tree (its updates are 0).
        logits = self.shared.attend(x) + jax.lax.stop_gradient(self.final_logits_bias[...])
        return constrain(logits, "batch", "length", "act_vocab")

    def __call__(
        self,
        input_ids: jax.Array,
        decoder_input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        decoder_attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        decoder_positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        encoded = self.encode(input_ids, attention_mask, segment_ids=segment_ids, positions=positions, rngs=rngs)
        return self.decode(
            decoder_input_ids,
            encoded,
            attention_mask,
            decoder_attention_mask,
            segment_ids=segment_ids,
            decoder_segment_ids=decoder_segment_ids,
            decoder_positions=decoder_positions,
            rngs=rngs,
            features_only=features_only,
        )

    def init_cache(self, encoded: jax.Array, attention_mask: jax.Array, slots: int) -> Cache:
        """An empty decoder cache of `slots` tokens holding the cross-attention keys and values of `encoded`."""
        config = self.config
        heads = config.decoder_attention_heads
        cross = self.decoder.layers.map(lambda layer: layer.encoder_attn.keys_values(encoded))
        return Cache.empty(
            config.decoder_layers,
            encoded.shape[0],
            slots,
            heads,
            config.d_model // heads,
            self.shared.dtype,
            cross,
            attention_mask,
        )

    def extend(self, decoder_input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Generation: the next decoder tokens [B, T] attend to the cached ones -> logits [B, T, V] and the cache."""
        x, cache = self.decoder.extend(self.embed(decoder_input_ids), cache)
        return self.head(x), cache
