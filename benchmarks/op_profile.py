"""Where a jitted step's time goes: per-op times from a jax.profiler trace, grouped by what each op is (CPU or GPU).

XLA:CPU's thunk executor records one trace event per executed thunk (a fusion, a dot, a copy, a while loop, ...)
named after its HLO instruction. This module runs a step under `jax.profiler`, reads the trace back with
`jax.profiler.ProfileData`, sums the time per instruction over the traced steps and classifies each instruction from
the compiled HLO text (dot, convolution, fusion with a dot/reduce/scatter inside, copy, transpose, ...).

Only jax is imported here, so the same code profiles our step (`bench_train.py --profile DIR`) and a peer's step in
its own virtualenv (`profile_peer.py`). `python op_profile.py REPORT.json ...` prints reports side by side.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

# Events on the executor's threads that are bookkeeping, not work.
_NOT_OPS = re.compile(
    r"^(ThreadpoolListener|SlinkyThreadPool|ThunkExecutor|end: |MutexLock|Execute|"
    r"PjRt|TfrtCpu|CommonPjRt|ParseArguments|PythonRefManager|\$)"
)


def trace_steps(step: Callable[[], Any], steps: int, trace_dir: str) -> None:
    """Run `step()` (which must block until done) `steps` times under the profiler."""
    import jax

    jax.profiler.start_trace(trace_dir)
    try:
        for _ in range(steps):
            step()
    finally:
        jax.profiler.stop_trace()


def _newest_trace(trace_dir: str) -> list[str]:
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    newest_run = max(os.path.dirname(p) for p in paths)  # the profiler's run directories are timestamps
    return [p for p in paths if os.path.dirname(p) == newest_run]


def op_events(trace_dir: str) -> list[tuple[str, int, int]]:
    """(HLO instruction name, start ns, duration ns) of every op the executor's threads ran, in the newest trace
    under `trace_dir`. Nested events (a while loop's body ops inside the while thunk) appear both as the loop and
    themselves."""
    from jax.profiler import ProfileData

    events = []
    for path in _newest_trace(trace_dir):
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:GPU"):
                events += _gpu_op_events(plane)
            if not plane.name.startswith("/host:CPU"):
                continue
            for line in plane.lines:
                if line.name.startswith("tf_XLA"):
                    events += [(e.name, e.start_ns, e.duration_ns) for e in line.events if not _NOT_OPS.match(e.name)]
    return events


def _gpu_op_events(plane) -> list[tuple[str, int, int]]:
    """A GPU's kernels, named by the HLO instruction that launched them: the profiler's derived "XLA Ops" line where
    it wrote one, else every stream's kernels by their `hlo_op` statistic (the kernel's own name without it)."""
    lines = {line.name: line for line in plane.lines}
    if "XLA Ops" in lines:
        return [(e.name, e.start_ns, e.duration_ns) for e in lines["XLA Ops"].events]
    events = []
    for line in plane.lines:
        if line.name.startswith("Stream"):
            for e in line.events:
                hlo_op = str(dict(e.stats).get("hlo_op", ""))
                # A CUDA-graph command buffer names no op: run with XLA_FLAGS=--xla_gpu_enable_command_buffer= to
                # see them; the kernel's own name says at least what it is (a gemm, a fusion, cuDNN's attention).
                name = hlo_op if hlo_op and not hlo_op.startswith("command_buffer") else f"kernel:{e.name}"
                events.append((name, e.start_ns, e.duration_ns))
    return events


def op_times(events) -> dict[str, tuple[float, int]]:
    """{HLO instruction name: (total seconds, executions)}."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, _, duration in events:
        totals[name][0] += duration * 1e-9
        totals[name][1] += 1
    return {name: (seconds, count) for name, (seconds, count) in totals.items()}


