"""Mesh parsing and the logical rule table (golden parameter shardings per family: test_families.py)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from spmdlm.mesh import MeshError, make_mesh, parse_mesh, resolve_spec


@pytest.mark.parametrize("spec, expected", [
    ("data=8", {"data": 8, "fsdp": 1, "tensor": 1}),
    ("fsdp=8", {"data": 1, "fsdp": 8, "tensor": 1}),
    ("data=2,fsdp=-1", {"data": 2, "fsdp": 4, "tensor": 1}),
    ("tensor=2,data=-1", {"data": 4, "fsdp": 1, "tensor": 2}),
    ("data=2, fsdp=2, tensor=2", {"data": 2, "fsdp": 2, "tensor": 2}),
])
def test_parse_mesh(spec, expected):
    assert parse_mesh(spec, 8) == expected


@pytest.mark.parametrize("spec, message", [
    ("model=8", "unknown axis 'model'"),
    ("data=-1,fsdp=-1", "only one axis may be -1"),
    ("data=3", "needs 3 devices but 8 are available"),
    ("data=3,fsdp=-1", "not divisible"),
    ("data=8,data=1", "given twice"),
    ("data", "cannot read"),
    ("data=0", "not a size"),
])
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
    assert resolve_spec((8, 16, 3, 4), ("batch", "length", "act_heads", None), shape) == P(("data", "fsdp"), None,
                                                                                            None, None)
