"""How a checkpoint's arrays are written: a replicated array is split among its replicas for writing (orbax's
replica-parallel saving) only where each replica's slice is at least checkpoint.MIN_REPLICA_SLICE_BYTES; smaller
ones are written whole by one replica, without a jitted slice per replica. Either way they restore bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from spmdlm import checkpoint
from spmdlm.mesh import make_mesh


def test_only_replicated_arrays_with_big_slices_are_split_among_replicas(tmp_path, monkeypatch):
    mesh = make_mesh("data=8", jax.devices())
    replicated = NamedSharding(mesh, PartitionSpec())
    words = checkpoint.MIN_REPLICA_SLICE_BYTES // 4  # float32 words in one replica's slice of "big"
    tree = {
        "small": jax.device_put(jnp.arange(words, dtype=jnp.float32), replicated),  # 1/8 MiB per replica
        "big": jax.device_put(jnp.arange(8 * words, dtype=jnp.float32), replicated),
    }  # 1 MiB per replica
    sliced = []
    slice_in_dim = jax.lax.slice_in_dim

    def counting_slice(x, *args, **kwargs):
        sliced.append(x.shape)
        return slice_in_dim(x, *args, **kwargs)

    monkeypatch.setattr(jax.lax, "slice_in_dim", counting_slice)
    with ocp.StandardCheckpointer() as saver:
        saver.save(tmp_path / "state", tree)
        saver.wait_until_finished()
    assert sliced == [(8 * words,)] * 8  # each replica writes its eighth of "big"; "small" is written whole

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    with ocp.StandardCheckpointer() as loader:
        restored = loader.restore(tmp_path / "state", target)
    for name in tree:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(tree[name]), err_msg=name)
