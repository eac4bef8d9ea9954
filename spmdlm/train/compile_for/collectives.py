"""The collectives of a compiled step, read from XLA's optimised HLO text, and the analytic minimum for the mesh
(docs/tpu.md, "Collectives", has the model and its assumptions). Used by `--compile_for` (aot.py beside this file).

Bytes are those of the buffer each collective makes whole, on one device: an all-gather's result, a
reduce-scatter's operand, an all-reduce's or all-to-all's operand (a ring moves about (n-1)/n of it, an all-reduce
twice that). A collective inside a loop (the layer scan) counts once per iteration.
"""

from __future__ import annotations

import collections
import math
import re

import jax.numpy as jnp
from flax import nnx

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")  # compared with the minimum
# XLA for TPU may run an all-gather or reduce-scatter as a ring of permutes overlapped with the matmul that needs it
# (a "windowed einsum"): counted (the bytes each permute sends), not compared.
PERMUTE = "collective-permute"
TOLERANCE = 0.10  # a kind whose emitted bytes differ from the minimum by more is reported

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8\w*)\[([\d,]*)\]")
_CHANNEL = re.compile(r"channel_id=(\d+)")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s[a-z][\w\-]*\(")
_OPERANDS = re.compile(r"(?:all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\(([^)]*)\)")
_TRIP = re.compile(r"s32\[\]\S*\s+constant\((\d+)\)")


def _array_bytes(shape_text: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY.findall(shape_text):
        itemsize = 1 if dtype in ("pred", "s8", "u8") or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype)) // 8
        sizes.append(math.prod(int(d) for d in dims.split(",") if d) * itemsize)
    return sizes


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    computations, current, entry = {}, None, None
    for line in hlo.splitlines():
        header = None if line.startswith((" ", "}")) else _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith(" "):
            current.append(line)
    return computations, entry


def _shapes(lines: list[str]) -> dict[str, str]:
    """{instruction name: its result's shape text} of one computation."""
    return {m.group(1): m.group(2) for m in map(_DEFINITION.match, lines) if m}


class _Scope:
    """Collectives of one execution of a computation: those reached without a loop or branch are unique by channel
    (TPU's async collectives repeat one all-gather in the start, update and done fusions); loops add `repeated`."""

    def __init__(self):
        self.unique: dict[str, tuple[str, int]] = {}
        self.repeated = collections.Counter()

    def totals(self) -> collections.Counter:
        out = collections.Counter(self.repeated)
        for kind, size in self.unique.values():
            out[kind, "count"] += 1
            out[kind, "bytes"] += size
        return out


