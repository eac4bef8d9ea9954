"""ModernBERT: a pre-LayerNorm bidirectional encoder with RoPE, GeGLU and alternating local/global attention, and its
masked-LM head; transformers' `ModernBertForMaskedLM`.

Every `global_attn_every_n_layers`-th layer (from layer 0) attends globally with RoPE base `global_rope_theta`; the
others attend within a sliding window of `local_attention` tokens (`local_attention // 2` on each side, as
transformers' masks) with base `local_rope_theta`. Layer 0 has no attention norm (the embeddings' norm precedes it).
The MLP's `Wi` is one projection whose two halves are the input and the gate: act(input) * gate.

transformers unpads a batch into one row of documents for its flash kernel; our unpadding is packing (segment ids,
docs/packing.md): positions and the sliding window restart in each document, and attention stays within it.

Layers whose window differs cannot share one scan step, so the layers after the first are scanned in periods: a
period is `global_attn_every_n_layers - 1` sliding-window layers and then a global one (`layers`, stacked), and the
layers left over after the last whole period, all sliding-window ones, are a stack of their own (`tail`). For the
released shapes (22 layers, a global one every 3) that is layer 0 and 7 periods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, AttentionSpec, make_attention_mask, segment_positions
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.layers import ACTIVATIONS, Bias, Dense, Embed, LayerNorm, dropout, make_param
from spmdlm.models.rope import Rope
from spmdlm.models.stack import LayerStack

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types


@dataclasses.dataclass(frozen=True)
class ModernBertConfig(HFConfig):
    model_type: ClassVar[str] = "modernbert"
    architecture: ClassVar[str] = "ModernBertForMaskedLM"

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int = 50283
    eos_token_id: int = 50282  # [SEP]; the config's sep_token_id is written equal to it
    bos_token_id: int = 50281  # [CLS]; likewise cls_token_id
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    local_attention: int = 128
    global_attn_every_n_layers: int = 3
    attention_bias: bool = False
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_bias: bool = False  # the MLM head's dense layer (transformers reuses the classifier's options there)
    classifier_activation: str = "gelu"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_activation", "classifier_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(
                    f"{name} {getattr(self, name)!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
                )
        if not self.tie_word_embeddings:
            raise ValueError("ModernBERT with an untied decoder is not supported; set tie_word_embeddings to true")
        if self.global_attn_every_n_layers < 1 or self.local_attention < 2:
            raise ValueError("global_attn_every_n_layers must be >= 1 and local_attention >= 2")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModernBertConfig:
        """Also reads transformers 5's forms: `layer_types` and `rope_parameters` by layer type."""
        values = dict(values)
        rope = values.get("rope_parameters") or {}
        for layer_type, name in ((FULL, "global_rope_theta"), (SLIDING, "local_rope_theta")):
            if isinstance(rope.get(layer_type), dict) and "rope_theta" in rope[layer_type]:
                values[name] = rope[layer_type]["rope_theta"]
        if values.get("layer_types"):
            values["global_attn_every_n_layers"] = every_n_layers(values["layer_types"])
        return super().from_dict(values)

    def to_hf_dict(self) -> dict[str, Any]:
        """Our fields, and the same in the forms transformers 5 writes (layer_types, rope_parameters)."""
        out = super().to_hf_dict()
        rope = lambda theta: {"rope_type": "default", "rope_theta": theta}
        return {
            **out,
            "cls_token_id": self.bos_token_id,
            "sep_token_id": self.eos_token_id,
            "layer_types": list(self.layer_types),
            "rope_parameters": {FULL: rope(self.global_rope_theta), SLIDING: rope(self.local_rope_theta)},
        }

    @property
    def layer_types(self) -> tuple[str, ...]:
        n = self.global_attn_every_n_layers
        return tuple(SLIDING if i % n else FULL for i in range(self.num_hidden_layers))

    @property
    def periods(self) -> tuple[int, int]:
        """(whole periods after layer 0, sliding-window layers left over after them)."""
        return divmod(self.num_hidden_layers - 1, self.global_attn_every_n_layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_length(self) -> int:
        return self.max_position_embeddings


def every_n_layers(layer_types: list[str]) -> int:
    """The n of transformers' `layer_types` when they are a global layer every n layers from layer 0 (the one
    pattern ModernBERT configs write); ValueError otherwise."""
    n = next((i for i, kind in enumerate(layer_types) if i and kind == FULL), len(layer_types))
    if list(layer_types) != [SLIDING if i % n else FULL for i in range(len(layer_types))]:
        raise ValueError(
            f"layer_types {layer_types} are not a full-attention layer every n layers from layer 0, the pattern "
            "of global_attn_every_n_layers (the only one supported)"
        )
    return n


class ModernBertMLP(nnx.Module):
    """Wo(act(input) * gate), where input and gate are the two halves of one projection `Wi` ([d, 2, ff] here,
    transformers' [2 ff, d] chunked in two)."""

    def __init__(self, config: ModernBertConfig, *, out_init_std: float, dtype, rngs: nnx.Rngs):
        d, ff, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        std = config.initializer_range
        self.activation, self.dropout_rate = config.hidden_activation, config.mlp_dropout
        self.Wi = Dense(
            d,
            (2, ff),
            ("embed", None, "mlp"),
            rngs=rngs,
            use_bias=bias,
            init_std=std,
            dtype=dtype,
            saved_as="mlp_hidden",
        )
        self.Wo = Dense(
            ff, d, ("mlp", "embed"), rngs=rngs, use_bias=bias, init_std=out_init_std, dtype=dtype, saved_as="mlp_out"
        )

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        h = self.Wi(x)
        h = ACTIVATIONS[self.activation](h[..., 0, :]) * h[..., 1, :]
        return self.Wo(dropout(h, self.dropout_rate, rngs))


class ModernBertLayer(nnx.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(x)); a sliding-window or a global layer, the first without
    `attn_norm`."""

    def __init__(self, config: ModernBertConfig, *, sliding: bool, first: bool = False, dtype, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.initializer_range
        out_std = std / (2.0 * config.num_hidden_layers) ** 0.5  # transformers' init of the residual projections
        norm = lambda: LayerNorm(d, eps=config.norm_eps, use_bias=config.norm_bias, rngs=rngs)
        theta = config.local_rope_theta if sliding else config.global_rope_theta
        half = config.local_attention // 2
        spec = AttentionSpec(
            use_bias=config.attention_bias,
            fused_qkv=True,
            out_init_std=out_std,
            rope=Rope(config.head_dim, float(theta)),
            window=(half, half) if sliding else None,
        )
        self.attn_norm = None if first else norm()
        self.attn = Attention(
            d,
            config.num_attention_heads,
            config.head_dim,
            spec,
            dropout_rate=config.attention_dropout,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlp_norm = norm()
        self.mlp = ModernBertMLP(config, out_init_std=out_std, dtype=dtype, rngs=rngs)
        self.dropout_rate = config.attention_dropout  # transformers drops the attention output at this rate too

    def __call__(self, x, mask, positions, *, rngs=None):
        h = x if self.attn_norm is None else self.attn_norm(x)
        x = x + dropout(self.attn(h, mask=mask, positions=positions, rngs=rngs), self.dropout_rate, rngs)
        x = x + self.mlp(self.mlp_norm(x), rngs)
        return constrain(x, "batch", "length", "act_embed")


class ModernBertPeriod(nnx.Module):
    """One scan step: `global_attn_every_n_layers - 1` sliding-window layers, then a global one."""

    def __init__(self, config: ModernBertConfig, *, dtype, rngs: nnx.Rngs):
        n = config.global_attn_every_n_layers
        make = lambda sliding: ModernBertLayer(config, sliding=sliding, dtype=dtype, rngs=rngs)
        self.sliding = nnx.List([make(True) for _ in range(n - 1)])
        self.full = make(False)

    def __call__(self, x, mask, positions, *, rngs=None):
        for layer in (*self.sliding, self.full):
            x = layer(x, mask, positions, rngs=rngs)
        return x


class ModernBertForMaskedLM(nnx.Module):
    """`model(input_ids, attention_mask=None, rngs=None) -> logits [B, T, V]`; dropout only when rngs are given.
    Packed rows also pass `segment_ids` [B, T] (0 = padding) and optionally `positions` within each segment."""

    config_class = ModernBertConfig

    def __init__(
        self,
        config: ModernBertConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        remat: str = "dots",
        scan_unroll: int | bool = 1,
    ):
        self.config = config
        d, std = config.hidden_size, config.initializer_range
        norm = lambda: LayerNorm(d, eps=config.norm_eps, use_bias=config.norm_bias, rngs=rngs)
        self.tok_embeddings = Embed(config.vocab_size, d, init_std=std, dtype=dtype, rngs=rngs)
        self.embeddings_norm = norm()
        self.first_layer = ModernBertLayer(config, sliding=False, first=True, dtype=dtype, rngs=rngs)
        periods, leftover = config.periods
        stack = lambda make, count: (
            LayerStack(make, count, rngs=rngs, remat=remat, unroll=scan_unroll) if count else None
        )
        self.layers = stack(lambda r: ModernBertPeriod(config, dtype=dtype, rngs=r), periods)
        self.tail = stack(lambda r: ModernBertLayer(config, sliding=True, dtype=dtype, rngs=r), leftover)
        self.final_norm = norm()
        out_std = std / (2.0 * config.num_hidden_layers) ** 0.5
        self.head_dense = Dense(
            d, d, ("embed", "mlp"), rngs=rngs, use_bias=config.classifier_bias, init_std=out_std, dtype=dtype
        )
        self.head_norm = norm()
        self.decoder_bias = (
            make_param(nnx.initializers.zeros, rngs.params(), (config.vocab_size,), ("vocab",), kind=Bias)
            if config.decoder_bias
            else None
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
        config = self.config
        if input_ids.shape[1] > config.max_length:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings {config.max_length}"
            )
        if positions is None:  # transformers counts every row from 0, padding included (RoPE sees only distances)
            index = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None]
            positions = index if segment_ids is None else segment_positions(segment_ids)
        x = self.embeddings_norm(constrain(self.tok_embeddings(input_ids), "batch", "length", "act_embed"))
        x = dropout(x, config.embedding_dropout, rngs)
        mask = make_attention_mask(attention_mask, q_segments=segment_ids, kv_segments=segment_ids)
        x = self.first_layer(x, mask, positions, rngs=rngs)
        for stack in (self.layers, self.tail):
            if stack is not None:
                x = stack(x, mask, positions, rngs=rngs)
        x = self.final_norm(x)
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The encoder's final features [..., d] -> logits [..., V]: dense, activation, norm, the tied decoder."""
        h = self.head_norm(ACTIVATIONS[self.config.classifier_activation](self.head_dense(x)))
        logits = self.tok_embeddings.attend(h)
        if self.decoder_bias is not None:
            logits = logits + self.decoder_bias[...]
        return constrain(logits, "batch", "length", "act_vocab")
