"""GPT-2: a decoder-only transformer with pre-LayerNorm blocks, learned positions and a tied LM head.

Mirrors transformers' `GPT2LMHeadModel` (attribute names follow it where our shared layers allow;
`hf.py` beside it holds the rename table). The blocks are stacked and scanned (`h.layers`). Dropout uses HF's
pdrop names and defaults (0.1, what transformers reads from a config.json without them); the presets set 0, the
pretraining recipe's setting.
Generation (`init_cache`, `extend`) feeds tokens through a preallocated KV cache (`kv_cache.Cache`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, AttentionMask, AttentionSpec, make_attention_mask, segment_positions
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import MLP, Embed, LayerNorm, MLPSpec, dropout
from spmdlm.models.stack import LayerStack


@dataclasses.dataclass(frozen=True)
class GPT2Config(HFConfig):
    model_type: ClassVar[str] = "gpt2"
    architecture: ClassVar[str] = "GPT2LMHeadModel"

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1  # transformers' defaults (a config.json without them means 0.1); presets say 0.0
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    bos_token_id: int = 50256
    eos_token_id: int = 50256
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not self.tie_word_embeddings:
            raise ValueError("GPT-2 with an untied LM head is not supported; set tie_word_embeddings to true")

    @property
    def max_length(self) -> int:
        return self.n_positions


class Block(nnx.Module):
    def __init__(self, config: GPT2Config, *, dtype, rngs: nnx.Rngs):
        d, std = config.n_embd, config.initializer_range
        # HF scales the init of the residual output projections by 1/sqrt(2 * n_layer) (GPT-2 paper).
        out_std = std / (2 * config.n_layer) ** 0.5
        self.ln_1 = LayerNorm(d, eps=config.layer_norm_epsilon, rngs=rngs)
        self.attn = Attention(
            d,
            config.n_head,
            d // config.n_head,
            AttentionSpec(fused_qkv=True, scale=None if config.scale_attn_weights else 1.0, out_init_std=out_std),
            dropout_rate=config.attn_pdrop,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.ln_2 = LayerNorm(d, eps=config.layer_norm_epsilon, rngs=rngs)
        self.mlp = MLP(
            d,
            config.n_inner or 4 * d,
            MLPSpec(out_init_std=out_std),
            activation=config.activation_function,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.resid_pdrop = config.resid_pdrop

    def __call__(self, x, mask, *, rngs=None, cache=None):
        x = x + dropout(self.attn(self.ln_1(x), mask=mask, rngs=rngs, cache=cache), self.resid_pdrop, rngs)
        x = x + dropout(self.mlp(self.ln_2(x), rngs), self.resid_pdrop, rngs)
        return constrain(x, "batch", "length", "act_embed")


class GPT2LMHeadModel(nnx.Module):
    """`model(input_ids, attention_mask=None, rngs=None) -> logits [B, T, V]`; dropout only when rngs are given.
    Packed rows (training) also pass `segment_ids` [B, T] (0 = padding) and optionally each token's `positions`
    within its segment: attention stays within a segment and the learned positions restart in each."""

    config_class = GPT2Config

    def __init__(
        self, config: GPT2Config, *, rngs: nnx.Rngs, dtype=jnp.float32, remat: str = "dots", scan_unroll: int | bool = 1
    ):
        self.config = config
        self.wte = Embed(config.vocab_size, config.n_embd, init_std=config.initializer_range, dtype=dtype, rngs=rngs)
        self.wpe = Embed(
            config.n_positions, config.n_embd, init_std=0.01, dtype=dtype, rngs=rngs, axes=("positions", "embed")
        )
        self.h = LayerStack(
            lambda r: Block(config, dtype=dtype, rngs=r), config.n_layer, rngs=rngs, remat=remat, unroll=scan_unroll
        )
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, rngs=rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        length = input_ids.shape[1]
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {self.config.n_positions}")
        if positions is None:
            positions = jnp.arange(length)[None] if segment_ids is None else segment_positions(segment_ids)
        x = self.wte(input_ids) + self.wpe(positions)
        x = dropout(constrain(x, "batch", "length", "act_embed"), self.config.embd_pdrop, rngs)
        mask = make_attention_mask(attention_mask, causal=True, q_segments=segment_ids, kv_segments=segment_ids)
        x = self.ln_f(self.h(x, mask, rngs=rngs))
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The final features [..., d] -> logits [..., V] (tied to the token embedding)."""
        return constrain(self.wte.attend(x), "batch", "length", "act_vocab")

    def init_cache(self, batch: int, slots: int) -> Cache:
        """An empty cache of `slots` tokens for `batch` rows."""
        config = self.config
        return Cache.empty(config.n_layer, batch, slots, config.n_head, config.n_embd // config.n_head, self.wte.dtype)

    def extend(
        self, input_ids: jax.Array, cache: Cache, attention_mask: jax.Array | None = None
    ) -> tuple[jax.Array, Cache]:
        """Generation: the next tokens `input_ids` [B, T] of every row (a left-padded prompt, then one token at a
        time) attend to the cached ones; -> their logits [B, T, V] and the cache holding their keys and values."""
        positions, visible, cache = cache.advance(input_ids.shape[1], attention_mask)
        x = constrain(self.wte(input_ids) + self.wpe(positions), "batch", "length", "act_embed")
        x, cache = self.h.scan_with_cache(x, cache, AttentionMask(dense=visible))
        return self.head(self.ln_f(x)), cache
