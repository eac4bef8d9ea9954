"""Analytic training FLOPs per step for each architecture, and the peak FLOP/s of a device, for MFU.

Conventions (DESIGN §8), the usual ones of MFU reports:
- a dense layer costs 2·in·out FLOPs per token (one multiply and one add per weight); biases, norms, activations,
  softmax, the loss and the optimizer update are not counted;
- attention counts its two matmuls, scores q·kᵀ and the probability-weighted sum of values, 2·S·inner FLOPs each per
  query token over S keys; causal self-attention counts half of them (the useful triangle);
- the LM head (tied or not) is a dense layer of d_model·vocab; embedding lookups and relative-position biases are
  gathers and cost nothing;
- training = 3 × forward (the backward pass takes a matmul for the input gradient and one for the weight gradient);
  activation recomputation (remat) is not counted: MFU measures useful work, not the work done.

`peak_flops_per_device(dtype)` is the dense bf16 peak of a known accelerator (by jax's `device_kind`), or, on CPU, a
measured large jitted matmul in the run's dtype (cached after the first call), divided among the simulated CPU
devices that share the host's cores; None when neither is known.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Mapping

# Dense bf16 peak FLOP/s per chip, matched case-insensitively against jax's `device_kind` (first hit wins, so the
# more specific names come first). The same figure is used whatever the run's dtype: MFU against the bf16 peak.
PEAK_FLOPS_BY_DEVICE_KIND: tuple[tuple[str, float], ...] = (
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),  # v5e's device_kind
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # "TPU v5" without "lite" is a v5p
    ("tpu v6 lite", 918e12),  # v6e (Trillium)'s device_kind
    ("tpu v6e", 918e12),
    ("a100", 312e12),
    ("h100", 989e12),
    ("h200", 989e12),  # GH200 too
)

# The CPU measurement: n×n @ n×n matmuls for growing n, while the next size still fits the time budget.
_CPU_MATMUL_SIZES = (512, 1024, 2048, 3072)
_CPU_MEASURE_BUDGET_S = 1.5


# -- analytic FLOPs ----------------------------------------------------------------------------------------------------
def _dense(n_in: int, n_out: int) -> float:
    return 2.0 * n_in * n_out


def _attention_matmuls(n_keys: float, inner: int) -> float:
    """Scores and weighted values for one query token over n_keys keys (all heads: inner = heads·head_dim)."""
    return 2 * 2.0 * n_keys * inner


def gpt2_forward_flops_per_token(config: Any, seq_len: int, *, full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs per token of a GPT-2 at sequence length seq_len, by part."""
    d, n_layer, vocab = config.n_embd, config.n_layer, config.vocab_size
    ff = config.n_inner or 4 * d
    per_layer_dense = _dense(d, 3 * d) + _dense(d, d) + _dense(d, ff) + _dense(ff, d)
    per_layer_attention = _attention_matmuls(seq_len, d) / (1 if full_causal_square else 2)  # causal: half
    return {"dense": n_layer * per_layer_dense, "attention": n_layer * per_layer_attention,
            "lm_head": _dense(d, vocab)}


