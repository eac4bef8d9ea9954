"""The layers the models share: dense, embedding, norms, MLP (plain or gated), dropout. Attention is
`attention.Attention` (RoPE `rope.Rope`), the transformer layer two models share `blocks.PostNormBlock`, the scanned
layer stack `stack.LayerStack`.

Parameters are float32 and carry a PartitionSpec resolved from logical axis names through `mesh.LOGICAL_RULES`
when they are created under a mesh (`jax.set_mesh`), so they are born sharded; without a mesh they are plain arrays.
Matmuls run in the compute `dtype` (bfloat16 on accelerators); norms and softmax run in float32.
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
from spmdlm.mesh import gathered_for_use, resolve_spec


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


@jax.custom_vjp
def project(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel over x's last axis ([..., in] @ [in, out]), as `jnp.dot`; only its weight gradient is formed
    differently: as (dy^T x)^T, an [out, in] product transposed, instead of JAX's x^T dy. The values are the same. XLA
    then transposes the incoming gradient dy inside the fusion that makes it (or the small [out, in] result inside the
    optimizer's update), where x^T made XLA:CPU copy every saved activation transposed before its GEMM: 8-31% faster
    CPU steps at the peers' base and tiny sizes (benchmarks/README.md, issue 44, item 7)."""
    return jnp.dot(x, kernel)


def _project_fwd(x, kernel):
    return jnp.dot(x, kernel), (x, kernel)


def _project_bwd(saved, dy):
    x, kernel = saved
    rows, dy_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return jnp.dot(dy, kernel.T), jnp.dot(dy_rows.T, rows).T


project.defvjp(_project_fwd, _project_bwd)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias). `out_features` may be a tuple to keep structure (e.g. GPT-2's fused 3×heads).
    `saved_as`: the name (checkpoint_name) of x @ kernel that the remat policies keep or drop (stack.REMAT_POLICIES)."""

    out_dtype = None  # the matmul's output dtype: the compute dtype (Float32Dense: float32)

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
        saved_as: str | None = None,
    ):
        self.saved_as = saved_as
        out_shape = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.dtype = dtype
        self.kernel = make_param(nnx.initializers.normal(init_std), rngs.params(), (in_features, *out_shape), axes)
        self.bias = (
            make_param(nnx.initializers.zeros, rngs.params(), out_shape, axes[1:], kind=Bias) if use_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        if self.out_dtype == jnp.float32 and kernel.ndim == 2:
            y = einsum_float32("...d,dk->...k", x.astype(self.dtype), kernel)
        elif self.out_dtype is None:
            flat = kernel.reshape(kernel.shape[0], -1)  # GPT-2's fused [in, 3, heads] as one [in, 3 x heads]
            y = project(x.astype(self.dtype), flat).reshape(*x.shape[:-1], *kernel.shape[1:])
        else:
            y = jax.lax.dot_general(
                x.astype(self.dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=self.out_dtype
            )
        if self.saved_as:
            y = checkpoint_name(y, self.saved_as)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Float32Dense(Dense):
    """A Dense whose output is float32 from any compute dtype, accumulated in float32 (an untied LM head's logits)."""

    out_dtype = jnp.float32


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


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """What kind of feed-forward block, beyond its sizes and activation. `gated`: wo(act(wi_0(x)) * wi_1(x)), the
    GLU forms (T5 v1.1's gated-gelu, Llama's SwiGLU = silu, GeGLU = gelu), wi_0 the gate and wi_1 the up projection."""

    gated: bool = False
    use_bias: bool = True
    out_init_std: float | None = None  # None: the layer's init_std


class MLP(nnx.Module):
    """Feed-forward block: wo(act(wi(x))), or the gated form of `MLPSpec`.

    `dropout_rate` acts on the hidden activations (before wo); residual dropout is the caller's.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        spec: MLPSpec = MLPSpec(),
        *,
        activation: str,
        dropout_rate: float = 0.0,
        init_std: float = 0.02,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.activation = activation
        self.dropout_rate = dropout_rate
        dense = lambda d_in, d_out, axes, std, name: Dense(
            d_in, d_out, axes, rngs=rngs, use_bias=spec.use_bias, init_std=std, dtype=dtype, saved_as=name
        )
        dense_in = lambda: dense(d_model, d_ff, ("embed", "mlp"), init_std, "mlp_hidden")
        self.wi = None if spec.gated else dense_in()
        self.wi_0 = dense_in() if spec.gated else None
        self.wi_1 = dense_in() if spec.gated else None
        out_std = init_std if spec.out_init_std is None else spec.out_init_std
        self.wo = dense(d_ff, d_model, ("mlp", "embed"), out_std, "mlp_out")

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        h = act(self.wi_0(x)) * self.wi_1(x) if self.wi is None else act(self.wi(x))
        h = dropout(h, self.dropout_rate, rngs)  # T5's dropout_rate, BART's activation_dropout; 0 for GPT-2
        return self.wo(h)
