"""Multi-head attention (`Attention`), the masks it takes (`AttentionMask`) and how its core is computed.

The core (scores, mask, softmax, weighted values) is a model option (`set_attention`), so it holds for training,
evaluation and generation alike: `xla`, our einsums (`Attention._einsums`), which materialise the [B, heads, T, S]
scores and are the CPU default, or one of the fused kernels of `spmdlm.models.kernels` (`dot_product`, `cudnn`,
`splash`). A call a kernel cannot take (attention dropout, the generation cache, a bias splash cannot add) uses the
einsums. `resolve` picks a run's implementation for `--attention` (`auto`: the platform's kernel where it applies).
Packed rows (docs/packing.md) carry segment ids: a query sees only keys of its own segment, in every implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmdlm.mesh import constrain
from spmdlm.models import kernels, probes
from spmdlm.models.kv_cache import Cache
from spmdlm.models.layers import Dense, RMSNorm, add_broadcast, dropout, einsum_float32
from spmdlm.models.rope import Rope

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", *kernels.KERNELS)
CHOICES = ("auto", *IMPLEMENTATIONS)  # --attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see, kept as its parts so each implementation builds the form it takes: the
    einsums a boolean [B|1, 1, T, S] array, cuDNN sequence lengths and a causal flag, splash segment ids.

    `key_valid` [B, S] (False = padding), `causal` (query t sees keys <= t), packed segments (`q_segments` [B, T],
    `kv_segments` [B, S] int32: a query sees only keys of its own segment; 0 = padding, which real queries never
    see), or `dense`: an explicit boolean [B, 1, T, S] mask (the generation cache's, `kv_cache.Cache.advance`), which
    only the einsums read. `window` (left, right): a sliding window, query t sees keys t-left..t+right (set by the
    attention layer that has one; within packed rows a segment's tokens are contiguous, so index distance is token
    distance). Padded queries are not masked: their outputs are never read (transformers does the same).
    """

    key_valid: jax.Array | None = None
    dense: jax.Array | None = None
    q_segments: jax.Array | None = None
    kv_segments: jax.Array | None = None
    causal: bool = dataclasses.field(default=False, metadata={"static": True})
    window: tuple[int, int] | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def segmented(self) -> bool:
        return self.q_segments is not None

    def array(self, query_length: int, key_length: int) -> jax.Array | None:
        """The boolean [B|1, 1, T, S] mask (True = may attend); None = all keys."""
        if self.dense is not None:
            return self.dense
        mask = None if self.key_valid is None else self.key_valid[:, None, None, :].astype(bool)
        if self.segmented:
            same = self.q_segments[:, None, :, None] == self.kv_segments[:, None, None, :]
            mask = same if mask is None else mask & same
        if self.causal:
            causal = jnp.tril(jnp.ones((query_length, key_length), dtype=bool))[None, None]
            mask = causal if mask is None else mask & causal
        if self.window is not None:
            band = window_band(jnp.arange(query_length)[:, None], key_length, self.window)
            mask = band if mask is None else mask & band
        return mask

    def rows(self, queries: jax.Array, key_length: int) -> jax.Array:
        """`array`'s rows of the queries at positions `queries` [t] alone, [B|1, 1, t, S]: a block of queries at a
        time, without the whole mask (the monitors' side computation, kernels.logit_max). A position past the
        last query reads the last one's segment."""
        if self.dense is not None:
            return jnp.take(self.dense, queries, axis=2, mode="clip")
        rows = jnp.ones((1, 1, queries.shape[0], key_length), bool)
        if self.key_valid is not None:
            rows = rows & self.key_valid[:, None, None, :].astype(bool)
        if self.segmented:
            own = jnp.take(self.q_segments, queries, axis=1, mode="clip")
            rows = rows & (own[:, None, :, None] == self.kv_segments[:, None, None, :])
        if self.causal:
            rows = rows & (queries[:, None] >= jnp.arange(key_length)[None, :])[None, None]
        if self.window is not None:
            rows = rows & window_band(queries[:, None], key_length, self.window)
        return rows


def window_band(queries: jax.Array, key_length: int, window: tuple[int, int]) -> jax.Array:
    """[1, 1, T, S] bool: key s is within (left, right) = `window` of query position `queries` [T, 1]."""
    keys = jnp.arange(key_length)[None, :]
    left, right = window
    return ((keys >= queries - left) & (keys <= queries + right))[None, None]