def t5_forward_flops_per_example(config: Any, encoder_len: int, decoder_len: int, *,
                                 full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one T5 (v1.1: gated FFN, untied head) example, by part.

    Encoder: bidirectional self-attention and FFN per encoder token. Decoder: causal self-attention, cross-attention
    (q and o per decoder token; k and v project the encoder output once per decoder layer, i.e. per encoder token;
    scores/values over all encoder tokens) and FFN per decoder token; the LM head per decoder token.
    """
    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    inner = config.num_heads * config.d_kv
    n_enc = config.num_layers
    n_dec = getattr(config, "num_decoder_layers", None) or n_enc
    gated = str(getattr(config, "feed_forward_proj", "gated-gelu")).startswith("gated")
    ffn = (3 if gated else 2) * _dense(d, ff)  # gated: wi_0, wi_1 (d→ff) and wo (ff→d)
    qkvo = 3 * _dense(d, inner) + _dense(inner, d)
    encoder = encoder_len * n_enc * (qkvo + _attention_matmuls(encoder_len, inner) + ffn)
    causal = 1 if full_causal_square else 2
    decoder_self = decoder_len * n_dec * (qkvo + _attention_matmuls(decoder_len, inner) / causal)
    cross = n_dec * (decoder_len * (_dense(d, inner) + _dense(inner, d) + _attention_matmuls(encoder_len, inner))
                     + encoder_len * 2 * _dense(d, inner))
    return {"encoder": encoder, "decoder_self_attention": decoder_self, "cross_attention": cross,
            "decoder_ffn": decoder_len * n_dec * ffn, "lm_head": decoder_len * _dense(d, vocab)}


def sequence_lengths(objective: Any) -> dict[str, int]:
    """Encoder/decoder (or single) sequence lengths of one example, from the objective's example_spec."""
    spec: Mapping[str, tuple[tuple[int, ...], Any]] = objective.example_spec()
    lengths = {"input": spec["input_ids"][0][0]}
    if "decoder_input_ids" in spec:
        lengths["decoder"] = spec["decoder_input_ids"][0][0]
    return lengths


def forward_flops_per_example(config: Any, objective: Any, *, full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part, dispatching on config.model_type.

    `full_causal_square` also counts the masked half of causal attention, which a dense implementation computes
    (for cross-checks against what XLA runs; MFU uses the default).
    """
    lengths = sequence_lengths(objective)
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        seq = lengths["input"]
        per_token = gpt2_forward_flops_per_token(config, seq, full_causal_square=full_causal_square)
        return {k: v * seq for k, v in per_token.items()}
    if model_type == "t5":
        if "decoder" not in lengths:
            raise ValueError("a T5 objective must give decoder_input_ids in its example_spec")
        return t5_forward_flops_per_example(config, lengths["input"], lengths["decoder"],
                                            full_causal_square=full_causal_square)
    raise NotImplementedError(f"no FLOP formula for model_type {model_type!r} (have: gpt2, t5)")


def train_flops_per_step(config: Any, objective: Any, global_batch: int, *, full_causal_square: bool = False) -> float:
    """Model FLOPs of one optimizer step over a global batch: 3 × forward matmul FLOPs (remat excluded)."""
    parts = forward_flops_per_example(config, objective, full_causal_square=full_causal_square)
    return 3.0 * global_batch * sum(parts.values())


def mfu(flops_per_step: float, step_seconds: float, n_devices: int, peak_per_device: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s per device over the device's peak."""
    if not peak_per_device or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / n_devices / peak_per_device


def jaxpr_matmul_flops(jaxpr: Any) -> float:
    """2·M·N·K summed over every dot_general of a (closed) jaxpr, nested ones included (scan bodies × length).

    What the traced program really multiplies, e.g. `jaxpr_matmul_flops(jax.make_jaxpr(step)(*args))`: a check of
    the formulas above that, unlike XLA's cost analysis, leaves out elementwise work; it counts causal attention's
    full square and any remat recompute.
    """
    from jax.extend import core

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lhs_contracting)
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in core.jaxprs_in_params(eqn.params):
            total += times * jaxpr_matmul_flops(sub)
    return total


# -- peak FLOP/s ---------------------------------------------------------------------------------------------------
def peak_flops_for_device_kind(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for name, peak in PEAK_FLOPS_BY_DEVICE_KIND:
        if name in kind:
            return peak
    return None


def _dtype_name(dtype: Any) -> str:
    import numpy as np

    if isinstance(dtype, str):
        return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_flops(dtype: str = "float32", budget_s: float = _CPU_MEASURE_BUDGET_S) -> float:
    """Best FLOP/s of jitted n×n matmuls on the first CPU device (which uses all host cores), ~budget_s in all.

    Best of 3 runs per size, sizes growing while the next one's runs fit the remaining budget (2048 here, ~1 s);
    cached per dtype, so a second call is free.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    fn = jax.jit(lambda a, b: a @ b)
    deadline = time.perf_counter() + budget_s
    best_rate = 0.0
    for n in _CPU_MATMUL_SIZES:
        a = jax.device_put(jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype=dtype), device)
        fn(a, a).block_until_ready()  # compile and warm up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn(a, a).block_until_ready()
            times.append(time.perf_counter() - start)
        best_rate = max(best_rate, 2.0 * n**3 / min(times))
        remaining = deadline - time.perf_counter()
        # the next size costs ~(next/n)^3 times as much per run, and needs 4 runs plus a compile
        if remaining < 0 or min(times) * 8 * 4 > remaining:
            break
    return best_rate


def peak_flops_per_device(dtype: Any = "bfloat16") -> float | None:
    """Peak FLOP/s of one device of the default backend, or None when unknown.

    Accelerators: the table's dense bf16 figure. CPU: a measured matmul in `dtype` (cached) divided by the number of
    local CPU devices, since simulated devices (xla_force_host_platform_device_count) share the same cores — so MFU
    on CPU reads as the fraction of the host's matmul throughput.
    """
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        try:
            return measure_cpu_matmul_flops(_dtype_name(dtype)) / jax.local_device_count()
        except Exception:  # a dtype the CPU cannot multiply: no reference
            return None
    return peak_flops_for_device_kind(device.device_kind)
