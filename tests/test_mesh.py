"""Mesh parsing and the logical rule table (golden parameter shardings per family: test_families.py)."""

import os
import signal
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from spmdlm.mesh import MeshError, make_mesh, parse_mesh, resolve_spec, simulated_devices_flags


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data=8", {"data": 8, "fsdp": 1, "tensor": 1}),
        ("fsdp=8", {"data": 1, "fsdp": 8, "tensor": 1}),
        ("data=2,fsdp=-1", {"data": 2, "fsdp": 4, "tensor": 1}),
        ("tensor=2,data=-1", {"data": 4, "fsdp": 1, "tensor": 2}),
        ("data=2, fsdp=2, tensor=2", {"data": 2, "fsdp": 2, "tensor": 2}),
    ],
)
def test_parse_mesh(spec, expected):
    assert parse_mesh(spec, 8) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("model=8", "unknown axis 'model'"),
        ("data=-1,fsdp=-1", "only one axis may be -1"),
        ("data=3", "needs 3 devices but 8 are available"),
        ("data=3,fsdp=-1", "not divisible"),
        ("data=8,data=1", "given twice"),
        ("data", "cannot read"),
        ("data=0", "not a size"),
    ],
)
def test_parse_mesh_errors(spec, message):
    with pytest.raises(MeshError, match=message):
        parse_mesh(spec, 8)


def test_mesh_axes_are_ordered_and_auto():
    mesh = make_mesh("tensor=2,data=4")
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_resolve_spec_drops_indivisible_axes_and_fills_fsdp():
    shape = {"data": 2, "fsdp": 2, "tensor": 2}
    assert resolve_spec((64, 256), ("embed", "mlp"), shape) == P("fsdp", "tensor")
    # GPT-2's 50257-token vocab cannot be split evenly: fsdp moves to the hidden dim, tensor is dropped.
    assert resolve_spec((50257, 768), ("vocab", None), shape, fill_fsdp=True) == P(None, "fsdp")
    assert resolve_spec((50304, 768), ("vocab", None), shape, fill_fsdp=True) == P(("tensor", "fsdp"), None)
    # an untied LM head: fsdp already shards the hidden dim, so vocab takes tensor alone
    assert resolve_spec((768, 50304), ("embed", "vocab"), shape, fill_fsdp=True) == P("fsdp", "tensor")
    assert resolve_spec((768,), ("norm",), shape, fill_fsdp=True) == P(None)
    assert resolve_spec((8, 16, 3, 4), ("batch", "length", "act_heads", None), shape) == P(
        ("data", "fsdp"), None, None, None
    )


# Device 1 reaches the all-reduce 3 s after device 0, as a simulated device does on a busy host.
LATE_DEVICE = """
import time, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("data",))

def late(index):
    time.sleep(3.0 * int(index))
    return index

def local(x):
    index = jax.pure_callback(late, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("data"))
    return jax.lax.psum(x + index, "data")

f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
print(int(f(jax.device_put(jnp.zeros(2, jnp.int32), NamedSharding(mesh, P("data")))).sum()))
"""


@pytest.mark.slow
def test_a_late_simulated_device_does_not_abort_the_run():
    """XLA:CPU aborts (SIGABRT) a collective that one device reaches its terminate timeout (40 s by default) after
    another; the simulated devices' flags raise it. 1 s (after the 'stuck' warning's timeout, also 1 s here) shows the
    flag is the one that governs the abort."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda flags: subprocess.run(
        [sys.executable, "-c", LATE_DEVICE],
        env={**env, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=120,
    )
    aborted = run(
        simulated_devices_flags(
            "--xla_cpu_collective_call_terminate_timeout_seconds=1 "
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1",
            2,
        )
    )
    assert aborted.returncode == -signal.SIGABRT and "Termination timeout for `all reduce" in aborted.stderr
    assert "seconds=3600" in simulated_devices_flags("", 2)
    finished = run(simulated_devices_flags("", 2))
    assert finished.returncode == 0 and finished.stdout.split() == ["2"], finished.stderr
