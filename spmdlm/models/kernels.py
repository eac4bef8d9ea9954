"""The fused kernels attention's core (scores, mask, softmax, weighted values) can run on instead of the einsums
of `attention.Attention` (`--attention`, chosen by `attention.resolve`):
- `dot_product`: `jax.nn.dot_product_attention`'s XLA path (the same math; here for the numerics tests);
- `cudnn`: its cuDNN flash-attention kernel (NVIDIA GPUs, bf16/fp16; takes T5's bias, with its gradient);
- `splash`: the Pallas TPU splash-attention kernel (jax.experimental.pallas.ops.tpu), packed segments and padding as
  its segment ids, sharded by shard_map over the mesh's batch and head axes; off a TPU it runs in Pallas' interpret
  mode (tests).
Each reads the parts of an `attention.AttentionMask` it takes: packed rows (docs/packing.md) as a boolean mask
(`dot_product`, cuDNN's mask input) or segment ids (splash), padding as sequence lengths (cuDNN) or segment ids, a
sliding window as `local_window_size` (or within the boolean mask) or splash's `LocalMask`. Grouped key/value heads
go to `jax.nn.dot_product_attention` as they are (it groups them itself) and to splash repeated per query head.
No kernel has attention dropout or the generation cache's layout, and splash takes no bias: such a call computes
with the einsums (`fused` returns None and says why once).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from spmdlm.mesh import resolve_spec

log = logging.getLogger(__name__)

KERNELS = ("dot_product", "cudnn", "splash")
PLATFORM_KERNEL = {"gpu": "cudnn", "tpu": "splash"}  # the kernel `--attention auto` takes on each platform
SPLASH_BLOCK = 128  # the splash kernel's tiles are multiples of the TPU's 128 lanes: lengths must be too
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# TPU generations (device_kind prefixes) whose Mosaic compiler cannot lower the splash kernel's bfloat16 matmuls
# (libtpu 0.0.42: "CompileTimeMosaicUnsupportedRhsType: Unsupported matmul RHS type on target:
# vector<128x128xbf16>"); float32 compiles there. tests/test_compile_for.py compiles both.
SPLASH_FLOAT32_ONLY = ("tpu v2", "tpu v3")


@functools.cache
def _say_once(implementation: str, reason: str) -> None:
    log.info("attention %s: %s; these calls use the xla einsums", implementation, reason)


def fused(
    implementation: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask,
    bias: jax.Array | None,
    scale: float,
) -> jax.Array | None:
    """q [B, T, heads, head_dim], k and v [B, S, heads, head_dim] -> [B, T, heads, head_dim] by `implementation`
    (KERNELS), or None where it cannot take this call (the caller then uses the einsums). `mask`: an
    `attention.AttentionMask`."""
    reason = _unsupported(implementation, q, k, mask, bias)
    if reason:
        _say_once(implementation, reason)
        return None
    if implementation == "splash":
        return _splash(q, k, v, mask, scale)
    if mask.segmented:  # as a boolean mask (cuDNN takes it as its mask input)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=None if bias is None else bias.astype(q.dtype),
            mask=mask.array(q.shape[1], k.shape[1]),  # the window, if any, is in it
            scale=scale,
            implementation="cudnn" if implementation == "cudnn" else "xla",
        )
    kv_lengths = None
    if mask.key_valid is not None and implementation == "cudnn":
        # cuDNN's padding mask is a length per row: keys are right-padded in every call without a cache (training,
        # evaluation, the encoders in generation); left-padded prompts only ever go through the cache.
        kv_lengths = mask.key_valid.sum(-1, dtype=jnp.int32)
    dense_padding = None if mask.key_valid is None or kv_lengths is not None else mask.key_valid[:, None, None, :]
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=None if bias is None else bias.astype(q.dtype),
        mask=dense_padding,
        scale=scale,
        is_causal=mask.causal,
        key_value_seq_lengths=kv_lengths,
        local_window_size=mask.window,
        implementation="cudnn" if implementation == "cudnn" else "xla",
    )


def _unsupported(implementation: str, q, k, mask, bias) -> str | None:
    if mask.dense is not None:
        return "an explicit mask (the generation cache)"
    if implementation == "cudnn" and q.dtype not in CUDNN_DTYPES:
        return f"cuDNN's flash attention takes bfloat16/float16, not {q.dtype}"
    if implementation == "splash":
        if bias is not None:
            return "the splash kernel takes no additive bias (T5's relative positions)"
        if q.shape[1] % SPLASH_BLOCK or k.shape[1] % SPLASH_BLOCK:
            return f"lengths {q.shape[1]}x{k.shape[1]} are not multiples of the kernel's {SPLASH_BLOCK}-wide blocks"
    return None


def _splash(q, k, v, mask, scale: float) -> jax.Array:
    batch, length, heads, _ = q.shape
    key_length = k.shape[1]
    if mask.segmented:  # packed rows: padding is segment 0, which only padded queries share
        q_segments, kv_segments = mask.q_segments, mask.kv_segments
    else:
        # Padding as segment ids: queries are segment 1, real keys 1, padded keys 0. A row without any real key (a
        # filler example of an evaluation's last batch) sees all its keys, as the einsums' uniform softmax does,
        # rather than none (which would divide by zero).
        valid = jnp.ones((batch, key_length), bool) if mask.key_valid is None else mask.key_valid
        valid = valid | ~valid.any(-1, keepdims=True)
        q_segments, kv_segments = jnp.ones((batch, length), jnp.int32), valid.astype(jnp.int32)
    to_heads_first = lambda t: jnp.swapaxes(t, 1, 2)  # the kernel's [heads, length, head_dim] per example
    if k.shape[2] != heads:  # grouped key/value heads: each serves heads / k.shape[2] consecutive query heads
        k, v = (jnp.repeat(t, heads // k.shape[2], axis=2) for t in (k, v))
    q, k, v = to_heads_first(q * jnp.asarray(scale, q.dtype)), to_heads_first(k), to_heads_first(v)
    mesh = jax.sharding.get_abstract_mesh()
    platform = jax.default_backend() if mesh.empty or mesh.abstract_device is None else mesh.abstract_device.platform

    def attend(q, k, v, q_segments, kv_segments):
        local_heads, local_length = q.shape[1], q.shape[2]
        head_mask = _splash_head_mask(mask, (local_length, key_length))
        block = max(b for b in (512, 256, SPLASH_BLOCK) if local_length % b == 0 and key_length % b == 0)
        kernel = splash.make_splash_mha(
            splash_mask.MultiHeadMask([head_mask] * local_heads),
            head_shards=1,
            q_seq_shards=1,
            block_sizes=splash.BlockSizes(
                block_q=block,
                block_kv=block,
                block_kv_compute=block,
                block_q_dkv=block,
                block_kv_dkv=block,
                block_kv_dkv_compute=block,
                block_q_dq=block,
                block_kv_dq=block,
            ),
            interpret=platform != "tpu",
        )
        return jax.vmap(kernel)(q, k, v, segment_ids=splash.SegmentIds(q_segments, kv_segments))

    if not mesh.empty:  # a Pallas kernel is not partitioned by XLA: each device runs it on its own rows and heads
        spec = resolve_spec(q.shape, ("batch", "act_heads", None, None), dict(mesh.shape))
        rows = PartitionSpec(spec[0], None)
        attend = jax.shard_map(
            attend, mesh=mesh, in_specs=(spec, spec, spec, rows, rows), out_specs=spec, check_vma=False
        )
    return to_heads_first(attend(q, k, v, q_segments, kv_segments))


def _splash_head_mask(mask, shape: tuple[int, int]):
    """One head's splash mask: causal, a (causal) sliding window, or full."""
    if mask.window is not None:
        left, right = mask.window
        return splash_mask.LocalMask(shape, window_size=(left, 0 if mask.causal else right), offset=0)
    return (splash_mask.CausalMask if mask.causal else splash_mask.FullMask)(shape)


