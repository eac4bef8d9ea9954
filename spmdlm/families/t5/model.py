"""T5 v1.1: an encoder-decoder transformer with RMSNorm, relative position buckets, gated-GELU and an untied head.

Mirrors transformers' `T5ForConditionalGeneration` (v1.1 flavour: gated feed-forward, no d_model**-0.5 scaling of
the decoder output, separate `lm_head`). Attribute names follow HF where our shared layers allow;
`hf.py` beside it holds the rename table. Blocks are stacked and scanned; the relative-position table, which
HF keeps in block 0, belongs to each stack here (every block of the stack uses it). Attention is unscaled
(scale=1.0): T5's initialisation of the query projection absorbs 1/sqrt(d_kv).

transformers 5 quirk (docs/architecture.md §5): it always sets `tie_word_embeddings=True` on T5 configs and keeps
the value found in config.json only as `scale_decoder_outputs`. Both `from_dict` and `to_hf_dict` below speak that
dialect.

Generation: `encode` once, `init_cache` (the encoder output's cross-attention keys and values, projected once), then
`extend` one decoder token at a time through a preallocated KV cache (`kv_cache.Cache`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, AttentionMask, AttentionSpec, make_attention_mask
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import ACTIVATIONS, MLP, Embed, Float32Dense, MLPSpec, RMSNorm, dropout
from spmdlm.models.seq2seq import CacheLayout, EncoderDecoder, EncoderDecoderConfig
from spmdlm.models.stack import LayerStack


def hf_scales_decoder_outputs(values: dict[str, Any]) -> bool:
    """Whether transformers would multiply the decoder output by d_model**-0.5 (original, tied T5) for this dict.
    Never for mT5: transformers 5's MT5 has no such scaling, and its config drops tie_word_embeddings (it writes true
    for every mT5; released ones say false); whether the head is tied, the weights say (hf.py, TIED_HEAD)."""
    if values.get("model_type") == "mt5":
        return False
    if "scale_decoder_outputs" in values:
        return bool(values["scale_decoder_outputs"])
    return values.get("tie_word_embeddings", True) is not False


def dense_activation(feed_forward_proj: str) -> str | None:
    """'gated-gelu' -> 'gelu_new' (as transformers maps it), 'gated-silu' -> 'silu'; None if unsupported."""
    kind, _, act = feed_forward_proj.partition("-")
    if kind != "gated" or "-" in act:
        return None
    act = "gelu_new" if act == "gelu" else act
    return act if act in ACTIVATIONS else None


@dataclasses.dataclass(frozen=True)
class T5Config(EncoderDecoderConfig):
    model_type: ClassVar[str] = "t5"
    architecture: ClassVar[str] = "T5ForConditionalGeneration"

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None -> num_layers
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    feed_forward_proj: str = "gated-gelu"
    tie_word_embeddings: bool = False
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    def __post_init__(self):
        if self.num_decoder_layers is None:
            object.__setattr__(self, "num_decoder_layers", self.num_layers)
        if dense_activation(self.feed_forward_proj) is None:
            raise ValueError(
                f"T5 feed_forward_proj {self.feed_forward_proj!r} is not supported; use a gated one "
                f"such as 'gated-gelu' (T5 v1.1)"
            )
        if self.tie_word_embeddings:
            raise ValueError(
                "T5 with a tied, d_model**-0.5-scaled LM head (original T5) is not supported; "
                "use T5 v1.1 (tie_word_embeddings false)"
            )
        buckets = self.relative_attention_num_buckets
        if buckets < 4 or self.relative_attention_max_distance <= buckets // 2:
            raise ValueError(
                f"relative_attention_max_distance {self.relative_attention_max_distance} must exceed "
                f"half of relative_attention_num_buckets ({buckets}), which need to be >= 4"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> T5Config:
        # transformers 5 writes tie_word_embeddings: true even for v1.1 and records the truth in scale_decoder_outputs.
        values = {**values, "tie_word_embeddings": hf_scales_decoder_outputs(values)}
        if values.get("decoder_start_token_id", 0) is None:  # transformers' own T5 checkpoints may say null: T5 uses 0
            del values["decoder_start_token_id"]
        return super().from_dict(values)

    def to_hf_dict(self) -> dict[str, Any]:
        # Both keys, so transformers neither ties lm_head to shared nor scales the decoder output (verified by logits);
        # is_encoder_decoder stays the last key.
        values = super().to_hf_dict()
        last = values.pop("is_encoder_decoder")
        return {**values, "tie_word_embeddings": False, "scale_decoder_outputs": False, "is_encoder_decoder": last}

    @property
    def dense_act_fn(self) -> str:
        return dense_activation(self.feed_forward_proj)

    @property
    def max_length(self) -> int:
        return 512  # relative positions have no limit; this is the tokenizer's model_max_length, as T5's


def relative_position_buckets(
    query_length: int, key_length: int, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """[T, S] bucket of each (key - query) distance: exact for small distances, logarithmic up to max_distance.

    Computed in numpy float32 with the same operation order as transformers (shapes are static), so the bucket
    edges agree with PyTorch's exactly; tests compare the two over a wide range.
    """
    relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)  # future keys (masked anyway) share bucket 0
    max_exact = num_buckets // 2
    ratio = np.maximum(relative, 1).astype(np.float32) / np.float32(max_exact)
    scaled = np.log(ratio) / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact)
    large = np.minimum(max_exact + scaled.astype(np.int64), num_buckets - 1)
    return buckets + np.where(relative < max_exact, relative, large)


class Block(nnx.Module):
    """Self-attention, cross-attention (decoder only) and gated MLP, each pre-RMSNorm with a dropped-out residual."""

    def __init__(self, config: T5Config, *, is_decoder: bool, dtype, rngs: nnx.Rngs):
        d, f, heads, d_kv = config.d_model, config.initializer_factor, config.num_heads, config.d_kv
        # HF's init: q absorbs the missing 1/sqrt(d_kv); k, v, wi by fan-in; o, wo by their fan-in.
        attention = lambda cross=False: Attention(
            d,
            heads,
            d_kv,
            AttentionSpec(
                use_bias=False,
                scale=1.0,
                cross=cross,
                biased=not cross,
                q_init_std=f * (d * d_kv) ** -0.5,
                kv_init_std=f * d**-0.5,
                out_init_std=f * (heads * d_kv) ** -0.5,
            ),
            dropout_rate=config.dropout_rate,
            dtype=dtype,
            rngs=rngs,
        )
        norm = lambda: RMSNorm(d, eps=config.layer_norm_epsilon, rngs=rngs)
        self.self_attention_norm = norm()
        self.self_attention = attention()
        self.cross_attention_norm = norm() if is_decoder else None
        self.cross_attention = attention(cross=True) if is_decoder else None
        self.mlp_norm = norm()
        self.mlp = MLP(
            d,
            config.d_ff,
            MLPSpec(gated=True, use_bias=False, out_init_std=f * config.d_ff**-0.5),
            activation=config.dense_act_fn,
            dropout_rate=config.dropout_rate,
            init_std=f * d**-0.5,
            dtype=dtype,
            rngs=rngs,
        )
        self.dropout_rate = config.dropout_rate

    def __call__(self, x, mask, bias, context, context_mask, *, rngs=None, cache=None):
        rate = self.dropout_rate
        h = self.self_attention(self.self_attention_norm(x), mask=mask, bias=bias, rngs=rngs, cache=cache)
        x = x + dropout(h, rate, rngs)
        if self.cross_attention is not None:
            h = self.cross_attention(self.cross_attention_norm(x), context, mask=context_mask, rngs=rngs, cache=cache)
            x = x + dropout(h, rate, rngs)
        x = x + dropout(self.mlp(self.mlp_norm(x), rngs), rate, rngs)
        return constrain(x, "batch", "length", "act_embed")


class Stack(nnx.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention): blocks + final RMSNorm."""

    def __init__(
        self, config: T5Config, *, is_decoder: bool, dtype, rngs: nnx.Rngs, remat: str, scan_unroll: int | bool = 1
    ):
        self.config = config
        self.is_decoder = is_decoder
        d, heads = config.d_model, config.num_heads
        self.relative_attention_bias = Embed(
            config.relative_attention_num_buckets,
            heads,
            init_std=config.initializer_factor * d**-0.5,
            axes=("relpos_buckets", "heads"),
            rngs=rngs,
        )
        count = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = LayerStack(
            lambda r: Block(config, is_decoder=is_decoder, dtype=dtype, rngs=r),
            count,
            rngs=rngs,
            remat=remat,
            unroll=scan_unroll,
        )
        self.final_layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon, rngs=rngs)

    def position_bias(self, length: int, queries: tuple[jax.Array, int] | None = None) -> jax.Array:
        """[1, heads, T, length] additive self-attention bias from the stack's table (float32): for all `length`
        positions as queries, or for `queries` = (first, count) of them (generation: the tokens being fed)."""
        buckets = jnp.asarray(
            relative_position_buckets(
                length,
                length,
                bidirectional=not self.is_decoder,
                num_buckets=self.config.relative_attention_num_buckets,
                max_distance=self.config.relative_attention_max_distance,
            ),
            dtype=jnp.int32,
        )
        if queries is not None:
            buckets = jax.lax.dynamic_slice_in_dim(buckets, *queries, axis=0)
        values = self.relative_attention_bias(buckets)  # [T, length, heads]
        return jnp.transpose(values, (2, 0, 1))[None].astype(jnp.float32)

    def __call__(self, x, mask, context=None, context_mask=None, *, positions=None, rngs=None):
        del positions  # relative positions: within a packed segment, key - query distances are the segment's own
        rate = self.config.dropout_rate
        bias = self.position_bias(x.shape[1])
        x = dropout(constrain(x, "batch", "length", "act_embed"), rate, rngs)
        x = self.block(x, mask, bias, context, context_mask, rngs=rngs)
        return dropout(self.final_layer_norm(x), rate, rngs)

    def extend(self, x: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """The decoder during generation: the next tokens' embeddings x [B, T, d] through the cache (no padding)."""
        _, visible, cache = cache.advance(x.shape[1])
        bias = self.position_bias(cache.valid.shape[1], queries=(cache.index, x.shape[1]))  # slots are positions
        x, cache = self.block.scan_with_cache(
            x, cache, AttentionMask(dense=visible), bias, None, make_attention_mask(cache.cross_valid)
        )
        return self.final_layer_norm(x), cache

    def cross_keys_values(self, encoded: jax.Array):
        """The decoder's cross-attention keys and values of `encoded`, for every block (generation's cache)."""
        return self.block.map(lambda block: block.cross_attention.keys_values(encoded))


class T5ForConditionalGeneration(EncoderDecoder):
    """The shared token table, the two stacks and the untied `lm_head` (`EncoderDecoder` holds the forward pass and
    generation). Packed rows' relative positions need no reset: within a segment, key - query distances are those
    of the segment alone, so `Packing.positions` (the other families' packed fields) are accepted and not needed."""

    config_class = T5Config

    def __init__(
        self, config: T5Config, *, rngs: nnx.Rngs, dtype=jnp.float32, remat: str = "dots", scan_unroll: int | bool = 1
    ):
        self.config = config
        f = config.initializer_factor
        self.shared = Embed(config.vocab_size, config.d_model, init_std=f * 1.0, dtype=dtype, rngs=rngs)
        stack = lambda is_decoder: Stack(
            config, is_decoder=is_decoder, dtype=dtype, rngs=rngs, remat=remat, scan_unroll=scan_unroll
        )
        self.encoder, self.decoder = stack(False), stack(True)
        # HF draws lm_head from N(0, 1) (it inherits the tied init); d_model**-0.5 keeps the initial logits O(1) on
        # RMS-normalised features, as the scaled tied head of original T5 does.
        self.lm_head = Float32Dense(
            config.d_model,
            config.vocab_size,
            ("embed", "vocab"),
            use_bias=False,
            init_std=f * config.d_model**-0.5,
            dtype=dtype,
            rngs=rngs,
        )

    def head(self, x: jax.Array) -> jax.Array:
        """The decoder's final features [..., d] -> logits [..., V]."""
        return constrain(self.lm_head(x), "batch", "length", "act_vocab")  # v1.1: no d_model**-0.5 scaling

    @property
    def cache_layout(self) -> CacheLayout:
        return CacheLayout(self.config.num_decoder_layers, self.config.num_heads, self.config.d_kv)
