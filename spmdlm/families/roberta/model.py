"""RoBERTa: a post-LayerNorm bidirectional encoder with learned positions and a masked-LM head.

Mirrors transformers' `RobertaForMaskedLM` (no pooler); `hf.py` beside it holds the rename table.
Positions follow RoBERTa: real tokens count from `pad_token_id + 1` (so max_position_embeddings = length + 2) and
padding tokens take position `pad_token_id`. The MLM head is dense -> GELU -> LayerNorm -> the word embeddings
(tied) plus its own bias. Layers are stacked and scanned (`layer.layers`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import make_attention_mask, segment_positions
from spmdlm.models.blocks import PostNormBlock, PostNormSpec
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.layers import ACTIVATIONS, Bias, Dense, Embed, LayerNorm, dropout, make_param
from spmdlm.models.stack import LayerStack


@dataclasses.dataclass(frozen=True)
class RobertaConfig(HFConfig):
    model_type: ClassVar[str] = "roberta"
    architecture: ClassVar[str] = "RobertaForMaskedLM"

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512  # transformers' defaults, as a config.json without them means (presets: 514, 1)
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
        if not self.tie_word_embeddings:
            raise ValueError("RoBERTa with an untied MLM decoder is not supported; set tie_word_embeddings to true")
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                f"max_position_embeddings {self.max_position_embeddings} leaves no positions after "
                f"the padding offset {self.pad_token_id + 1}"
            )

    @property
    def max_length(self) -> int:
        """Longest sequence the positions cover (514 positions -> 512 tokens)."""
        return self.max_position_embeddings - self.pad_token_id - 1


def position_ids(input_ids: jax.Array, pad_token_id: int) -> jax.Array:
    """RoBERTa's positions: pad_token_id + 1 + the count of real tokens so far; padding gets pad_token_id."""
    real = (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + pad_token_id


def packed_position_ids(segment_ids: jax.Array, positions: jax.Array, pad_token_id: int) -> jax.Array:
    """The same for packed rows: counted from each segment's first token; padding (segment 0) gets pad_token_id."""
    return jnp.where(segment_ids > 0, positions + pad_token_id + 1, pad_token_id)


class RobertaForMaskedLM(nnx.Module):
    """`model(input_ids, attention_mask=None, token_type_ids=None, rngs=None) -> logits [B, T, V]`; dropout only
    when rngs are given. Masks are 1 for real tokens, 0 for padding. Packed rows (training) also pass
    `segment_ids` [B, T] (0 = padding) and optionally `positions` within each segment: attention stays within a
    segment and the positions restart in each, as if each segment were a row of its own."""

    config_class = RobertaConfig

    def __init__(
        self,
        config: RobertaConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        remat: str = "dots",
        scan_unroll: int | bool = 1,
    ):
        self.config = config
        d, std, eps = config.hidden_size, config.initializer_range, config.layer_norm_eps
        embed = lambda n, axes=("vocab", None): Embed(n, d, init_std=std, dtype=dtype, axes=axes, rngs=rngs)
        self.word_embeddings = embed(config.vocab_size)
        self.position_embeddings = embed(config.max_position_embeddings, ("positions", "embed"))
        self.token_type_embeddings = embed(config.type_vocab_size, (None, "embed"))
        self.embeddings_layer_norm = LayerNorm(d, eps=eps, rngs=rngs)
        self.layer = LayerStack(
            lambda r: PostNormBlock(
                PostNormSpec(
                    d,
                    config.num_attention_heads,
                    config.intermediate_size,
                    activation=config.hidden_act,
                    eps=eps,
                    dropout_rate=config.hidden_dropout_prob,
                    attention_dropout=config.attention_probs_dropout_prob,
                    activation_dropout=0.0,
                    init_std=std,
                ),
                cross_attention=False,
                dtype=dtype,
                rngs=r,
            ),
            config.num_hidden_layers,
            rngs=rngs,
            remat=remat,
            unroll=scan_unroll,
        )
        self.lm_head_dense = Dense(d, d, ("embed", "mlp"), init_std=std, dtype=dtype, rngs=rngs)
        self.lm_head_layer_norm = LayerNorm(d, eps=eps, rngs=rngs)
        self.lm_head_bias = make_param(
            nnx.initializers.zeros, rngs.params(), (config.vocab_size,), ("vocab",), kind=Bias
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        config = self.config
        if input_ids.shape[1] > config.max_length:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the {config.max_length} positions of "
                f"max_position_embeddings {config.max_position_embeddings}"
            )
        types = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        if segment_ids is None:
            position = position_ids(input_ids, config.pad_token_id)
        else:
            positions = segment_positions(segment_ids) if positions is None else positions
            position = packed_position_ids(segment_ids, positions, config.pad_token_id)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position) + self.token_type_embeddings(types)
        x = dropout(
            self.embeddings_layer_norm(constrain(x, "batch", "length", "act_embed")), config.hidden_dropout_prob, rngs
        )
        mask = make_attention_mask(attention_mask, q_segments=segment_ids, kv_segments=segment_ids)
        x = self.layer(x, mask, rngs=rngs)
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The encoder's final features [..., d] -> logits [..., V] (the MLM head, tied to the word embedding)."""
        h = self.lm_head_layer_norm(ACTIVATIONS["gelu"](self.lm_head_dense(x)))
        logits = self.word_embeddings.attend(h) + self.lm_head_bias[...]
        return constrain(logits, "batch", "length", "act_vocab")
