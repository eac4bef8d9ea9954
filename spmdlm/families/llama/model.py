"""Llama: a decoder-only transformer with pre-RMSNorm layers, rotary positions, grouped-query attention and a SwiGLU
MLP, as transformers' `LlamaForCausalLM`; with `qk_norm` (Qwen3) a per-head RMSNorm of queries and keys, and
sliding-window layers where the config's `layer_types` say `sliding_attention`.

Attribute names follow transformers where the shared layers allow (`spmdlm/families/llama/hf.py` holds the rename
table: q/k/v/o_proj are `query`/`key`/`value`/`out`, gate/up/down_proj `wi_0`/`wi_1`/`wo`). Consecutive layers of
one kind (full or sliding attention) are one scanned `LayerStack`; a model whose layers are all alike has one.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, AttentionMask, AttentionSpec, make_attention_mask, segment_positions
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import ACTIVATIONS, MLP, Embed, Float32Dense, MLPSpec, RMSNorm
from spmdlm.models.rope import Rope, rope_from_hf
from spmdlm.models.stack import LayerStack

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class LlamaConfig(HFConfig):
    """transformers' `LlamaConfig` names and defaults. RoPE comes as `rope_theta` with `rope_scaling` (released
    checkpoints) or as transformers 5's `rope_parameters`; both are read, `rope_parameters` is written."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    qk_norm: ClassVar[bool] = False  # Qwen3: RMSNorm of each query and key head

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as num_attention_heads (filled in, as transformers does)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    rope_parameters: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim"
                )
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
        if isinstance(self.eos_token_id, list):  # Llama 3 instruct lists several; generation stops at the first
            set_("eos_token_id", self.eos_token_id[0])
        rope = self.rope(None)  # refuses what we cannot reproduce
        set_("rope_parameters", self._rope_parameters(rope))
        set_("rope_theta", rope.theta)
        set_("rope_scaling", None)

    def _rope_parameters(self, rope: Rope) -> dict[str, Any]:
        """transformers 5's flat `rope_parameters` of `rope` (what save_pretrained writes)."""
        values: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
        if rope.rope_type == "llama3":
            values.update(
                factor=rope.factor,
                low_freq_factor=rope.low_freq_factor,
                high_freq_factor=rope.high_freq_factor,
                original_max_position_embeddings=rope.original_max_position_embeddings,
            )
        return values

    def rope(self, layer_type: str | None = FULL) -> Rope:
        values = {"rope_theta": 10000.0 if self.rope_theta is None else self.rope_theta}
        values.update(max_position_embeddings=self.max_position_embeddings)
        values.update(rope_parameters=self.rope_parameters, rope_scaling=self.rope_scaling)
        return rope_from_hf(values, self.head_dim, layer_type)

    def layer_kinds(self) -> list[str]:
        """Each layer's attention: FULL or SLIDING (Qwen3's sliding-window layers)."""
        return [FULL] * self.num_hidden_layers

    def window(self, kind: str) -> int | None:
        """The sliding window of a layer of this kind, in tokens (itself included), or None."""
        return None

    def runs(self) -> list[tuple[str, int, int]]:
        """(kind, first layer, count) of each run of consecutive layers of one kind: one layer stack each."""
        out, first = [], 0
        for kind, group in itertools.groupby(self.layer_kinds()):
            count = len(list(group))
            out.append((kind, first, count))
            first += count
        return out

    @property
    def max_length(self) -> int:
        return self.max_position_embeddings

    def to_hf_dict(self) -> dict[str, Any]:
        out = super().to_hf_dict()
        del out["rope_scaling"], out["rope_theta"]  # transformers 5 writes (and reads) rope_parameters
        return out