def make_attention_mask(
    key_valid: jax.Array | None = None,
    causal: bool = False,
    *,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> AttentionMask:
    """The mask of an attention call: padding (`key_valid`), causality, and packed segments (both or neither; a key
    that `key_valid` marks as padding is moved to segment 0)."""
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("packed attention needs the segment ids of both the queries and the keys")
    if kv_segments is not None:
        q_segments, kv_segments = q_segments.astype(jnp.int32), kv_segments.astype(jnp.int32)
        if key_valid is not None:
            kv_segments = jnp.where(key_valid.astype(bool), kv_segments, 0)
        key_valid = None  # segment 0 is the padding now
    return AttentionMask(
        key_valid=None if key_valid is None else key_valid.astype(bool),
        causal=causal,
        q_segments=q_segments,
        kv_segments=kv_segments,
    )


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """[B, T] position of each token within its segment (0 at each segment's first token), for rows whose segments
    are contiguous runs of equal ids."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What kind of attention a layer is, beyond its shape (static: part of the model's definition).

    `scale=None` divides scores by sqrt(head_dim); T5 passes scale=1.0 (its init absorbs the scaling). `cross` marks
    a decoder's attention over the encoder output, whose keys and values generation projects once; `biased` an
    attention that is given an additive bias (T5's relative positions), which not every kernel takes.
    `num_key_value_heads`: grouped-query attention (each key/value head serves num_heads / it query heads);
    `rope`: rotary positions on queries and keys; `qk_norm_eps`: a per-head RMSNorm of queries and keys (QK-norm, as
    Qwen3); `window` (left, right): a sliding window, a query at i sees keys i-left..i+right (with the mask's other
    parts: causality, segments, padding).
    """

    num_key_value_heads: int | None = None
    use_bias: bool = True
    fused_qkv: bool = False  # GPT-2's one qkv kernel
    scale: float | None = None
    q_init_std: float | None = None  # None: the layer's init_std
    kv_init_std: float | None = None
    out_init_std: float | None = None
    cross: bool = False
    biased: bool = False
    rope: Rope | None = None
    qk_norm_eps: float | None = None
    window: tuple[int, int] | None = None


@functools.cache
def _say_kv_replicated(kv_heads: int, tensor: int) -> None:
    log.info(
        "grouped-query attention: the %d key/value heads do not divide the tensor axis (%d): their projections are "
        "replicated over it (the query heads stay sharded)",
        kv_heads,
        tensor,
    )


def _kv_heads_axis(kv_heads: int) -> str | None:
    """The logical axis of the key/value heads: sharded over `tensor` when they divide it, else replicated (said
    once), rather than split inside a head."""
    mesh = jax.sharding.get_abstract_mesh()
    tensor = 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)
    if kv_heads % tensor:
        _say_kv_replicated(kv_heads, tensor)
        return None
    return "heads"


