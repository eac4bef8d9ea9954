"""The transformer layer more than one model is built of: `PostNormBlock` (RoBERTa, BART's encoder and decoder)."""

from __future__ import annotations

import dataclasses

from flax import nnx

from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, AttentionSpec
from spmdlm.models.layers import MLP, LayerNorm, dropout


@dataclasses.dataclass(frozen=True)
class PostNormSpec:
    """A post-norm layer's sizes and rates (the same for every layer of a stack)."""

    d_model: int
    num_heads: int
    d_ff: int
    activation: str
    eps: float
    dropout_rate: float
    attention_dropout: float
    activation_dropout: float
    init_std: float


class PostNormBlock(nnx.Module):
    """A post-LayerNorm transformer layer (BERT/RoBERTa, BART encoder and decoder): each sublayer's output is
    dropped out, added to its input, then normalised. Exact-GELU MLP by default; cross-attention for decoders.

    Names follow BART (`self_attn`, `self_attn_layer_norm`, `encoder_attn`, `final_layer_norm`); the families'
    rename tables map RoBERTa's names onto them.
    """

    def __init__(self, spec: PostNormSpec, *, cross_attention: bool, dtype, rngs: nnx.Rngs):
        d_model = spec.d_model
        attention = lambda cross=False: Attention(
            d_model,
            spec.num_heads,
            d_model // spec.num_heads,
            AttentionSpec(cross=cross),
            dropout_rate=spec.attention_dropout,
            init_std=spec.init_std,
            dtype=dtype,
            rngs=rngs,
        )
        norm = lambda: LayerNorm(d_model, eps=spec.eps, rngs=rngs)
        self.self_attn, self.self_attn_layer_norm = attention(), norm()
        self.encoder_attn = attention(cross=True) if cross_attention else None
        self.encoder_attn_layer_norm = norm() if cross_attention else None
        self.mlp = MLP(
            d_model,
            spec.d_ff,
            activation=spec.activation,
            dropout_rate=spec.activation_dropout,
            init_std=spec.init_std,
            dtype=dtype,
            rngs=rngs,
        )
        self.final_layer_norm = norm()
        self.dropout_rate = spec.dropout_rate

    def __call__(self, x, mask, context=None, context_mask=None, *, rngs=None, cache=None):
        rate = self.dropout_rate
        x = self.self_attn_layer_norm(x + dropout(self.self_attn(x, mask=mask, rngs=rngs, cache=cache), rate, rngs))
        if self.encoder_attn is not None:
            h = self.encoder_attn(x, context, mask=context_mask, rngs=rngs, cache=cache)
            x = self.encoder_attn_layer_norm(x + dropout(h, rate, rngs))
        x = self.final_layer_norm(x + dropout(self.mlp(x, rngs), rate, rngs))
        return constrain(x, "batch", "length", "act_embed")
