"""--scan_unroll per_layer: the layers own their parameters (one array per layer, as the HF Flax models keep them)
and compute what the scanned stack computes; checkpoints stay in the stacked format, so either layout restores the
other's."""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdlm import checkpoint
from spmdlm.engine.plan import plan_layers
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.families import get_family, load_config
from spmdlm.mesh import make_mesh
from spmdlm.models.stack import PER_LAYER, LayerStack, restack, stack_layers
from spmdlm.run_args.choices import parse_scan_unroll

BART = get_family("bart")
TINY_BART = load_config("bart-tiny", "bart").replace(
    vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
)  # fmt: skip


def pure(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def assert_same(got: dict, want: dict, atol: float = 0.0):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=key)


@pytest.mark.slow
def test_per_layer_stack_gives_the_scanned_logits_and_gradients():
    """An encoder-decoder (BART: cross-attention, the decoder's map over layers) in both layouts, same seed: the
    per-layer parameters are the stacked ones' slices, and logits and gradients agree."""
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 12)))
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "decoder_input_ids": ids}

    def logits_and_grads(unroll):
        model = BART.make_model(TINY_BART, rngs=nnx.Rngs(0), scan_unroll=unroll)
        stacks = [node for _, node in nnx.iter_graph(model) if isinstance(node, LayerStack)]
        assert [stack.per_layer for stack in stacks] == [unroll == PER_LAYER] * 2
        params = nnx.state(model, nnx.Param)
        graphdef = nnx.graphdef(model)

        def loss(params):
            logits = nnx.merge(graphdef, params)(**batch)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5]), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        stacked = [pure(stack_layers(nnx.to_pure_dict(tree))) for tree in (params, grads)]
        return stacked[0], np.asarray(logits), stacked[1]

    (params, logits, grads), (scanned_params, scanned_logits, scanned_grads) = map(logits_and_grads, (PER_LAYER, 1))
    assert_same(params, scanned_params)
    np.testing.assert_allclose(logits, scanned_logits, atol=1e-5, rtol=0)
    assert_same(grads, scanned_grads, atol=1e-6)


def test_auto_picks_per_layer_only_with_nothing_recomputed():
    """With a recomputing remat per-layer measured slower than the scanned and the stacked-unrolled step on CPU
    (benchmarks/README.md); auto takes it only as the HF program (remat none), and only on CPU."""
    assert parse_scan_unroll("per_layer") == PER_LAYER
    abstract = nnx.eval_shape(lambda: BART.make_model(TINY_BART, rngs=nnx.Rngs(0)))
    for platform in ("cpu", "gpu"):
        plan = plan_layers(
            "dots", "auto", abstract, platform=platform, itemsize=4, tokens_per_device=8, memory_bytes=None
        )
        assert plan.scan_unroll != PER_LAYER
    assert plan_layers("dots", "per_layer", abstract, platform="cpu", itemsize=4, tokens_per_device=8,
                       memory_bytes=None).scan_unroll == PER_LAYER  # fmt: skip
    hf_program = [
        plan_layers("auto", "auto", abstract, platform=p, itemsize=4, tokens_per_device=8, memory_bytes=None)
        for p in ("cpu", "gpu")
    ]
    assert [(p.remat, p.scan_unroll) for p in hf_program] == [("none", PER_LAYER), ("dots", 1)]


@pytest.mark.slow
def test_checkpoints_restore_across_layouts_and_export_restacks(tmp_path):
    """A train state saved per-layer restores into a scanned one and back (model and optimizer), array for array;
    restack (the end-of-training export) returns the stacked model."""
    mesh = make_mesh("data=1", jax.devices()[:1])
    per_layer = build_train_state(BART, TINY_BART, mesh, seed=1, compute=Compute(scan_unroll=PER_LAYER))
    scanned = build_train_state(BART, TINY_BART, mesh, seed=2, compute=Compute(scan_unroll=1))
    with jax.set_mesh(mesh):
        for name, (source, (_, target)) in {"a": (per_layer, scanned), "b": (scanned, per_layer)}.items():
            manager = checkpoint.make_manager(tmp_path / name, async_save=False)
            checkpoint.save(manager, 1, source[1], iter(grain.MapDataset.range(2).to_iter_dataset()), {})
            manager.wait_until_finished()
            restored, _ = checkpoint.restore(manager, 1, checkpoint.abstract_of(target))
            checkpoint.close(manager)
            assert_same(pure(stack_layers(nnx.to_pure_dict(restored))), pure(stack_layers(nnx.to_pure_dict(source[1]))))
            assert jax.tree.structure(nnx.to_pure_dict(restored)) == jax.tree.structure(nnx.to_pure_dict(target))
        model = restack(nnx.merge(*per_layer)[0])
        stacked = nnx.merge(*build_train_state(BART, TINY_BART, mesh, seed=1, compute=Compute(scan_unroll=1)))[0]
        assert_same(pure(nnx.to_pure_dict(nnx.state(model))), pure(nnx.to_pure_dict(nnx.state(stacked))))
