"""Analytic training FLOPs per step (each family's formula, in its family file), and a device's peak FLOP/s, for MFU.

Conventions (docs/architecture.md §6), the usual ones of MFU reports:
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
    ("tpu v2", 22.5e12),  # per core (a JAX device); 45 TFLOP/s per chip
    ("tpu v3", 61.5e12),  # per core (a JAX device); 123 TFLOP/s per chip
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
def dense(n_in: int, n_out: int) -> float:
    return 2.0 * n_in * n_out


def attention_matmuls(n_keys: float, inner: int) -> float:
    """Scores and weighted values for one query token over n_keys keys (all heads: inner = heads·head_dim)."""
    return 2 * 2.0 * n_keys * inner


def sequence_lengths(objective: Any) -> dict[str, int]:
    """Encoder/decoder (or single) sequence lengths of one example, from the objective's example_spec."""
    spec: Mapping[str, tuple[tuple[int, ...], Any]] = objective.example_spec()
    lengths = {"input": spec["input_ids"][0][0]}
    if "decoder_input_ids" in spec:
        lengths["decoder"] = spec["decoder_input_ids"][0][0]
    return lengths


def forward_flops_per_example(config: Any, objective: Any, *, full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part: the formula of the config's model family.

    `full_causal_square` also counts the masked half of causal attention, which a dense implementation computes
    (for cross-checks against what XLA runs; MFU uses the default).
    """
    from spmdlm.families import get_family

    family = get_family(getattr(config, "model_type", None))
    return family.forward_flops(config, sequence_lengths(objective), full_causal_square=full_causal_square)


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
