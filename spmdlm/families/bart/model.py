"""BART: a post-LayerNorm encoder-decoder with learned positions, trained as a denoising autoencoder.

Mirrors transformers' `BartForConditionalGeneration`; `hf.py` beside it holds the rename table. Each stack
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
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import AttentionMask, make_attention_mask
from spmdlm.models.blocks import PostNormBlock, PostNormSpec
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import ACTIVATIONS, Bias, Embed, LayerNorm, dropout, make_param
from spmdlm.models.seq2seq import CacheLayout, EncoderDecoder, EncoderDecoderConfig
from spmdlm.models.stack import LayerStack

POSITION_OFFSET = 2  # position t reads row t + 2 of the table
LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default, which BART uses everywhere


@dataclasses.dataclass(frozen=True)
class BartConfig(EncoderDecoderConfig):
    model_type: ClassVar[str] = "bart"
    architecture: ClassVar[str] = "BartForConditionalGeneration"

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

    @property
    def max_length(self) -> int:
        """Longest sequence either stack can read (the offset rows are extra)."""
        return self.max_position_embeddings


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

    def cross_keys_values(self, encoded: jax.Array):
        """The decoder's cross-attention keys and values of `encoded`, for every layer (generation's cache)."""
        return self.layers.map(lambda layer: layer.encoder_attn.keys_values(encoded))


class BartForConditionalGeneration(EncoderDecoder):
    """The shared token table (scaled for the stacks when scale_embedding), the two stacks and the tied head
    (`EncoderDecoder` holds the forward pass and generation). Packed rows' learned positions restart in each
    segment."""

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

    def head(self, x: jax.Array) -> jax.Array:
        """The decoder's final features [..., d] -> logits [..., V]."""
        # Tied head: the unscaled shared table. final_logits_bias is not trained, as in transformers (a buffer in
        # PyTorch, stop_gradient in Flax); a Param all the same, so checkpoints keep their tree (its updates are 0).
        logits = self.shared.attend(x) + jax.lax.stop_gradient(self.final_logits_bias[...])
        return constrain(logits, "batch", "length", "act_vocab")

    @property
    def cache_layout(self) -> CacheLayout:
        heads = self.config.decoder_attention_heads
        return CacheLayout(self.config.decoder_layers, heads, self.config.d_model // heads)
