"""The layers all four models share: dense, embedding, norms, attention, MLP, dropout, and the scanned layer stack.

Parameters are float32 and carry a PartitionSpec resolved from logical axis names through `mesh.LOGICAL_RULES`
when they are created under a mesh (`jax.set_mesh`), so they are born sharded; without a mesh they are plain arrays.
Matmuls run in the compute `dtype` (bfloat16 on accelerators); norms and softmax run in float32.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.mesh import constrain, resolve_spec


class Bias(nnx.Param):
    """An additive bias: no weight decay."""


class Scale(nnx.Param):
    """A norm's gain: no weight decay."""


def make_param(
    init: Callable, key: jax.Array, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], kind=nnx.Param
) -> nnx.Param:
    """A float32 parameter sharded by its logical axes when a mesh is set (eagerly, so no replicated copy exists)."""
    mesh = jax.sharding.get_abstract_mesh()
    value = init(key, shape, jnp.float32)
    if mesh.empty:
        return kind(value, logical_axes=logical_axes)
    spec = resolve_spec(shape, logical_axes, dict(mesh.shape), fill_fsdp=True)
    return kind(value, out_sharding=spec, logical_axes=logical_axes)


def dropout(x: jax.Array, rate: float, rngs: nnx.Rngs | None) -> jax.Array:
    """Inverted dropout; off when no rngs are given (eval mode) or the rate is 0."""
    if rngs is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rngs.dropout(), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


