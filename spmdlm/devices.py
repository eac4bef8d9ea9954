"""What a device can do, and what a compiled program asks of it: one table of accelerators (peak FLOP/s, memory,
bandwidth), the CPU's measured matmul rate, a device's memory, and one reader of XLA's compiled memory and cost.

The launcher's memory gate, `--compile_for`, the MFU in the logs and the benchmarks all read these.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import hardware_utils

GiB = 2**30
PROC_MEMINFO = Path("/proc/meminfo")  # MemAvailable: the RAM the kernel can give without swapping
PROC_SELF_STATM = Path("/proc/self/statm")  # this process's resident pages
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # its control groups, where a container's memory limit is set
CGROUP_ROOT = Path("/sys/fs/cgroup")
CUDA_INSTALL_HINT = "pip install -e '.[cuda]' (JAX with its CUDA plugin)"


def unused_nvidia_gpu() -> bool:
    """An NVIDIA GPU on the PCI bus while JAX computes on the CPU: a CPU-only JAX, which says nothing about it. A
    JAX_PLATFORMS the user set is a choice, not a mistake."""
    return (
        jax.default_backend() == "cpu"
        and not os.environ.get("JAX_PLATFORMS", "").strip()
        and hardware_utils.has_visible_nvidia_gpu()
    )


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of an accelerator generation (TPU v2/v3: a TensorCore, two per chip; later TPUs and GPUs: a
    chip). Public figures: dense bf16 peak; HBM and its bandwidth per device (None where the part comes in several
    sizes: the device's own memory_stats says)."""

    name: str
    peak_flops: float
    hbm_bytes: int | None
    hbm_bytes_per_s: float | None


_V5E = Chip("v5e", 197e12, 16 * GiB, 819e9)
_V5P = Chip("v5p", 459e12, 95 * GiB, 2765e9)
_V6E = Chip("v6e", 918e12, 32 * GiB, 1640e9)
# Matched case-insensitively against jax's `device_kind`, first hit wins (so the more specific names come first).
# v4 slices are described in megacore mode (one device per chip), as JAX runs them on Cloud TPU VMs.
CHIPS: tuple[tuple[str, Chip], ...] = (
    ("tpu v2", Chip("v2 (per core; 2 per chip)", 22.5e12, 8 * GiB, 350e9)),
    ("tpu v3", Chip("v3 (per core; 2 per chip)", 61.5e12, 16 * GiB, 450e9)),
    ("tpu v4", Chip("v4", 275e12, 32 * GiB, 1228e9)),
    ("tpu v5 lite", _V5E),  # v5e's device_kind
    ("tpu v5e", _V5E),
    ("tpu v5p", _V5P),
    ("tpu v5", _V5P),  # "TPU v5" without "lite" is a v5p
    ("tpu v6 lite", _V6E),  # v6e (Trillium)'s device_kind
    ("tpu v6e", _V6E),
    ("a100", Chip("A100", 312e12, None, None)),
    ("h100", Chip("H100", 989e12, 80 * GiB, 3.35e12)),
    ("h200", Chip("H200", 989e12, 141 * 10**9, 4.8e12)),  # GH200 too
)

# The CPU measurement: n×n @ n×n matmuls for growing n, while the next size still fits the time budget.
_CPU_MATMUL_SIZES = (512, 1024, 2048, 3072)
_CPU_MEASURE_BUDGET_S = 1.5


def chip(device_kind: str) -> Chip | None:
    kind = device_kind.lower()
    return next((c for name, c in CHIPS if name in kind), None)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    return np.dtype(dtype).name


@functools.cache
def measure_cpu_matmul_flops(dtype: str = "float32", budget_s: float = _CPU_MEASURE_BUDGET_S) -> float:
    """Best FLOP/s of jitted n×n matmuls on the first CPU device (which uses all host cores), ~budget_s in all.

    Best of 3 runs per size, sizes growing while the next one's runs fit the remaining budget (2048 here, ~1 s);
    cached per dtype, so a second call is free.
    """
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
    device = jax.devices()[0]
    if device.platform == "cpu":
        try:
            return measure_cpu_matmul_flops(_dtype_name(dtype)) / jax.local_device_count()
        except Exception:  # a dtype the CPU cannot multiply: no reference
            return None
    known = chip(device.device_kind)
    return known.peak_flops if known else None