class Attention(nnx.Module):
    """Multi-head attention (self or cross). Separate q/k/v/o projections, or GPT-2's fused qkv kernel; the options
    of an `AttentionSpec` (grouped key/value heads, RoPE, QK-norm, a sliding window)."""

    implementation = "xla"  # IMPLEMENTATIONS; set per model by set_attention

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        spec: AttentionSpec = AttentionSpec(),
        *,
        dropout_rate: float = 0.0,
        init_std: float = 0.02,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = spec.num_key_value_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if spec.fused_qkv and self.num_kv_heads != num_heads:
            raise ValueError("a fused qkv projection needs as many key/value heads as query heads")
        self.cross, self.biased, self.rope, self.window = spec.cross, spec.biased, spec.rope, spec.window
        self.scale = 1.0 / math.sqrt(head_dim) if spec.scale is None else spec.scale
        self.dropout_rate = dropout_rate
        std = lambda s: init_std if s is None else s
        dense = lambda out, axes, s, name: Dense(
            d_model, out, axes, rngs=rngs, use_bias=spec.use_bias, init_std=s, dtype=dtype, saved_as=name
        )
        inner, kv_inner = num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv = dense((3, inner), ("embed", "qkv", "heads"), init_std, "qkv") if spec.fused_qkv else None
        self.query = None if spec.fused_qkv else dense(inner, ("embed", "heads"), std(spec.q_init_std), "query")
        kv_axes = ("embed", "heads" if self.num_kv_heads == num_heads else _kv_heads_axis(self.num_kv_heads))
        self.key, self.value = (
            (None, None)
            if spec.fused_qkv
            else (dense(kv_inner, kv_axes, std(spec.kv_init_std), name) for name in ("key", "value"))
        )
        norm = lambda: RMSNorm(head_dim, eps=spec.qk_norm_eps, rngs=rngs)
        self.q_norm, self.k_norm = (norm(), norm()) if spec.qk_norm_eps is not None else (None, None)
        self.out = Dense(
            inner,
            d_model,
            ("heads", "embed"),
            rngs=rngs,
            use_bias=spec.use_bias,
            init_std=std(spec.out_init_std),
            dtype=dtype,
            saved_as="attention_out",
        )

    def heads(self, t: jax.Array, count: int | None = None) -> jax.Array:
        """[..., heads * head_dim] -> [..., heads, head_dim], heads sharded over `tensor` (where they divide it)."""
        count = count or self.num_heads
        return constrain(t.reshape(*t.shape[:-1], count, self.head_dim), "batch", "length", "act_heads", None)

    def keys_values(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        key, value = (
            self.heads(self.key(context), self.num_kv_heads),
            self.heads(self.value(context), self.num_kv_heads),
        )
        return (key if self.k_norm is None else self.k_norm(key)), value

    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: AttentionMask | None = None,
        bias: jax.Array | None = None,
        positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        cache: Cache | None = None,
    ) -> jax.Array:
        """With a `cache` (generation), self-attention adds x's keys and values to it and attends over all its
        slots; cross-attention reads the keys and values projected once from the encoder output, not `context`.
        `positions` [B|1, T]: each token's position for RoPE (default 0..T-1; with a cache the model's, from
        `Cache.advance`)."""
        layout = "bshd" if cache is None else "bhsd"  # keys and values: [B, S, heads, head_dim], or as cached
        if cache is not None and self.cross:
            q, k, v = self._queries(x), cache.cross_key, cache.cross_value
        else:
            if self.qkv is not None:
                qkv = self.qkv(x)  # sliced, not moved to the front: XLA:CPU then copies no transposed qkv
                q, k, v = (self.heads(qkv[..., i, :]) for i in range(3))
            else:
                q, (k, v) = self._queries(x), self.keys_values(x if context is None else context)
            if self.rope is not None:
                positions = jnp.arange(x.shape[1])[None] if positions is None else positions
                q, k = self.rope(q, positions), self.rope(k, positions)
            if cache is not None:
                k, v = cache.write(k, v)
        mask = self._windowed(mask, cache, x.shape[1])
        dropping = rngs is not None and self.dropout_rate > 0.0  # no kernel has attention dropout
        out = None
        if self.implementation != "xla" and cache is None and not dropping:
            out = kernels.fused(self.implementation, q, k, v, mask or AttentionMask(), bias, self.scale)
        if out is None:
            out = self._einsums(q, k, v, mask, bias, rngs, layout)
        elif probes.active():  # a kernel's scores never exist: the monitors' largest is computed beside it
            probes.record(self.logit_probe, kernels.logit_max(q, k, mask or AttentionMask(), bias, self.scale))
        return self.out(out.reshape(*out.shape[:-2], self.num_heads * self.head_dim))

    @property
    def logit_probe(self) -> str:
        """The name its largest logit is recorded under in the monitor variant (models/probes.py): the largest
        score softmax sees, q·k·scale plus the bias if any (T5's relative positions), over the (query, key) pairs
        the mask allows (a padded query's row included: its keys are masked as any row's)."""
        return probes.CROSS_LOGIT_MAX if self.cross else probes.LOGIT_MAX

    def _queries(self, x: jax.Array) -> jax.Array:
        q = self.heads(self.query(x))
        return q if self.q_norm is None else self.q_norm(q)

    def _windowed(self, mask: AttentionMask | None, cache: Cache | None, length: int) -> AttentionMask | None:
        """The mask with this layer's sliding window: a part of the mask the kernels take, or, over the cache's
        slots (whose real tokens are contiguous, so slot distance is token distance), folded into its dense mask."""
        if self.window is None:
            return mask
        if cache is None:
            return dataclasses.replace(mask or AttentionMask(), window=self.window)
        queries = cache.index + jnp.arange(length)[:, None]
        return dataclasses.replace(mask, dense=mask.dense & window_band(queries, mask.dense.shape[-1], self.window))

    def _einsums(self, q, k, v, mask, bias, rngs, layout):
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # each key/value head serves `groups` consecutive query heads (transformers' repeat_kv)
            k, v = (jnp.repeat(t, groups, axis=layout.index("h")) for t in (k, v))
        scores = einsum_float32(f"bthd,{layout}->bhts", q, k) * self.scale
        if bias is not None:
            scores = add_broadcast(scores, bias.astype(jnp.float32))
        dense = None if mask is None else mask.array(*scores.shape[-2:])
        if probes.active():
            probes.record(self.logit_probe, probes.masked_max(scores, dense))
        if dense is not None:
            scores = jnp.where(dense, scores, jnp.finfo(jnp.float32).min)
        probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(q.dtype), "attention_weights")
        probs = dropout(probs, self.dropout_rate, rngs)
        return jnp.einsum(f"bhts,{layout}->bthd", probs, v)


