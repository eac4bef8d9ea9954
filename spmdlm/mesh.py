"""Device mesh from `--mesh data=8,fsdp=-1,tensor=1`, and the one logical-axis rule table.

The mesh always has the three axes ("data", "fsdp", "tensor") in that order (unnamed ones get size 1), so every
rule below is valid on every mesh and a PartitionSpec never names a missing axis.
"""

from __future__ import annotations

import math
import os
import re

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from spmdlm.errors import MeshError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both: fsdp is data parallelism with sharded weights

# Logical axis name -> mesh axis (or axes). Parameters and activations use separate names so that e.g. the hidden
# size of a weight can be fsdp-sharded while activations keep it whole.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("embed", "fsdp"),
    ("vocab", ("tensor", "fsdp")),  # embedding tables: vocab dim only (a sharded hidden dim breaks the gather)
    ("mlp", "tensor"),
    ("heads", "tensor"),  # fused heads*head_dim output of q/k/v, input of the attention output projection
    ("kv", None),
    ("qkv", None),  # the 3 of GPT-2's fused c_attn
    ("norm", None),
    ("positions", None),
    ("relpos_buckets", None),
    ("layers", None),  # the stacked axis of scanned layers: never sharded (each device runs every layer)
    # activations
    ("batch", BATCH_AXES),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
)
_RULES = dict(LOGICAL_RULES)