def timeline(events, steps: int) -> dict[str, float]:
    """Seconds per step from the first op to the last, with at least one op running, and with two at once (both
    cores on separate ops). What no op covers is the executor's idle time, or work it does not trace: XLA:CPU's Eigen
    dots (`dot` ops) return at once and finish on the thread pool, so their time shows up there."""
    edges = sorted([(start, 1) for _, start, _ in events] + [(start + d, -1) for _, start, d in events])
    running, last, busy, both = 0, None, 0, 0
    for t, change in edges:
        if last is not None:
            busy += (t - last) if running >= 1 else 0
            both += (t - last) if running >= 2 else 0
        running, last = running + change, t
    span = edges[-1][0] - edges[0][0] if edges else 0
    return {"span": span * 1e-9 / steps, "any_op": busy * 1e-9 / steps, "two_ops": both * 1e-9 / steps}


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """HLO computation name -> its instruction lines."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            current = computations.setdefault(header.group(1), [])
        elif current is not None and "=" in line:
            current.append(line.strip())
    return computations


def _opcode(line: str) -> str:
    match = re.search(r"=\s*[^ ]+(?:\{[^}]*\})?\s+([\w\-]+)\(", line)
    if not match:  # tuple-shaped results: "= (f32[..], f32[..]) opcode("
        match = re.search(r"\)\s+([\w\-]+)\(", line)
    return match.group(1) if match else "?"


def _phase(line: str) -> str:
    """forward / backward / update (optimizer, clipping, metrics) from the op_name JAX wrote into the metadata."""
    op_name = re.search(r'op_name="([^"]*)"', line)
    if not op_name:
        return "?"
    if "transpose(jvp" in op_name.group(1):
        return "backward"
    return "forward" if "jvp(" in op_name.group(1) else "update"


def classify(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """HLO instruction name -> (category, result shape, phase). The category is its opcode, and for fusions what heavy
    op is inside ("fusion:dot", "fusion:reduce", "fusion:scatter", "fusion:gather", "fusion:elementwise", ...); the
    phase is forward, backward or update."""
    computations = _computations(hlo_text)
    heavy = (
        "dot",
        "convolution",
        "scatter",
        "gather",
        "reduce-window",
        "reduce",
        "sort",
        "dynamic-update-slice",
        "dynamic-slice",
        "transpose",
        "concatenate",
        "pad",
        "select-and-scatter",
    )

    def inside(computation: str, seen: set) -> set[str]:
        ops = set()
        for line in computations.get(computation, []):
            ops.add(_opcode(line))
            for called in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line):
                if called not in seen:
                    seen.add(called)
                    ops |= inside(called, seen)
        return ops

    categories = {}
    for lines in computations.values():
        for line in lines:
            name_match = re.match(r"(?:ROOT )?%?([\w.\-]+) =", line)
            if not name_match:
                continue
            opcode = _opcode(line)
            category = opcode
            if opcode == "custom-call":  # a library call: cuBLAS's gemm, cuDNN's attention, ...
                target = re.search(r'custom_call_target="([^"]+)"', line)
                category = f"custom-call:{target.group(1)}" if target else opcode
            if opcode == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", line)
                ops = inside(called.group(1), set()) if called else set()
                kind = next((op for op in heavy if op in ops), "elementwise")
                category = f"fusion:{kind}"
            shape = re.search(r"=\s*(\S+?\[[^\]]*\]|\([^)]*\))", line)
            categories[name_match.group(1)] = (category, shape.group(1) if shape else "", _phase(line))
    return categories


def _kernel_category(name: str) -> str:
    """What a GPU kernel that no HLO instruction claims is, from its name."""
    lower = name.lower()
    for word, category in (
        ("gemm", "kernel:gemm"),
        ("xmma", "kernel:gemm"),
        ("cutlass", "kernel:gemm"),
        ("fmha", "kernel:attention"),
        ("flash", "kernel:attention"),
        ("cudnn", "kernel:cudnn"),
        ("memcpy", "memcpy"),
        ("memset", "memset"),
        ("reduce", "kernel:reduce"),
        ("fusion", "kernel:fusion"),
    ):
        if word in lower:
            return category
    return "?"


def report(trace_dir: str, hlo_text: str, steps: int, label: str) -> dict[str, Any]:
    """Per-step seconds per op and per category (excluding while/call wrappers, whose bodies are counted)."""
    events = op_events(trace_dir)
    times = op_times(events)
    categories = classify(hlo_text)
    ops = []
    for name, (seconds, count) in times.items():
        category, shape, phase = categories.get(name, (_kernel_category(name), "", "?"))
        ops.append(
            {
                "name": name,
                "category": category,
                "shape": shape,
                "phase": phase,
                "seconds_per_step": seconds / steps,
                "runs_per_step": count / steps,
            }
        )
    ops.sort(key=lambda op: -op["seconds_per_step"])
    by_category: dict[str, float] = collections.defaultdict(float)
    by_phase: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        if op["category"] not in ("while", "call", "conditional"):
            by_category[op["category"]] += op["seconds_per_step"]
            by_phase[op["phase"]] += op["seconds_per_step"]
    total = sum(by_category.values())
    ordered = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))
    return {
        "label": label,
        "steps": steps,
        "op_seconds_per_step": total,
        "by_category": ordered(by_category),
        "by_phase": ordered(by_phase),
        "timeline": timeline(events, steps),
        "top_ops": ops[:40],
    }


def print_reports(reports: list[dict[str, Any]], top: int = 15, out=sys.stdout) -> None:
    """Categories side by side (ms per step), then each report's top ops."""
    categories = sorted(
        {c for r in reports for c in r["by_category"]},
        key=lambda c: -max(r["by_category"].get(c, 0.0) for r in reports),
    )
    width = max(len(c) for c in categories) if categories else 8
    print(f"{'ms per step':<{width}} " + " ".join(f"{r['label']:>14}" for r in reports), file=out)
    for c in categories:
        print(f"{c:<{width}} " + " ".join(f"{1e3 * r['by_category'].get(c, 0.0):14.1f}" for r in reports), file=out)
    print(f"{'total (ops)':<{width}} " + " ".join(f"{1e3 * r['op_seconds_per_step']:14.1f}" for r in reports), file=out)
    for key, title in (
        ("span", "wall, first op to last"),
        ("any_op", "  some op running"),
        ("two_ops", "  two ops at once"),
    ):
        if all("timeline" in r for r in reports):
            print(f"{title:<{width}} " + " ".join(f"{1e3 * r['timeline'][key]:14.1f}" for r in reports), file=out)
    for phase in ("forward", "backward", "update", "?"):
        if any(r.get("by_phase", {}).get(phase) for r in reports):
            print(
                f"{'  ' + phase:<{width}} "
                + " ".join(f"{1e3 * r.get('by_phase', {}).get(phase, 0.0):14.1f}" for r in reports),
                file=out,
            )
    for r in reports:
        print(f"\n{r['label']}: top ops (ms per step, runs per step, category)", file=out)
        for op in r["top_ops"][:top]:
            print(
                f"  {1e3 * op['seconds_per_step']:8.2f} {op['runs_per_step']:5.1f}  {op['category']:<22} "
                f"{op['name']:<36} {op['shape'][:60]}",
                file=out,
            )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/op_profile.py REPORT.json [REPORT.json ...]")
    print_reports([json.load(open(path)) for path in sys.argv[1:]])
