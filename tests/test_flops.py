"""spmdlm.flops: the analytic training FLOPs of each family against what the compiled train step does.

Two checks per family, on tiny configs:
1. The matmuls of the traced train step (every dot_general of its jaxpr, 2·M·N·K each) equal the formula exactly
   once causal attention is counted as the full square the einsum implementation computes.
2. XLA's `cost_analysis()` of the compiled step lies within [1, 1 + XLA_OVERHEAD] of the analytic (MFU) figure.
   XLA counts more than the model FLOPs, for three reasons: it counts every elementwise op (norms, GELU, softmax,
   dropout, the loss's logsumexp over the vocabulary and the AdamW update of every parameter, ~10-20 FLOPs each);
   it counts the masked half of causal attention, which our dense einsum attention computes and the MFU convention
   leaves out; and on a data-parallel mesh every device applies the optimizer update to its full replica. Both count
   a multiply-add as 2 FLOPs. At these tiny sizes (d_model 64-128) the elementwise share is large: measured ratios
   XLA/analytic are 1.07 (GPT-2 here) and 1.18 (T5 here), against 1.02 for a d_model-768 GPT-2 at length 256.
   T5's dropout is off: XLA would also count the integer ops of the dropout RNG (+8% here).
Nothing here asserts on time.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from spmdlm import devices, flops
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.pipeline import batch_spec
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Stepper
from spmdlm.families import families, get_family, load_config, objective_for_shapes
from spmdlm.mesh import make_mesh

XLA_OVERHEAD = 0.3  # XLA may count up to 30% more than the model FLOPs on these tiny configs (see above)


def family_case(family: str):
    """The family's tiny preset cut to one or two layers (dropout off: XLA would count the RNG), length 64."""
    config = load_config(families()[family].quickstart["config_name"])
    layers = {
        "n_layer": 2,
        "num_layers": 1,
        "num_decoder_layers": 1,
        "num_hidden_layers": 2,
        "encoder_layers": 1,
        "decoder_layers": 1,
    }
    off = {
        "dropout_rate": 0.0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
    }
    fields = set(config.__dataclass_fields__)
    config = config.replace(**{k: v for k, v in {**layers, **off}.items() if k in fields})
    return config, objective_for_shapes(families()[family], config, 64)


def compile_step(config, objective, global_batch: int, mesh):
    # Unrolled layers: XLA's cost analysis counts a while loop's body once, not once per layer. Nothing recomputed
    # (remat none): the formulas count the model's FLOPs, not the recomputation of --remat dots.
    family = get_family(config.model_type)
    graphdef, state = build_train_state(
        family, config, mesh, total_steps=10, compute=Compute(remat="none", scan_unroll=0)
    )
    stepper = Stepper(graphdef, state, mesh, family.forward)
    spec = batch_spec(objective, global_batch)
    stats = stepper.compile_train(state, spec)
    return stepper, state, spec, stats


def test_gpt2_formula_by_hand():
    config = SimpleNamespace(model_type="gpt2", n_embd=8, n_layer=2, n_head=2, n_inner=None, vocab_size=100)
    seq, batch = 10, 3
    d = 8
    per_layer = 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * 4 * d  # qkv, out, fc, proj
    attention = 2 * 2 * seq * d / 2  # scores + values, causal half
    per_token = 2 * (per_layer + attention) + 2 * d * 100  # two layers + LM head
    assert get_family("gpt2").train_flops_per_step(config, CausalLM(seq), batch) == pytest.approx(
        3 * batch * seq * per_token
    )


def test_t5_formula_by_hand():
    config = SimpleNamespace(
        model_type="t5",
        d_model=8,
        d_kv=2,
        num_heads=2,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=2,
        vocab_size=50,
        feed_forward_proj="gated-gelu",
    )
    objective = SimpleNamespace(sequence_lengths=lambda: {"input": 6, "decoder": 3})
    d, inner, ff, enc, dec = 8, 4, 16, 6, 3
    encoder = enc * (4 * 2 * d * inner + 4 * enc * inner + 3 * 2 * d * ff)
    decoder = dec * 2 * (4 * 2 * d * inner + 4 * dec * inner / 2 + 3 * 2 * d * ff)
    cross = 2 * (dec * (2 * 2 * d * inner + 4 * enc * inner) + enc * 2 * 2 * d * inner)
    head = dec * 2 * d * 50
    assert get_family("t5").train_flops_per_step(config, objective, 2) == pytest.approx(
        3 * 2 * (encoder + decoder + cross + head)
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_analytic_flops_match_the_compiled_step(family):
    """On a data-parallel mesh of all devices (8 simulated in tests): XLA's per-device count × devices."""
    config, objective = family_case(family)
    mesh = make_mesh("data=-1")
    global_batch = 2 * mesh.size
    stepper, state, spec, stats = compile_step(config, objective, global_batch, mesh)
    analytic = get_family(family).train_flops_per_step(config, objective, global_batch)
    dense_attention = get_family(family).train_flops_per_step(config, objective, global_batch, full_causal_square=True)

    # 1. exact: what the traced step multiplies (the step function is Stepper's own, traced without compiling)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(stepper.train_fn)(state, spec, jax.ShapeDtypeStruct((), jnp.int32))
    assert flops.jaxpr_matmul_flops(jaxpr) == pytest.approx(dense_attention, rel=1e-9)

    # 2. XLA's count: more than the model FLOPs (elementwise, optimizer, masked causal half), within the tolerance
    assert stats["xla_flops_per_device"] is not None
    ratio = stats["xla_flops_per_device"] * mesh.size / analytic
    assert 1.0 <= ratio <= 1 + XLA_OVERHEAD, ratio


def test_peak_table():
    assert devices.chip("TPU v4").peak_flops == 275e12
    assert devices.chip("TPU v5 lite").peak_flops == 197e12
    assert devices.chip("TPU v5p").peak_flops == 459e12
    assert devices.chip("TPU v6 lite").peak_flops == 918e12
    assert devices.chip("NVIDIA A100-SXM4-80GB").peak_flops == 312e12
    assert devices.chip("NVIDIA H100 80GB HBM3").peak_flops == 989e12
    assert devices.chip("NVIDIA H200").peak_flops == 989e12
    assert devices.chip("cpu") is None


def test_cpu_peak_is_measured_once():
    first = devices.peak_flops_per_device("float32")
    assert first is not None and math.isfinite(first) and first > 0
    assert devices.peak_flops_per_device(jnp.float32) == first  # cached: same measurement, whatever the dtype spelling
    assert first == pytest.approx(devices.measure_cpu_matmul_flops("float32") / jax.local_device_count())


def test_mfu():
    assert flops.mfu(1e12, 2.0, 4, 1e11) == pytest.approx(1.25)
    assert flops.mfu(1e12, 2.0, 4, None) is None
