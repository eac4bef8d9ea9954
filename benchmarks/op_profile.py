"""Where a jitted step's time goes on CPU: per-op times from a jax.profiler trace, grouped by what each op is.

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
from typing import Any, Callable

# Events on the executor's threads that are bookkeeping, not work.
_NOT_OPS = re.compile(r"^(ThreadpoolListener|SlinkyThreadPool|ThunkExecutor|end: |MutexLock|Execute|"
                      r"PjRt|TfrtCpu|CommonPjRt|ParseArguments|PythonRefManager|\$)")


def trace_steps(step: Callable[[], Any], steps: int, trace_dir: str) -> None:
    """Run `step()` (which must block until done) `steps` times under the profiler."""
    import jax

    jax.profiler.start_trace(trace_dir)
    try:
        for _ in range(steps):
            step()
    finally:
        jax.profiler.stop_trace()


def op_times(trace_dir: str) -> dict[str, tuple[float, int]]:
    """{HLO instruction name: (total seconds, executions)} in the newest trace under `trace_dir`. Nested events (a
    while loop's body ops inside the while thunk) are counted both in the loop and themselves."""
    from jax.profiler import ProfileData

    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    newest_run = max(os.path.dirname(p) for p in paths)  # the profiler's run directories are timestamps
    for path in (p for p in paths if os.path.dirname(p) == newest_run):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith("tf_XLA"):
                    continue
                for event in line.events:
                    if _NOT_OPS.match(event.name):
                        continue
                    entry = totals[event.name]
                    entry[0] += event.duration_ns * 1e-9
                    entry[1] += 1
    return {name: (seconds, count) for name, (seconds, count) in totals.items()}


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


def classify(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (category, result shape). The category is its opcode, and for fusions what heavy op
    is inside ("fusion:dot", "fusion:reduce", "fusion:scatter", "fusion:gather", "fusion:elementwise", ...)."""
    computations = _computations(hlo_text)
    heavy = ("dot", "convolution", "scatter", "gather", "reduce-window", "reduce", "sort", "dynamic-update-slice",
             "dynamic-slice", "transpose", "concatenate", "pad", "select-and-scatter")

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
            if opcode == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", line)
                ops = inside(called.group(1), set()) if called else set()
                kind = next((op for op in heavy if op in ops), "elementwise")
                category = f"fusion:{kind}"
            shape = re.search(r"=\s*(\S+?\[[^\]]*\]|\([^)]*\))", line)
            categories[name_match.group(1)] = (category, shape.group(1) if shape else "")
    return categories


def report(trace_dir: str, hlo_text: str, steps: int, label: str) -> dict[str, Any]:
    """Per-step seconds per op and per category (excluding while/call wrappers, whose bodies are counted)."""
    times = op_times(trace_dir)
    categories = classify(hlo_text)
    ops = []
    for name, (seconds, count) in times.items():
        category, shape = categories.get(name, ("?", ""))
        ops.append({"name": name, "category": category, "shape": shape, "seconds_per_step": seconds / steps,
                    "runs_per_step": count / steps})
    ops.sort(key=lambda op: -op["seconds_per_step"])
    by_category: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        if op["category"] not in ("while", "call", "conditional"):
            by_category[op["category"]] += op["seconds_per_step"]
    total = sum(by_category.values())
    return {"label": label, "steps": steps, "op_seconds_per_step": total,
            "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])), "top_ops": ops[:40]}


def print_reports(reports: list[dict[str, Any]], top: int = 15, out=sys.stdout) -> None:
    """Categories side by side (ms per step), then each report's top ops."""
    categories = sorted({c for r in reports for c in r["by_category"]},
                        key=lambda c: -max(r["by_category"].get(c, 0.0) for r in reports))
    width = max(len(c) for c in categories) if categories else 8
    print(f"{'ms per step':<{width}} " + " ".join(f"{r['label']:>14}" for r in reports), file=out)
    for c in categories:
        print(f"{c:<{width}} " + " ".join(f"{1e3 * r['by_category'].get(c, 0.0):14.1f}" for r in reports), file=out)
    print(f"{'total (ops)':<{width}} " + " ".join(f"{1e3 * r['op_seconds_per_step']:14.1f}" for r in reports),
          file=out)
    for r in reports:
        print(f"\n{r['label']}: top ops (ms per step, runs per step, category)", file=out)
        for op in r["top_ops"][:top]:
            print(f"  {1e3 * op['seconds_per_step']:8.2f} {op['runs_per_step']:5.1f}  {op['category']:<22} "
                  f"{op['name']:<36} {op['shape'][:60]}", file=out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/op_profile.py REPORT.json [REPORT.json ...]")
    print_reports([json.load(open(path)) for path in sys.argv[1:]])