def _read_int(file: Path) -> int | None:
    """An integer file of /proc or /sys (None: absent, unreadable, or `max`: no limit)."""
    try:
        return int(file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_memory_limit() -> tuple[int | None, str]:
    """(bytes, file) of the least memory limit of this process's control groups and their parents (a container's
    limit): cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`; (None, '') where none is set."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    where = [(CGROUP_ROOT, "memory.max"), (CGROUP_ROOT / "memory", "memory.limit_in_bytes")]
    for hierarchy, controllers, group in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if hierarchy == "0" and not controllers:
            where.append((CGROUP_ROOT / group.strip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            where.append((CGROUP_ROOT / "memory" / group.strip("/"), "memory.limit_in_bytes"))
    limits = set()
    for folder, name in where:  # the group and its parents: a parent's limit holds for its children too
        for level in (folder, *folder.parents):
            if level == CGROUP_ROOT.parent:
                break
            if (value := _read_int(level / name)) is not None:
                limits.add((value, str(level / name)))
    return min(limits) if limits else (None, "")


def host_memory() -> tuple[int | None, str]:
    """(bytes, what in words) of the RAM this process may still use: the host's available RAM (MemAvailable, plus
    what this process holds already) or its container's memory limit (cgroup_memory_limit), whichever is less; the
    CPU memory gate's measure. (None, '') where neither is known."""
    available = _meminfo_available()
    if available is not None:
        available += _resident_bytes() or 0  # the state built so far is this process's already
    limit, file = cgroup_memory_limit()
    if limit is not None and (available is None or limit < available):
        return limit, f"the container's memory limit ({file})"
    return available, "the host's available RAM" if available is not None else ""


def _meminfo_available() -> int | None:
    try:
        for line in PROC_MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _resident_bytes() -> int | None:
    try:
        return int(PROC_SELF_STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def device_memory_bytes() -> tuple[int | None, str]:
    """(bytes, 'device') of an accelerator, or (RAM, 'host') for CPU devices, which share it: the physical RAM, or
    the container's memory limit where that is less (the memory gate measures what is available: host_memory)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            physical = None
        limit = cgroup_memory_limit()[0]
        return min(filter(None, (physical, limit)), default=None), "host"
    stats = device.memory_stats() or {}
    known = chip(device.device_kind)
    return stats.get("bytes_limit") or (known.hbm_bytes if known else None), "device"


def memory_per_device(device) -> int | None:
    """Bytes one device like `device` has to itself: host RAM shared out among the local CPU devices (simulated
    ones share it), an accelerator's own, or — for a device not of this host (--compile_for's target) — its chip's
    HBM from the table. None when unknown."""
    if device.platform == "cpu":
        capacity, _ = device_memory_bytes()
        return capacity // jax.local_device_count() if capacity else None
    own = device_memory_bytes()[0] if device in jax.local_devices() else None
    return own or getattr(chip(device.device_kind), "hbm_bytes", None)


def compiled_stats(compiled) -> dict[str, Any]:
    """Per-device memory of a compiled program and XLA's own cost estimate (keys absent or None where the backend
    does not say). `total_bytes` is what the program needs on a device: its arguments and outputs (less the donated
    arguments reused for outputs), its temporaries and its code."""
    out: dict[str, Any] = {}
    try:
        mem = compiled.memory_analysis()
        out.update(
            argument_bytes=mem.argument_size_in_bytes,
            output_bytes=mem.output_size_in_bytes,
            temp_bytes=mem.temp_size_in_bytes,
            alias_bytes=mem.alias_size_in_bytes,
            code_bytes=mem.generated_code_size_in_bytes,
        )
        out["total_bytes"] = (
            out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"] + out["code_bytes"]
        )
    except Exception:  # some backends have no memory analysis
        pass
    try:
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    except Exception:
        cost = {}
    optimal = cost.get("optimal_seconds")
    out.update(
        xla_flops_per_device=cost.get("flops"),
        xla_bytes_accessed_per_device=cost.get("bytes accessed"),
        # libtpu answers -9 (no estimate) when compiling for a topology; only a positive value is one
        xla_optimal_seconds=optimal if optimal is not None and optimal > 0 else None,
    )
    return out