def splash_uncompilable(device_kind: str, dtype) -> str | None:
    """Why this TPU generation's compiler rejects the splash kernel at `dtype`, or None."""
    if jnp.dtype(dtype) != jnp.float32 and device_kind.lower().startswith(SPLASH_FLOAT32_ONLY):
        return (
            f"the TPU compiler (Mosaic) cannot build the splash kernel's {jnp.dtype(dtype).name} matmuls for "
            f"{device_kind}"
        )
    return None


def logit_max(q: jax.Array, k: jax.Array, mask, bias: jax.Array | None, scale: float, block: int = 256) -> jax.Array:
    """The largest attention logit (q·k·scale, plus `bias`) over the (query, key) pairs `mask` (an
    `attention.AttentionMask`) allows: the stability monitors' figure for a call a kernel computed, whose scores
    never exist. Only the monitor variant of the train step computes it, `block` queries at a time, so that at most
    [B, heads, block, S] float32 scores exist at once; grouped key/value heads are matched to their query heads
    without repeating them. Not differentiated."""
    q, k = jax.lax.stop_gradient((q, k))
    batch, length, heads, dim = q.shape
    key_length, kv_heads = k.shape[1], k.shape[2]
    block = min(block, length)
    count = -(-length // block)

    def blocks(t: jax.Array, axis: int) -> jax.Array:
        """`t` cut into `count` blocks along `axis` (padded), the blocks on a new leading axis."""
        t = jnp.pad(t, [(0, count * block - length if a == axis else 0) for a in range(t.ndim)])
        t = t.reshape(*t.shape[:axis], count, block, *t.shape[axis + 1 :])
        return jnp.moveaxis(t, axis, 0)

    per_query = bias is not None and bias.shape[-2] == length  # else one row, broadcast over the queries

    def block_max(inputs):
        index, q_block, bias_block = inputs
        queries = index * block + jnp.arange(block)
        grouped = q_block.reshape(batch, block, kv_heads, heads // kv_heads, dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
        scores = scores.reshape(batch, heads, block, key_length) * scale
        if bias is not None:
            scores = scores + (bias_block if per_query else bias).astype(jnp.float32)
        allowed = mask.rows(queries, key_length) & (queries < length)[:, None]
        return jnp.max(jnp.where(allowed, scores, -jnp.inf))

    bias_blocks = blocks(bias, bias.ndim - 2) if per_query else None
    return jnp.max(jax.lax.map(block_max, (jnp.arange(count), blocks(q, 1), bias_blocks)))