def _given_sizes(spec: str, flag: str = "--mesh") -> dict[str, int]:
    """The axis=size pairs of a --mesh value as written (-1 kept), with one-line errors."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
        if not m:
            raise MeshError(f"{flag}: cannot read {part!r}; write axis=size pairs such as 'data=2,fsdp=4'")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise MeshError(f"{flag}: unknown axis {name!r}; the axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise MeshError(f"{flag}: axis {name!r} is given twice")
        if size == 0 or size < -1:
            raise MeshError(f"{flag}: {name}={size} is not a size; use a positive number or -1 for 'the rest'")
        sizes[name] = size
    if not sizes:
        raise MeshError(f"{flag} is empty; give e.g. 'data=-1' to use every device for data parallelism")
    return sizes


def parse_mesh(spec: str, device_count: int, *, flag: str = "--mesh", unit: str = "devices") -> dict[str, int]:
    """'data=2,fsdp=-1' -> {'data': 2, 'fsdp': 4, 'tensor': 1} for 8 devices, with one-line errors."""
    sizes = _given_sizes(spec, flag)
    wildcards = [n for n, s in sizes.items() if s == -1]
    if len(wildcards) > 1:
        raise MeshError(f"{flag}: only one axis may be -1, got {', '.join(wildcards)}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if wildcards:
        if device_count % fixed:
            raise MeshError(f"{flag} {spec!r}: {device_count} {unit} are not divisible by the fixed axes' {fixed}")
        sizes[wildcards[0]] = device_count // fixed
    elif fixed != device_count:
        raise MeshError(
            f"{flag} {spec!r} needs {fixed} {unit} but {device_count} are available; "
            f"make the sizes multiply to {device_count} or use -1 for one axis"
        )
    return {name: sizes.get(name, 1) for name in MESH_AXES}


def make_mesh(spec: str = "data=-1", devices: list | None = None, dcn_spec: str | None = None) -> Mesh:
    """The ("data", "fsdp", "tensor") mesh of `spec` over `devices` (default: all of them).

    Devices of several slices (a multi-slice TPU job, or --compile_for ... --num_slices K) get a hybrid mesh:
    `dcn_spec` (default `data=K`) says how many of each axis's devices sit in different slices; those are the outer
    part of the axis, so only the data-parallel (or fsdp) reduction crosses the slow data-centre network.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes, dcn = plan_mesh(spec, dcn_spec, devices)
    if dcn is None:
        # Topology-aware device order on TPU/GPU (neighbours on the fast axes); a plain reshape elsewhere.
        grid = mesh_utils.create_device_mesh([sizes[a] for a in MESH_AXES], devices, allow_split_physical_axes=True)
    else:
        grid = mesh_utils.create_hybrid_device_mesh(
            [sizes[a] // dcn[a] for a in MESH_AXES],
            [dcn[a] for a in MESH_AXES],
            devices,
            allow_split_physical_axes=True,
        )
    # Auto axes: Explicit (jax.make_mesh's default here) breaks the embedding gather (docs/architecture.md §3).
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def slice_count(devices) -> int:
    """Slices the devices belong to (TPU multi-slice: the `slice_index` of each device); 1 elsewhere."""
    return len({getattr(d, "slice_index", None) or 0 for d in devices}) or 1


def plan_mesh(spec: str, dcn_spec: str | None, devices) -> tuple[dict[str, int], dict[str, int] | None]:
    """-> (mesh sizes, their across-slice part or None for one slice), with one-line errors; `spec` is the whole
    mesh (its sizes multiply to the number of devices), `dcn_spec` the part of it that spans slices."""
    devices = list(devices)
    sizes = parse_mesh(spec, len(devices))
    slices = slice_count(devices)
    if slices == 1:
        if dcn_spec and any(size > 1 for size in _given_sizes(dcn_spec, "--dcn_mesh").values()):
            raise MeshError(
                f"--dcn_mesh {dcn_spec!r} spans several slices but the {len(devices)} devices are one "
                "slice; leave it out (with --compile_for, give --num_slices)"
            )
        return sizes, None
    if dcn_spec is None:
        axis = next((a for a in BATCH_AXES if sizes[a] % slices == 0), None)
        if axis is None:
            raise MeshError(
                f"--mesh {spec!r} over {slices} slices: neither data ({sizes['data']}) nor fsdp "
                f"({sizes['fsdp']}) is a multiple of {slices}; make one of them so, or give --dcn_mesh"
            )
        dcn_spec = f"{axis}={slices}"
    dcn = parse_mesh(dcn_spec, slices, flag="--dcn_mesh", unit="slices")
    if dcn["tensor"] > 1:
        raise MeshError(
            f"--dcn_mesh {dcn_spec!r}: tensor parallelism across slices would put every layer's "
            "collectives on the data-centre network; span slices with data (or fsdp)"
        )
    for axis in BATCH_AXES:
        if sizes[axis] % dcn[axis]:
            raise MeshError(
                f"--dcn_mesh {dcn_spec!r}: {axis}={dcn[axis]} slices does not divide --mesh "
                f"{axis}={sizes[axis]}; --mesh gives the whole mesh, --dcn_mesh the part of it across "
                "slices"
            )
    return sizes, dcn


def requested_device_count(spec: str) -> int | None:
    """Devices a mesh spec needs, or None when it has a -1 (it adapts) or is malformed (parse_mesh reports it)."""
    try:
        sizes = _given_sizes(spec)
    except MeshError:
        return None
    return None if -1 in sizes.values() else math.prod(sizes.values())


def skip_absent_tpu() -> bool:
    """With libtpu installed (e.g. `pip install -e '.[tpu]'` for --compile_for) on a machine without a TPU, JAX would
    still try its TPU backend first, and libtpu prints errors while it fails. Where no TPU chip and no GPU is on the
    PCI bus (what JAX itself checks, without starting anything), use the CPU backend directly. JAX_PLATFORMS (or
    JAX_FORCE_TPU_INIT), when set, wins. Must run before JAX initialises its backends. True if it chose CPU."""
    import importlib.util

    if (
        os.environ.get("JAX_PLATFORMS", "").strip()
        or "JAX_FORCE_TPU_INIT" in os.environ
        or importlib.util.find_spec("libtpu") is None
    ):
        return False
    from jax._src import hardware_utils

    if (
        hardware_utils.num_available_tpu_chips_and_device_id()[0]
        or hardware_utils.has_visible_nvidia_gpu()
        or hardware_utils.num_available_amd_gpus(stop_at=1)
    ):
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes; this one read the variable when jax was imported
    jax.config.update("jax_platforms", "cpu")
    return True


# XLA:CPU aborts the process (SIGABRT, "Termination timeout for `all reduce ...` of 40 seconds exceeded") when one
# simulated device reaches a collective 40 s after another, as on a busy host in a long evaluation. The devices are
# threads of this one process, so a late one is slow, not lost: it may be up to an hour late.
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=3600"


def simulated_devices_flags(flags: str, count: int) -> str:
    """XLA_FLAGS `flags` plus those that simulate `count` host devices (the collectives' patience included)."""
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        flags = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}"
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def simulate_cpu_devices(count: int) -> bool:
    """Ask XLA for `count` host devices; must run before JAX initialises its backends. True if the flag was set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return False
    os.environ["XLA_FLAGS"] = simulated_devices_flags(flags, count)
    return True


def resolve_spec(
    shape: tuple[int, ...], logical_axes: tuple[str | None, ...], mesh_shape: dict[str, int], fill_fsdp: bool = False
) -> PartitionSpec:
    """Logical axes -> PartitionSpec on this mesh.

    Mesh axes of size 1 are dropped, and so is an axis that does not divide its dimension (jit needs even shards:
    e.g. GPT-2's vocab 50257) or already shards another one. With `fill_fsdp` (parameters), if fsdp is then unused
    by a matrix, it shards the largest free dimension it divides, so fsdp shards every weight matrix it can.
    Vectors (biases, norm scales) stay replicated.
    """
    spec: list[tuple[str, ...]] = []
    used: set[str] = set()  # a mesh axis shards at most one dimension
    for dim, name in zip(shape, logical_axes, strict=True):
        wanted = _RULES[name] if name is not None else None
        wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted or ())
        kept: list[str] = []
        for axis in wanted:
            size = mesh_shape.get(axis, 1)
            if size > 1 and axis not in used and dim % (math.prod(mesh_shape[a] for a in kept) * size) == 0:
                kept.append(axis)
        used.update(kept)
        spec.append(tuple(kept))
    fsdp = mesh_shape.get("fsdp", 1)
    if fill_fsdp and fsdp > 1 and len(shape) >= 2 and not any("fsdp" in s for s in spec):
        free = [i for i, s in enumerate(spec) if not s and shape[i] % fsdp == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = ("fsdp",)
    return PartitionSpec(*(s[0] if len(s) == 1 else (s or None) for s in spec))


def idle_axes(state, mesh: Mesh) -> list[str]:
    """The parameter axes (fsdp, tensor) of size > 1 that shard no array of `state`: a dimension they could split
    is not divisible by their size."""
    used = set()
    for leaf in jax.tree.leaves(state):
        for entry in leaf.sharding.spec:
            used.update((entry,) if isinstance(entry, str) else entry or ())
    return [axis for axis in ("fsdp", "tensor") if mesh.shape[axis] > 1 and axis not in used]


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_axis_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def constrain(x: jax.Array, *logical_axes: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside a mesh (e.g. unsharded eval)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, resolve_spec(x.shape, logical_axes, dict(mesh.shape)))


def gathered_for_use(param: jax.Array, *logical_axes: str | None) -> jax.Array:
    """A parameter as a computation reads it: its tensor-parallel split kept, its fsdp shards gathered. fsdp shards
    are storage (a weight is all-gathered for its use, as XLA does for every matmul weight); a table looked up with a
    gather must be gathered explicitly, or XLA lets the fsdp-split table dimension decide the lookup's output layout
    and then fully rematerialises it to reach the batch layout. A no-op outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return param
    in_use = {**dict(mesh.shape), "fsdp": 1}  # resolve_spec drops axes of size 1
    return jax.lax.with_sharding_constraint(param, resolve_spec(param.shape, logical_axes, in_use))