def emitted(hlo: str) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} of the collectives one run of the compiled module executes."""
    computations, entry = _computations(hlo)
    memo: dict[str, _Scope] = {}

    def scope_of(name: str) -> _Scope:
        if name not in memo:
            memo[name] = scope = _Scope()
            lines = computations.get(name, ())
            shapes = _shapes(lines)
            for index, line in enumerate(lines):
                _add_instruction(scope, f"{name}:{index}", line, shapes, scope_of, computations)
        return memo[name]

    totals = scope_of(entry).totals() if entry else collections.Counter()
    return {kind: {"count": totals[kind, "count"], "bytes": totals[kind, "bytes"]} for kind in (*KINDS, PERMUTE)}


def _add_instruction(scope: _Scope, where: str, line: str, shapes, scope_of, computations) -> None:
    collective = _COLLECTIVE.search(line)
    if collective:
        shape, kind, start = collective.groups()
        results = _array_bytes(shape)
        if start and kind == "all-gather":  # (operands, results): the results
            results = results[len(results) // 2 :]
        operands = [o.strip().split()[-1].lstrip("%") for o in _OPERANDS.search(line).group(1).split(",") if o.strip()]
        sent = sum(sum(_array_bytes(shapes.get(o, ""))) for o in operands)
        size = (sent or results[0]) if kind == PERMUTE else max(sum(results), sent)
        channel = _CHANNEL.search(line)
        scope.unique[f"channel {channel.group(1)}" if channel else where] = (kind, size)
    calls = dict((role, callee) for role, callee in _CALLS.findall(line) if role != "to_apply")
    if "body" in calls:  # a while loop: its body once per iteration
        trips = [int(n) for text in computations.get(calls["condition"], ()) for n in _TRIP.findall(text)]
        body = scope_of(calls["body"]).totals()
        scope.repeated.update({key: value * max(trips, default=1) for key, value in body.items()})
        return
    branches = [calls[r] for r in ("true_computation", "false_computation") if r in calls]
    branches += [b.strip().lstrip("%") for m in _BRANCHES.findall(line) for b in m.split(",") if b.strip()]
    if branches:  # a conditional runs one branch: the one that moves the most
        costly = max(
            (scope_of(b).totals() for b in branches), key=lambda t: sum(t[k, "bytes"] for k in (*KINDS, PERMUTE))
        )
        scope.repeated.update(costly)
    elif "calls" in calls:  # fusions, calls, async wrappers: part of this execution
        inner = scope_of(calls["calls"])
        scope.unique.update(inner.unique)
        scope.repeated.update(inner.repeated)


def analytic_minimum(
    params: nnx.State,
    mesh_shape: dict[str, int],
    *,
    remat: str,
    compute_dtype,
    batch_per_device: int,
    lengths: dict[str, int],
    head_length: int,
    accumulation: int = 1,
) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} a train step cannot do without on this mesh (docs/tpu.md, "Collectives"): fsdp's
    parameter all-gathers (a scanned layer's again for the backward pass under remat) and gradient
    reduce-scatters, the data-parallel gradient all-reduces, and tensor parallelism's activation all-reduces (two per
    row-parallel projection, three under remat; one per vocab-split table lookup and one for the head's backward)."""
    itemsize = jnp.dtype(compute_dtype).itemsize
    replicas, fsdp, tensor = mesh_shape["data"], mesh_shape["fsdp"], mesh_shape["tensor"]
    total = collections.Counter()

    def add(kind: str, count: int, size: float) -> None:
        total[kind, "count"] += count
        total[kind, "bytes"] += count * size

    recompute = remat != "none"
    for path, variable in nnx.to_flat_state(params):
        value, axes = variable.get_value(), variable.logical_axes
        used = {a for entry in value.sharding.spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
        layered = axes[0] == "layers"
        per_layer = value.shape[0] if layered else 1
        in_use = value.size // (tensor if "tensor" in used else 1) // per_layer * itemsize  # one layer's, gathered
        if "fsdp" in used:
            add("all-gather", per_layer * (1 + (layered and recompute)) * accumulation, in_use)
            add("reduce-scatter", per_layer, in_use)
            if replicas > 1:
                add("all-reduce", per_layer, in_use / fsdp)
        elif replicas * fsdp > 1:
            add("all-reduce", per_layer, in_use)
        if tensor > 1 and "tensor" in used:
            for count, tokens in _tensor_all_reduces(path, axes, value.shape, lengths, head_length, recompute):
                add("all-reduce", count * accumulation, batch_per_device * tokens * value.shape[-1] * itemsize)
    return {kind: {"count": int(total[kind, "count"]), "bytes": int(total[kind, "bytes"])} for kind in KINDS}


def _tensor_all_reduces(path, axes, shape, lengths, head_length, recompute) -> list[tuple[int, int]]:
    """(count, tokens per example) of the [batch, tokens, d] all-reduces a tensor-split parameter causes."""
    if len(axes) == 3 and axes[0] == "layers" and axes[1] in ("heads", "mlp") and axes[2] == "embed":
        tokens = lengths.get("decoder", lengths["input"]) if "decoder" in map(str, path) else lengths["input"]
        return [(shape[0] * (2 + recompute), tokens)]  # row-parallel: forward, backward, recomputed forward
    if len(axes) == 2 and axes[0] == "vocab":  # a vocab-split table: each stack's lookup, the tied head's backward
        return [(1, tokens) for tokens in lengths.values()] + [(1, head_length)]
    if len(axes) == 2 and axes[1] == "vocab":  # an untied head: its backward
        return [(1, head_length)]
    return []


def differences(measured: dict, minimum: dict, tolerance: float = TOLERANCE) -> dict[str, float]:
    """{kind: emitted bytes / minimum - 1} for the kinds that differ by more than `tolerance` (inf: none expected)."""
    off = {}
    for kind in KINDS:
        got, want = measured[kind]["bytes"], minimum[kind]["bytes"]
        if want == 0 and got > 0:
            off[kind] = math.inf
        elif want and abs(got / want - 1) > tolerance:
            off[kind] = got / want - 1
    return off


def model_parameters(graphdef, state) -> nnx.State:
    """The model's parameters (with their logical axes) of an abstract (model, optimizer) train state."""
    return nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)
