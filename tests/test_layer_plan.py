"""--remat auto and --scan_unroll auto (spmdlm/engine/plan.py), and the named remat policies they choose among."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdlm.engine.plan import NONE_BYTES_FACTOR, REMAT_MEMORY_SHARE, dots_bytes_per_token, plan_layers
from spmdlm.families import families, load_config
from spmdlm.models.stack import PER_LAYER, REMAT_POLICIES


def abstract_model(family: str, **overrides):
    config = load_config(families()[family].quickstart["config_name"], family)
    return nnx.eval_shape(lambda: families()[family].make_model(config.replace(**overrides), rngs=nnx.Rngs(0)))


def test_dots_bytes_count_every_weight_matmul_output_of_every_layer():
    model = abstract_model("gpt2")
    config = model.config
    d, layers = config.n_embd, config.n_layer
    per_layer = 3 * d + d + 4 * d + d  # fused q/k/v, attention out, MLP in (4d), MLP out
    assert dots_bytes_per_token(model, 4) == 4 * layers * per_layer


@pytest.mark.parametrize("family, remat, unroll", [("gpt2", "dots", 1), ("roberta", "none", PER_LAYER),
                                                  ("t5", "none", PER_LAYER), ("bart", "none", PER_LAYER)])  # fmt: skip
def test_auto_runs_the_hf_program_on_cpu_where_it_measured_faster(family, remat, unroll):
    """Tiny presets on CPU: per-layer arrays and nothing recomputed, except GPT-2 (fused query/key/value: slower);
    on a TPU always the scan with dots."""
    model = abstract_model(family)
    plan = plan_layers("auto", "auto", model, platform="cpu", itemsize=4, tokens_per_device=256, memory_bytes=2**34)
    assert (plan.remat, plan.scan_unroll) == (remat, unroll)
    assert set(plan.reasons) == {"remat", "scan_unroll"}
    on_tpu = plan_layers("auto", "auto", model, platform="tpu", itemsize=2, tokens_per_device=256, memory_bytes=2**34)
    assert (on_tpu.remat, on_tpu.scan_unroll) == ("dots", 1) and "GPU or TPU" in on_tpu.reasons["scan_unroll"]


@pytest.mark.parametrize("family, width, hf_program", [("t5", 768, True), ("roberta", 768, False), ("bart", 768, False),
                                                       ("roberta", 256, True)])  # fmt: skip
def test_the_hf_program_at_base_width_only_for_the_gated_mlp(family, width, hf_program):
    """At d_model 768 (the peers' base sizes) only T5 v1.1 measured faster per-layer without remat."""
    names = {"t5": "d_model", "bart": "d_model", "roberta": "hidden_size"}
    model = abstract_model(family, **{names[family]: width})
    plan = plan_layers("auto", "auto", model, platform="cpu", itemsize=4, tokens_per_device=512, memory_bytes=2**34)
    assert (plan.scan_unroll == PER_LAYER, plan.remat == "none") == (hf_program, hf_program)


def test_the_hf_program_needs_room_for_what_none_keeps_and_both_flags_auto():
    model = abstract_model("t5")
    need = NONE_BYTES_FACTOR * dots_bytes_per_token(model, 4) * 256
    plan = lambda remat="auto", unroll="auto", memory=2**34: plan_layers(
        remat, unroll, model, platform="cpu", itemsize=4, tokens_per_device=256, memory_bytes=memory
    )
    assert plan(memory=int(need / REMAT_MEMORY_SHARE) + 1).scan_unroll == PER_LAYER
    tight = plan(memory=int(need / REMAT_MEMORY_SHARE) - 1)
    assert (tight.remat, tight.scan_unroll) == ("dots", 0)  # the stacked unroll of small encoder-decoders
    assert plan(remat="none").record() == {
        "remat": "none",
        "scan_unroll": PER_LAYER,
        "auto": {"scan_unroll": "per_layer (each layer its own arrays, unrolled): a gated MLP on CPU"},
    }
    assert (plan(remat="dots").scan_unroll, plan(unroll="1").remat) == (0, "dots")
    deep = abstract_model("t5", num_layers=13, num_decoder_layers=13)
    deep_plan = plan_layers("auto", "auto", deep, platform="cpu", itemsize=4, tokens_per_device=256, memory_bytes=None)
    assert (deep_plan.remat, deep_plan.scan_unroll) == ("dots", 1)


def test_auto_keeps_deep_encoder_decoders_scanned():
    plan = plan_layers(
        "dots",
        "auto",
        abstract_model("t5", num_layers=13, num_decoder_layers=13),
        platform="cpu",
        itemsize=4,
        tokens_per_device=256,
        memory_bytes=None,
    )
    assert plan.scan_unroll == 1 and "more than 12 layers" in plan.reasons["scan_unroll"]
    wide = plan_layers(
        "dots",
        "auto",
        abstract_model("t5", d_model=512),
        platform="cpu",
        itemsize=4,
        tokens_per_device=256,
        memory_bytes=None,
    )
    assert wide.scan_unroll == 1 and "wider than 256" in wide.reasons["scan_unroll"]


def test_auto_takes_full_remat_when_dots_would_not_fit():
    model = abstract_model("gpt2")
    need = dots_bytes_per_token(model, 4) * 1024
    fits = plan_layers(
        "auto",
        "1",
        model,
        platform="gpu",
        itemsize=4,
        tokens_per_device=1024,
        memory_bytes=int(need / REMAT_MEMORY_SHARE) + 1,
    )
    tight = plan_layers(
        "auto",
        "1",
        model,
        platform="gpu",
        itemsize=4,
        tokens_per_device=1024,
        memory_bytes=int(need / REMAT_MEMORY_SHARE) - 1,
    )
    assert (fits.remat, tight.remat) == ("dots", "full")
    assert "exceed 50% of its memory" in tight.reasons["remat"]


def test_explicit_flags_win_and_are_not_explained():
    plan = plan_layers(
        "none", "3", abstract_model("t5"), platform="cpu", itemsize=4, tokens_per_device=10**9, memory_bytes=1
    )
    assert (plan.remat, plan.scan_unroll, plan.reasons) == ("none", 3, {})
    assert plan.record() == {"remat": "none", "scan_unroll": 3, "auto": {}}


@functools.cache
def t5_gradients(remat: str) -> tuple[np.ndarray, ...]:
    """The parameters' gradients of a T5 (gated MLP, bias, cross-attention) under `remat`, by one compiled program
    (as a run computes them; each policy's program compiled once, the reference's once per process)."""
    config = load_config(families()["t5"].quickstart["config_name"], "t5")
    batch = {
        "input_ids": jnp.asarray(np.arange(24).reshape(2, 12) % 50 + 3),
        "decoder_input_ids": jnp.asarray(np.arange(10).reshape(2, 5) % 50 + 3),
    }
    graph, params, rest = nnx.split(families()["t5"].make_model(config, rngs=nnx.Rngs(0), remat=remat), nnx.Param, ...)
    loss = lambda p: jnp.mean(jnp.square(nnx.merge(graph, p, rest)(**batch)))
    return tuple(np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params)))


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(set(REMAT_POLICIES) - {"none"}))
def test_every_named_policy_gives_the_gradients_of_no_remat(policy):
    """What a policy saves changes memory and recomputation, never the gradients."""
    for ours, reference in zip(t5_gradients(policy), t5_gradients("none"), strict=True):
        np.testing.assert_allclose(ours, reference, rtol=2e-5, atol=1e-6)