class DecoderLayer(nnx.Module):
    """x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (transformers' `LlamaDecoderLayer`)."""

    def __init__(self, config: LlamaConfig, window: int | None, *, dtype, rngs: nnx.Rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, rngs=rngs)
        spec = AttentionSpec(
            num_key_value_heads=config.num_key_value_heads,
            use_bias=config.attention_bias,
            rope=config.rope(SLIDING if window else FULL),
            qk_norm_eps=eps if config.qk_norm else None,
            window=None if window is None else (window - 1, 0),
        )
        self.self_attn = Attention(
            d,
            config.num_attention_heads,
            config.head_dim,
            spec,
            dropout_rate=config.attention_dropout,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(d, eps=eps, rngs=rngs)
        self.mlp = MLP(
            d,
            config.intermediate_size,
            MLPSpec(gated=True, use_bias=config.mlp_bias),
            activation=config.hidden_act,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, x, mask, positions, *, rngs=None, cache=None):
        h = self.self_attn(self.input_layernorm(x), mask=mask, positions=positions, rngs=rngs, cache=cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), rngs)
        return constrain(x, "batch", "length", "act_embed")


class LlamaForCausalLM(nnx.Module):
    """`model(input_ids, attention_mask=None, rngs=None) -> logits [B, T, V]`; attention dropout only when rngs
    are given. Packed rows (training) also pass `segment_ids` [B, T] (0 = padding) and optionally each token's
    `positions` within its segment: attention stays within a segment and RoPE positions restart in each."""

    config_class = LlamaConfig

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        remat: str = "dots",
        scan_unroll: int | bool = 1,
    ):
        self.config = config
        d = config.hidden_size
        self.embed_tokens = Embed(config.vocab_size, d, init_std=config.initializer_range, dtype=dtype, rngs=rngs)
        self.stacks = nnx.List(
            [
                LayerStack(
                    lambda r, kind=kind: DecoderLayer(config, config.window(kind), dtype=dtype, rngs=r),
                    count,
                    rngs=rngs,
                    remat=remat,
                    unroll=scan_unroll,
                )
                for kind, _, count in config.runs()
            ]
        )
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, rngs=rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Float32Dense(
                d,
                config.vocab_size,
                ("embed", "vocab"),
                use_bias=False,
                init_std=config.initializer_range,
                dtype=dtype,
                rngs=rngs,
            )
        )

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
        if positions is None:
            positions = jnp.arange(input_ids.shape[1])[None] if segment_ids is None else segment_positions(segment_ids)
        x = constrain(self.embed_tokens(input_ids), "batch", "length", "act_embed")
        mask = make_attention_mask(attention_mask, causal=True, q_segments=segment_ids, kv_segments=segment_ids)
        for stack in self.stacks:
            x = stack(x, mask, positions, rngs=rngs)
        x = self.norm(x)
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The final features [..., d] -> logits [..., V]: the untied lm_head, or the token embedding."""
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return constrain(logits, "batch", "length", "act_vocab")

    def init_cache(self, batch: int, slots: int) -> Cache:
        """An empty cache of `slots` tokens for `batch` rows: the key/value heads only (grouped-query attention)."""
        config = self.config
        return Cache.empty(
            config.num_hidden_layers, batch, slots, config.num_key_value_heads, config.head_dim, self.embed_tokens.dtype
        )

    def extend(
        self, input_ids: jax.Array, cache: Cache, attention_mask: jax.Array | None = None
    ) -> tuple[jax.Array, Cache]:
        """Generation: the next tokens `input_ids` [B, T] of every row (a left-padded prompt, then one token at a
        time) attend to the cached ones; -> their logits [B, T, V] and the cache holding their keys and values.
        A sliding-window layer sees only its window of the cached slots."""
        positions, visible, cache = cache.advance(input_ids.shape[1], attention_mask)
        x = constrain(self.embed_tokens(input_ids), "batch", "length", "act_embed")
        start, mask = cache.index, AttentionMask(dense=visible)
        for stack, (_, first, _) in zip(self.stacks, self.config.runs()):
            x, cache = stack.scan_with_cache(
                x, dataclasses.replace(cache, index=start), mask, positions, first_layer=first
            )
        return self.head(self.norm(x)), cache