def set_attention(model: nnx.Module, implementation: str) -> nnx.Module:
    """Compute every attention layer of `model` with `implementation` (IMPLEMENTATIONS): part of the
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
    """`resolve` for `model` (an abstract one will do): weighs its largest attention dropout and whether some
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


def resolve(
    requested: str, *, platform: str, dtype, training: bool, dropout: float, biased: bool, device_kind: str = ""
) -> tuple[str, str | None]:
    """The implementation a run uses for `requested` (CHOICES) and a line saying why when `auto` did not pick the
    platform's kernel. `dropout`: the model's largest attention dropout; `biased`: some attention adds a bias;
    `device_kind`: the devices' generation (jax's device_kind), for kernels some generations cannot compile.
    Raises ValueError (naming the fix) for an explicit choice that cannot run here."""
    if requested not in CHOICES:
        raise ValueError(f"choose one of {', '.join(CHOICES)}")
    dropping = training and dropout > 0.0
    kernel = kernels.PLATFORM_KERNEL.get(platform)
    uncompilable = kernels.splash_uncompilable(device_kind, dtype) if platform == "tpu" else None
    if requested == "auto":
        if kernel is None:
            return "xla", None
        if dropping:
            return "xla", (
                f"auto = xla, not {kernel}: the model's attention dropout is {dropout} and the fused "
                "kernels have none (a config with attention dropout 0 uses the kernel)"
            )
        if kernel == "cudnn" and jnp.dtype(dtype) not in kernels.CUDNN_DTYPES:
            return "xla", "auto = xla, not cudnn: cuDNN's flash attention needs --dtype bfloat16"
        if kernel == "splash" and uncompilable:
            return "xla", f"auto = xla, not splash: {uncompilable} (--dtype float32 would take the kernel)"
        return kernel, (
            "auto = splash; the self-attention with T5's relative-position bias keeps xla (the kernel takes no bias)"
            if kernel == "splash" and biased
            else None
        )
    if requested in ("cudnn", "splash") and requested != kernel:
        where = {
            "cudnn": "an NVIDIA GPU with CUDA JAX (pip install -e '.[cuda]')",
            "splash": "a TPU (or --compile_for a TPU slice)",
        }[requested]
        raise ValueError(
            f"the {requested} kernel needs {where}, and this run's devices are {platform}; use --attention auto or xla"
        )
    if requested == "splash" and uncompilable:
        raise ValueError(f"{uncompilable}: use --attention auto or xla, or --dtype float32")
    if requested == "cudnn" and jnp.dtype(dtype) not in kernels.CUDNN_DTYPES:
        raise ValueError("cuDNN's flash attention takes bfloat16/float16: add --dtype bfloat16, or use --attention xla")
    if requested != "xla" and dropping:
        raise ValueError(
            f"the model's attention dropout is {dropout} and the {requested} path has none: use a "
            "config with attention dropout 0, or --attention xla"
        )
    return requested, None