class Dense(nnx.Module):
    """y = x @ kernel (+ bias). `out_features` may be a tuple to keep structure (e.g. GPT-2's fused 3×heads)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | tuple[int, ...],
        axes: tuple[str | None, ...],
        *,
        rngs: nnx.Rngs,
        use_bias: bool = True,
        init_std: float = 0.02,
        dtype=jnp.float32,
        out_dtype=None,
    ):
        out_shape = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.dtype = dtype
        self.out_dtype = out_dtype  # e.g. float32 logits from a bfloat16 matmul (accumulated in float32)
        self.kernel = make_param(
            nnx.initializers.normal(init_std), rngs.params(), (in_features, *out_shape), axes
        )
        self.bias = (
            make_param(nnx.initializers.zeros, rngs.params(), out_shape, axes[1:], kind=Bias) if use_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=self.out_dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """Token or position table; `attend` reuses it as a tied output projection."""

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs, init_std=0.02, dtype=jnp.float32,
                 axes: tuple[str, str | None] = ("vocab", None)):
        # Shard the vocab dim, not the hidden one: a hidden-sharded table is fully rematerialised by the gather.
        self.dtype = dtype
        self.embedding = make_param(nnx.initializers.normal(init_std), rngs.params(), (num_embeddings, features), axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        # float32 logits even from bfloat16 inputs: the loss's log-softmax should not see bf16-rounded logits
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.embedding[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)


class LayerNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float = 1e-5, use_bias: bool = True, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(nnx.initializers.ones, rngs.params(), (features,), ("norm",), kind=Scale)
        self.bias = make_param(nnx.initializers.zeros, rngs.params(), (features,), ("norm",), kind=Bias) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...]
        if self.bias is not None:
            h = h + self.bias[...]
        return h.astype(x.dtype)


class RMSNorm(nnx.Module):
    """T5's LayerNorm: scale only, no mean subtraction, variance in float32."""

    def __init__(self, features: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(nnx.initializers.ones, rngs.params(), (features,), ("norm",), kind=Scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps) * self.scale[...]
        return h.astype(x.dtype)


class MLP(nnx.Module):
    """Feed-forward block: wo(act(wi(x))), or the gated form wo(act(wi_0(x)) * wi_1(x)) of T5 v1.1.

    `dropout_rate` acts on the hidden activations (before wo); residual dropout is the caller's.
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str, gated: bool = False, use_bias: bool = True,
                 dropout_rate: float = 0.0, init_std: float = 0.02, out_init_std: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.activation = activation
        self.dropout_rate = dropout_rate
        dense_in = lambda: Dense(d_model, d_ff, ("embed", "mlp"), rngs=rngs, use_bias=use_bias, init_std=init_std, dtype=dtype)
        self.wi = None if gated else dense_in()
        self.wi_0 = dense_in() if gated else None
        self.wi_1 = dense_in() if gated else None
        self.wo = Dense(d_ff, d_model, ("mlp", "embed"), rngs=rngs, use_bias=use_bias,
                        init_std=init_std if out_init_std is None else out_init_std, dtype=dtype)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        h = act(self.wi_0(x)) * self.wi_1(x) if self.wi is None else act(self.wi(x))
        h = dropout(h, self.dropout_rate, rngs)  # T5's dropout_rate, BART's activation_dropout; 0 for GPT-2
        return self.wo(h)


def make_attention_mask(key_valid: jax.Array | None, causal_length: int | None = None):
    """Boolean [B|1, 1, T, S] mask (True = may attend) from the keys' validity and/or causality; None = no mask.

    Padded queries are not masked: their outputs are never read (transformers does the same).
    """
    mask = None
    if key_valid is not None:
        mask = key_valid[:, None, None, :].astype(bool)
    if causal_length is not None:
        causal = jnp.tril(jnp.ones((causal_length, causal_length), dtype=bool))[None, None]
        mask = causal if mask is None else mask & causal
    return mask


class Attention(nnx.Module):
    """Multi-head attention (self or cross). Separate q/k/v/o projections, or GPT-2's fused qkv kernel.

    `scale=None` divides scores by sqrt(head_dim); T5 passes scale=1.0 (its init absorbs the scaling).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, use_bias: bool = True, fused_qkv: bool = False,
                 scale: float | None = None, dropout_rate: float = 0.0, init_std: float = 0.02,
                 q_init_std: float | None = None, kv_init_std: float | None = None, out_init_std: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        self.dropout_rate = dropout_rate
        inner = num_heads * head_dim
        std = lambda s: init_std if s is None else s
        if fused_qkv:
            self.qkv = Dense(d_model, (3, inner), ("embed", "qkv", "heads"), rngs=rngs, use_bias=use_bias,
                             init_std=init_std, dtype=dtype)
            self.query = self.key = self.value = None
        else:
            self.qkv = None
            proj = lambda s: Dense(d_model, inner, ("embed", "heads"), rngs=rngs, use_bias=use_bias, init_std=s, dtype=dtype)
            self.query, self.key, self.value = proj(std(q_init_std)), proj(std(kv_init_std)), proj(std(kv_init_std))
        self.out = Dense(inner, d_model, ("heads", "embed"), rngs=rngs, use_bias=use_bias, init_std=std(out_init_std),
                         dtype=dtype)

    def __call__(self, x: jax.Array, context: jax.Array | None = None, *, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, rngs: nnx.Rngs | None = None) -> jax.Array:
        split = lambda t: t.reshape(*t.shape[:-1], self.num_heads, self.head_dim)
        if self.qkv is not None:
            q, k, v = (split(t) for t in jnp.moveaxis(self.qkv(x), -2, 0))
        else:
            context = x if context is None else context
            q, k, v = split(self.query(x)), split(self.key(context)), split(self.value(context))
        q, k, v = (constrain(t, "batch", "length", "act_heads", None) for t in (q, k, v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * self.scale
        if bias is not None:
            scores = scores + bias.astype(jnp.float32)
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        probs = dropout(probs, self.dropout_rate, rngs)
        out = jnp.einsum("bhts,bshd->bthd", probs, v)
        return self.out(out.reshape(*out.shape[:-2], self.num_heads * self.head_dim))


class LayerStack(nnx.Module):
    """`count` identical layers with stacked parameters (leading `layers` axis), applied with one scan.

    One traced layer instead of `count`: compile time stays nearly flat with depth. `make_layer(rngs)` builds one
    layer; every call of the stack passes `x` through the layers as the scan carry, with the other arguments the
    same for each layer. Under `remat` each layer keeps only its input for the backward pass. Dropout gets one key
    per layer. `unroll` is jax.lax.scan's (True = fully unrolled, same parameters; for benchmarks).
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, *, rngs: nnx.Rngs,
                 remat: bool = False, unroll: int | bool = 1):
        self.count, self.remat, self.unroll = count, remat, unroll

        # The layers axis is never sharded (PARTITION_NAME None); the logical name is added for the rule table.
        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create(rngs):
            return make_layer(rngs)

        self.layers = create(rngs)
        for _, var in nnx.iter_graph(self.layers):
            if isinstance(var, nnx.Param):
                var.set_metadata(logical_axes=("layers", *var.get_metadata()["logical_axes"]))

    def __call__(self, x: jax.Array, *args, rngs: nnx.Rngs | None = None) -> jax.Array:
        keys = None if rngs is None else jax.random.split(rngs.dropout(), self.count)

        def apply(layer, x, key):
            return layer(x, *args, rngs=None if key is None else nnx.Rngs(dropout=key))

        if self.remat:
            apply = nnx.remat(apply)

        @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry, unroll=self.unroll)
        def body(layer, x, key):
            return apply(layer, x, key)

        return body(self.layers, x, keys)


class PostNormBlock(nnx.Module):
    """A post-LayerNorm transformer layer (BERT/RoBERTa, BART encoder and decoder): each sublayer's output is
    dropped out, added to its input, then normalised. Exact-GELU MLP by default; cross-attention for decoders.

    Names follow BART (`self_attn`, `self_attn_layer_norm`, `encoder_attn`, `final_layer_norm`); the families'
    rename tables map RoBERTa's names onto them.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, activation: str, eps: float, dropout_rate: float,
                 attention_dropout: float, activation_dropout: float, cross_attention: bool, init_std: float,
                 dtype, rngs: nnx.Rngs):
        attention = lambda: Attention(d_model, num_heads, d_model // num_heads, dropout_rate=attention_dropout,
                                      init_std=init_std, dtype=dtype, rngs=rngs)
        norm = lambda: LayerNorm(d_model, eps=eps, rngs=rngs)
        self.self_attn, self.self_attn_layer_norm = attention(), norm()
        self.encoder_attn = attention() if cross_attention else None
        self.encoder_attn_layer_norm = norm() if cross_attention else None
        self.mlp = MLP(d_model, d_ff, activation=activation, dropout_rate=activation_dropout, init_std=init_std,
                       dtype=dtype, rngs=rngs)
        self.final_layer_norm = norm()
        self.dropout_rate = dropout_rate

    def __call__(self, x, mask, context=None, context_mask=None, *, rngs=None):
        rate = self.dropout_rate
        x = self.self_attn_layer_norm(x + dropout(self.self_attn(x, mask=mask, rngs=rngs), rate, rngs))
        if self.encoder_attn is not None:
            h = self.encoder_attn(x, context, mask=context_mask, rngs=rngs)
            x = self.encoder_attn_layer_norm(x + dropout(h, rate, rngs))
        x = self.final_layer_norm(x + dropout(self.mlp(x, rngs), rate, rngs))
        return constrain(x, "batch", "length", "act_embed")
