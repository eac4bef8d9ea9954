"""The layers all four models share: dense, embedding, norms, attention, MLP, dropout, and the scanned layer stack.

Parameters are float32 and carry a PartitionSpec resolved from logical axis names through `mesh.LOGICAL_RULES`
when they are created under a mesh (`jax.set_mesh`), so they are born sharded; without a mesh they are plain arrays.
Matmuls run in the compute `dtype` (bfloat16 on accelerators); norms and softmax run in float32.

Generation (spmdlm.generate) runs the same layers with a `Cache` of keys and values: see `Cache` and
`LayerStack.scan_with_cache`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmdlm.flops import SUM_AS_MATMUL
from spmdlm.mesh import constrain, gathered_for_use, resolve_spec
from spmdlm.models.attention import IMPLEMENTATIONS, AttentionMask, fused, resolve


def einsum_float32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)` of two same-dtype operands, accumulated and returned in float32 (logits and attention
    scores, so softmaxes see no bfloat16-rounded values).

    From lower-precision operands the backward pass stays in their precision: JAX's own transpose would multiply the
    float32 cotangent by a bfloat16 operand, which XLA runs as a float32 GEMM (GPT-2 124M on an H200: the tied LM
    head's weight gradient alone took 41 ms of a 230 ms step; benchmarks/README.md, GPU section)."""
    if a.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _einsum_low_precision_backward(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_low_precision_backward(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_forward(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32), (a, b)


def _einsum_cotangents(spec, operands, cotangent):
    a, b = operands
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return vjp(cotangent.astype(a.dtype))


_einsum_low_precision_backward.defvjp(_einsum_forward, _einsum_cotangents)


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


def add_broadcast(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y, `y` broadcast over some of x's axes (T5's [1, heads, T, S] position bias over the batch), with the
    gradient of y summed by a matrix-vector product with ones instead of a reduction: XLA:CPU (jaxlib 0.10) sums
    the leading axis of [4, 12, 128, 128] in 4.2 ms, the product takes 0.2 (once per layer; +2.5% at T5 base). The
    same sum, in float32. Not used for token-wise biases, where it did not pay (benchmarks/README.md, item 8)."""
    return _add_broadcast(x, y.reshape((1,) * (x.ndim - y.ndim) + y.shape))


@jax.custom_vjp
def _add_broadcast(x, y):
    return x + y


def _add_broadcast_fwd(x, y):
    return x + y, y


def _add_broadcast_bwd(y, g):
    summed = tuple(axis for axis, (n, m) in enumerate(zip(g.shape, y.shape)) if m == 1 and n != 1)
    if not summed:
        return g, g.astype(y.dtype)
    kept = tuple(axis for axis in range(g.ndim) if axis not in summed)
    rows = jnp.transpose(g, summed + kept).reshape(math.prod(g.shape[a] for a in summed), -1)
    with jax.named_scope(SUM_AS_MATMUL):  # a reduction, not a model FLOP (flops.jaxpr_matmul_flops)
        total = jnp.dot(jnp.ones(rows.shape[0], g.dtype), rows, preferred_element_type=jnp.float32)
    return g, total.reshape(y.shape).astype(y.dtype)


_add_broadcast.defvjp(_add_broadcast_fwd, _add_broadcast_bwd)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias). `out_features` may be a tuple to keep structure (e.g. GPT-2's fused 3×heads).
    `saved_as`: the name (checkpoint_name) of x @ kernel that the remat policies keep or drop (REMAT_POLICIES)."""

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
        saved_as: str | None = None,
    ):
        self.saved_as = saved_as
        out_shape = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.dtype = dtype
        self.out_dtype = out_dtype  # e.g. float32 logits from a bfloat16 matmul (accumulated in float32)
        self.kernel = make_param(nnx.initializers.normal(init_std), rngs.params(), (in_features, *out_shape), axes)
        self.bias = (
            make_param(nnx.initializers.zeros, rngs.params(), out_shape, axes[1:], kind=Bias) if use_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        if self.out_dtype == jnp.float32 and kernel.ndim == 2:
            y = einsum_float32("...d,dk->...k", x.astype(self.dtype), kernel)
        else:
            y = jax.lax.dot_general(
                x.astype(self.dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=self.out_dtype
            )
        if self.saved_as:
            y = checkpoint_name(y, self.saved_as)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """Token or position table; `attend` reuses it as a tied output projection."""

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        rngs: nnx.Rngs,
        init_std=0.02,
        dtype=jnp.float32,
        axes: tuple[str, str | None] = ("vocab", None),
    ):
        # Shard the vocab dim, not the hidden one: a hidden-sharded table is fully rematerialised by the gather.
        self.dtype, self.axes = dtype, axes
        self.embedding = make_param(nnx.initializers.normal(init_std), rngs.params(), (num_embeddings, features), axes)

    def table(self) -> jax.Array:
        """The table with its fsdp shards gathered (mesh.gathered_for_use): the lookup's output then follows the ids'
        batch layout, and a vocab split over `tensor` becomes a masked lookup summed over `tensor`."""
        return gathered_for_use(self.embedding[...], *self.axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table(), ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return einsum_float32("...d,vd->...v", x.astype(self.dtype), self.table().astype(self.dtype))


class LayerNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float = 1e-5, use_bias: bool = True, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(nnx.initializers.ones, rngs.params(), (features,), ("norm",), kind=Scale)
        self.bias = (
            make_param(nnx.initializers.zeros, rngs.params(), (features,), ("norm",), kind=Bias) if use_bias else None
        )

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

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str,
        gated: bool = False,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.activation = activation
        self.dropout_rate = dropout_rate
        dense_in = lambda: Dense(
            d_model,
            d_ff,
            ("embed", "mlp"),
            rngs=rngs,
            use_bias=use_bias,
            init_std=init_std,
            dtype=dtype,
            saved_as="mlp_hidden",
        )
        self.wi = None if gated else dense_in()
        self.wi_0 = dense_in() if gated else None
        self.wi_1 = dense_in() if gated else None
        self.wo = Dense(
            d_ff,
            d_model,
            ("mlp", "embed"),
            rngs=rngs,
            use_bias=use_bias,
            init_std=init_std if out_init_std is None else out_init_std,
            dtype=dtype,
            saved_as="mlp_out",
        )

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        h = act(self.wi_0(x)) * self.wi_1(x) if self.wi is None else act(self.wi(x))
        h = dropout(h, self.dropout_rate, rngs)  # T5's dropout_rate, BART's activation_dropout; 0 for GPT-2
        return self.wo(h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """A decoder stack's state during generation, preallocated for the whole generation so that every decode step
    has the same shapes (one compilation).

    Slots are the positions of the cache: every row writes its next token to the same slot `index`; rows differ only
    in which slots hold real tokens (`valid`: a left-padded prompt's padding never does). Per-layer arrays are
    stacked on a leading layers axis. `LayerStack.scan_with_cache` carries the whole cache through the layer scan
    with `layer` set to the running layer, whose attention writes its new keys and values into it (updating this
    record while it is traced) and reads its own slice. Heads come before slots: the layout attention's matmuls
    read without a transpose.
    """

    key: jax.Array  # [layers, batch, heads, slots, head_dim]: self-attention keys of the tokens so far
    value: jax.Array
    valid: jax.Array  # [batch, slots] bool: the slot holds a real token
    index: jax.Array  # int32 scalar: the next token's slot
    cross_key: jax.Array | None = None  # [layers, batch, heads, source, head_dim]: the encoder output's, projected once
    cross_value: jax.Array | None = None
    cross_valid: jax.Array | None = None  # [batch, source] bool: the encoder input's non-padding tokens
    layer: jax.Array | None = None  # inside the layer scan: the index of the layer being run

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        slots: int,
        heads: int,
        head_dim: int,
        dtype,
        cross: tuple[jax.Array, jax.Array] | None = None,
        cross_valid: jax.Array | None = None,
    ) -> Cache:
        """`cross`: the stacked cross-attention keys and values [layers, batch, source, heads, head_dim]."""
        shape = (layers, batch, heads, slots, head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), "layers", "batch", "act_heads", "length", None)
        cross_key, cross_value = (jnp.swapaxes(a, 2, 3) for a in cross) if cross else (None, None)
        return cls(
            zeros(),
            zeros(),
            jnp.zeros((batch, slots), bool),
            jnp.zeros((), jnp.int32),
            cross_key,
            cross_value,
            None if cross_valid is None else cross_valid.astype(bool),
        )

    def advance(self, length: int, attention_mask: jax.Array | None = None):
        """For the next `length` tokens, about to go to slots index..index+length-1 (`attention_mask` [B, length]:
        0 marks padding): their positions [B, length], the attention mask ([B, 1, length, slots]: each sees the real
        tokens up to itself), and the cache with their slots marked valid.

        A position counts the row's real tokens before it, so left padding shifts nothing (transformers' generate
        derives position_ids from the attention mask the same way; padding gets position 0).
        """
        real = jnp.ones((self.valid.shape[0], length), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = self.valid.sum(-1, keepdims=True) + jnp.cumsum(real, axis=1) - 1
        valid = jax.lax.dynamic_update_slice_in_dim(self.valid, real, self.index, axis=1)
        slots = jnp.arange(valid.shape[1])
        causal = slots[None, :] <= self.index + jnp.arange(length)[:, None]
        mask = AttentionMask(dense=valid[:, None, None, :] & causal[None, None])
        return jnp.maximum(positions, 0), mask, dataclasses.replace(self, valid=valid)

    def write(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The running layer's new keys and values [B, T, heads, head_dim] go to slots index..; returns all its
        slots' [B, heads, slots, head_dim]."""

        def put(stacked, new):
            new = jnp.swapaxes(new, 1, 2)[None].astype(stacked.dtype)
            return jax.lax.dynamic_update_slice(stacked, new, (self.layer, 0, 0, self.index, 0))

        self.key, self.value = put(self.key, key), put(self.value, value)
        return self.key[self.layer], self.value[self.layer]


class Attention(nnx.Module):
    """Multi-head attention (self or cross). Separate q/k/v/o projections, or GPT-2's fused qkv kernel.

    `scale=None` divides scores by sqrt(head_dim); T5 passes scale=1.0 (its init absorbs the scaling).
    `cross` marks a decoder's attention over the encoder output, whose keys and values generation projects once;
    `biased` an attention that is given an additive bias (T5's relative positions), which not every kernel takes.
    """

    implementation = "xla"  # attention.IMPLEMENTATIONS; set per model by set_attention

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        use_bias: bool = True,
        fused_qkv: bool = False,
        scale: float | None = None,
        dropout_rate: float = 0.0,
        init_std: float = 0.02,
        q_init_std: float | None = None,
        kv_init_std: float | None = None,
        out_init_std: float | None = None,
        cross: bool = False,
        biased: bool = False,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.cross, self.biased = cross, biased
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        self.dropout_rate = dropout_rate
        inner = num_heads * head_dim
        std = lambda s: init_std if s is None else s
        if fused_qkv:
            self.qkv = Dense(
                d_model,
                (3, inner),
                ("embed", "qkv", "heads"),
                rngs=rngs,
                use_bias=use_bias,
                init_std=init_std,
                dtype=dtype,
                saved_as="qkv",
            )
            self.query = self.key = self.value = None
        else:
            self.qkv = None
            proj = lambda s, name: Dense(
                d_model, inner, ("embed", "heads"), rngs=rngs, use_bias=use_bias, init_std=s, dtype=dtype, saved_as=name
            )
            self.query = proj(std(q_init_std), "query")
            self.key, self.value = proj(std(kv_init_std), "key"), proj(std(kv_init_std), "value")
        self.out = Dense(
            inner,
            d_model,
            ("heads", "embed"),
            rngs=rngs,
            use_bias=use_bias,
            init_std=std(out_init_std),
            dtype=dtype,
            saved_as="attention_out",
        )

    def heads(self, t: jax.Array) -> jax.Array:
        """[..., heads * head_dim] -> [..., heads, head_dim], heads sharded over `tensor`."""
        return constrain(t.reshape(*t.shape[:-1], self.num_heads, self.head_dim), "batch", "length", "act_heads", None)

    def keys_values(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.heads(self.key(context)), self.heads(self.value(context))

    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: AttentionMask | None = None,
        bias: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        cache: Cache | None = None,
    ) -> jax.Array:
        """With a `cache` (generation), self-attention adds x's keys and values to it and attends over all its
        slots; cross-attention reads the keys and values projected once from the encoder output, not `context`."""
        layout = "bshd" if cache is None else "bhsd"  # keys and values: [B, S, heads, head_dim], or as cached
        if cache is not None and self.cross:
            q, k, v = self.heads(self.query(x)), cache.cross_key, cache.cross_value
        else:
            if self.qkv is not None:
                q, k, v = (self.heads(t) for t in jnp.moveaxis(self.qkv(x), -2, 0))
            else:
                q, (k, v) = self.heads(self.query(x)), self.keys_values(x if context is None else context)
            if cache is not None:
                k, v = cache.write(k, v)
        dropping = rngs is not None and self.dropout_rate > 0.0  # no kernel has attention dropout
        out = None
        if self.implementation != "xla" and cache is None and not dropping:
            out = fused(self.implementation, q, k, v, mask, bias, self.scale)
        if out is None:
            out = self._einsums(q, k, v, mask, bias, rngs, layout)
        return self.out(out.reshape(*out.shape[:-2], self.num_heads * self.head_dim))

    def _einsums(self, q, k, v, mask, bias, rngs, layout):
        scores = einsum_float32(f"bthd,{layout}->bhts", q, k) * self.scale
        if bias is not None:
            scores = add_broadcast(scores, bias.astype(jnp.float32))
        dense = None if mask is None else mask.array(*scores.shape[-2:])
        if dense is not None:
            scores = jnp.where(dense, scores, jnp.finfo(jnp.float32).min)
        probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q.dtype), "attention_weights")
        probs = dropout(probs, self.dropout_rate, rngs)
        return jnp.einsum(f"bhts,{layout}->bthd", probs, v)


def set_attention(model: nnx.Module, implementation: str) -> nnx.Module:
    """Compute every attention layer of `model` with `implementation` (attention.IMPLEMENTATIONS): part of the
    model's graph, so it holds for training, evaluation and generation alike."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention {implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Attention):
            module.implementation = implementation
    return model


def resolve_attention(
    model: nnx.Module, requested: str, *, platform: str, dtype, training: bool, device_kind: str = ""
) -> tuple[str, str | None]:
    """attention.resolve for `model` (an abstract one will do): weighs its largest attention dropout and whether some
    attention takes a bias."""
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, Attention)]
    return resolve(
        requested,
        platform=platform,
        dtype=dtype,
        training=training,
        device_kind=device_kind,
        dropout=max((m.dropout_rate for m in layers), default=0.0),
        biased=any(m.biased for m in layers),
    )


class PostNormBlock(nnx.Module):
    """A post-LayerNorm transformer layer (BERT/RoBERTa, BART encoder and decoder): each sublayer's output is
    dropped out, added to its input, then normalised. Exact-GELU MLP by default; cross-attention for decoders.

    Names follow BART (`self_attn`, `self_attn_layer_norm`, `encoder_attn`, `final_layer_norm`); the families'
    rename tables map RoBERTa's names onto them.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        activation: str,
        eps: float,
        dropout_rate: float,
        attention_dropout: float,
        activation_dropout: float,
        cross_attention: bool,
        init_std: float,
        dtype,
        rngs: nnx.Rngs,
    ):
        attention = lambda cross=False: Attention(
            d_model,
            num_heads,
            d_model // num_heads,
            cross=cross,
            dropout_rate=attention_dropout,
            init_std=init_std,
            dtype=dtype,
            rngs=rngs,
        )
        norm = lambda: LayerNorm(d_model, eps=eps, rngs=rngs)
        self.self_attn, self.self_attn_layer_norm = attention(), norm()
        self.encoder_attn = attention(cross=True) if cross_attention else None
        self.encoder_attn_layer_norm = norm() if cross_attention else None
        self.mlp = MLP(
            d_model,
            d_ff,
            activation=activation,
            dropout_rate=activation_dropout,
            init_std=init_std,
            dtype=dtype,
            rngs=rngs,
        )
        self.final_layer_norm = norm()
        self.dropout_rate = dropout_rate

    def __call__(self, x, mask, context=None, context_mask=None, *, rngs=None, cache=None):
        rate = self.dropout_rate
        x = self.self_attn_layer_norm(x + dropout(self.self_attn(x, mask=mask, rngs=rngs, cache=cache), rate, rngs))
        if self.encoder_attn is not None:
            h = self.encoder_attn(x, context, mask=context_mask, rngs=rngs, cache=cache)
            x = self.encoder_attn_layer_norm(x + dropout(h, rate, rngs))
        x = self.final_layer_norm(x + dropout(self.mlp(x, rngs), rate, rngs))
        return constrain(x, "batch", "length", "act_embed")
