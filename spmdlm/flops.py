"""Analytic FLOPs for MFU: the building blocks of each family's formula (in its family file; the step total is
`Family.train_flops_per_step`), MFU itself, and the count of what a traced program really multiplies.

Conventions (docs/architecture.md §6), the usual ones of MFU reports:
- a dense layer costs 2·in·out FLOPs per token (one multiply and one add per weight); biases, norms, activations,
  softmax, the loss and the optimizer update are not counted;
- attention counts its two matmuls, scores q·kᵀ and the probability-weighted sum of values, 2·S·inner FLOPs each per
  query token over S keys; causal self-attention counts half of them (the useful triangle);
- the LM head (tied or not) is a dense layer of d_model·vocab; embedding lookups and relative-position biases are
  gathers and cost nothing;
- training = 3 × forward (the backward pass takes a matmul for the input gradient and one for the weight gradient);
  activation recomputation (remat) is not counted: MFU measures useful work, not the work done.

Peak FLOP/s per device (the accelerator table, or the CPU's measured matmul): spmdlm/devices.py.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core


# -- analytic FLOPs ----------------------------------------------------------------------------------------------------
def dense(n_in: int, n_out: int) -> float:
    return 2.0 * n_in * n_out


def attention_matmuls(n_keys: float, inner: int) -> float:
    """Scores and weighted values for one query token over n_keys keys (all heads: inner = heads·head_dim)."""
    return 2 * 2.0 * n_keys * inner


def mfu(flops_per_step: float, step_seconds: float, n_devices: int, peak_per_device: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s per device over the device's peak."""
    if not peak_per_device or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / n_devices / peak_per_device


# A jax.named_scope for sums written as a product with a vector of ones (faster on XLA:CPU than its reduction,
# layers.add_broadcast): a reduction, not model FLOPs, so jaxpr_matmul_flops leaves its dot_generals out.
SUM_AS_MATMUL = "sum_as_matmul"


def jaxpr_matmul_flops(jaxpr: Any) -> float:
    """2·M·N·K summed over every dot_general of a (closed) jaxpr, nested ones included (scan bodies × length).

    What the traced program really multiplies, e.g. `jaxpr_matmul_flops(jax.make_jaxpr(step)(*args))`: a check of
    the formulas above that, unlike XLA's cost analysis, leaves out elementwise work; it counts causal attention's
    full square and any remat recompute, not the sums of SUM_AS_MATMUL.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and SUM_AS_MATMUL not in str(eqn.source_info.name_stack):
            (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lhs_contracting)
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in core.jaxprs_in_params(eqn.params):
            total += times * jaxpr_matmul_flops(sub)
    return total
