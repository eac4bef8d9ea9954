"""The LM loss's cheaper paths give the plain loss's sums and gradients: --loss_chunk_size (a chunk of positions at a
time, for every family; the compiled step holds less logit memory) and MLM's head on labelled positions only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_fixtures import ENGINE_FAMILIES, FIXTURES
from flax import nnx

from spmdlm.data.objectives import IGNORE_INDEX
from spmdlm.engine.step import Loss, loss_sums
from spmdlm.families import families


def tiny_model(family: str, **changes):
    config = families()[family].config_class.from_dict({**FIXTURES[family].tiny_config, **changes})
    return config, families()[family].make_model(config, rngs=nnx.Rngs(params=3))


def random_batch(config, family: str, length: int, rng: np.random.Generator) -> dict[str, jax.Array]:
    vocab = config.vocab_size
    ids = lambda n: rng.integers(3, vocab, (4, n)).astype(np.int32)
    labels = ids(length)
    labels[rng.random(labels.shape) < 0.3] = IGNORE_INDEX  # ignored positions must stay out of every sum
    batch = {"input_ids": ids(length), "labels": labels}
    if families()[family].is_encoder_decoder:
        batch["decoder_input_ids"] = ids(length)
    return {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ENGINE_FAMILIES)  # Llama: Qwen3 runs its code (family_fixtures.py)
def test_chunked_loss_and_gradients_equal_the_whole_sequence_ones(family):
    config, model = tiny_model(family)
    batch = random_batch(config, family, 40, np.random.default_rng(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    byte_lengths = np.random.default_rng(1).integers(0, 5, config.vocab_size).astype(np.int32)

    def grads_and_sums(chunk):
        def loss(p):
            sums = loss_sums(
                nnx.merge(graph, p, rest),
                batch,
                families()[family].forward,
                loss=Loss(z_loss=1e-3, loss_chunk=chunk),
                byte_lengths=jnp.asarray(byte_lengths),
            )
            return sums["loss_sum"] + sums["z_loss_sum"], sums

        return jax.grad(loss, has_aux=True)(params)

    # One program for both (one compilation); 12 does not divide 40: the last chunk is padded with ignored positions.
    (whole_grads, whole), (grads, sums) = jax.jit(lambda: (grads_and_sums(0), grads_and_sums(12)))()
    labels = np.asarray(batch["labels"])
    assert float(whole["tokens"]) == float((labels != IGNORE_INDEX).sum())
    assert int(whole["bytes"]) == byte_lengths[labels[labels != IGNORE_INDEX]].sum()  # bits per byte's denominator
    for key in whole:
        np.testing.assert_allclose(sums[key], whole[key], rtol=1e-5, err_msg=key)
    flat, whole_flat = jax.tree.leaves(grads), jax.tree.leaves(whole_grads)
    assert len(flat) == len(whole_flat)
    for g, w in zip(flat, whole_flat):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()) + 1e-9)


@pytest.mark.slow
def test_mlm_head_on_labelled_positions_only_equals_every_position():
    from spmdlm.data.objectives.mlm import MaskedLM

    objective = MaskedLM(128, bos_id=0, eos_id=2, pad_id=1, mask_id=4, special_ids=(0, 1, 2, 3, 4), vocab_size=512)
    capacity = objective.label_capacity
    assert capacity == 48  # 126 content tokens at p=0.15: mean 18.9, sd 4.0
    counts = [
        int((objective(np.arange(5, 131), np.random.default_rng(i))["labels"] != IGNORE_INDEX).sum())
        for i in range(2000)
    ]
    assert 10 < np.mean(counts) < 30 and max(counts) <= capacity

    config, model = tiny_model("roberta")
    rng = np.random.default_rng(1)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(rng.integers(5, config.vocab_size, (4, 40)), jnp.int32)
    sparse = np.where(rng.random((4, 40)) < 0.15, np.asarray(ids), IGNORE_INDEX)
    assert (sparse != IGNORE_INDEX).sum(-1).max() <= 12  # the gathered path
    dense_row = sparse.copy()
    dense_row[2] = np.asarray(ids[2])  # one row labels all 40 positions: more than the capacity of 12

    def grads_and_sums(labels, capacity):
        def loss(p):
            batch = {"input_ids": ids, "labels": jnp.asarray(labels, jnp.int32)}
            sums = loss_sums(
                nnx.merge(graph, p, rest),
                batch,
                families()["roberta"].forward,
                loss=Loss(label_capacity=capacity),
                byte_lengths=jnp.arange(config.vocab_size) % 7,
            )
            return sums["loss_sum"], sums

        return jax.grad(loss, has_aux=True)(params)

    for labels in (sparse, dense_row):
        (whole_grads, whole), (grads, sums) = jax.jit(
            lambda: (grads_and_sums(labels, None), grads_and_sums(labels, 12))
        )()
        assert int(sums["bytes"]) == (labels[labels != IGNORE_INDEX] % 7).sum()
        for key in whole:
            np.testing.assert_allclose(sums[key], whole[key], rtol=1e-5, err_msg=key)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()) + 1e-9)


@pytest.mark.slow
def test_chunking_shrinks_the_compiled_steps_temporaries():
    """A vocabulary much wider than the model, as in GPT-2 (50k x 768): the step's temporaries are mostly logits."""
    from spmdlm.engine.state import build_train_state
    from spmdlm.engine.step import Stepper
    from spmdlm.mesh import make_mesh

    config, _ = tiny_model("gpt2", vocab_size=8192, n_positions=256)
    family = families()["gpt2"]
    mesh = make_mesh("data=2,tensor=2", devices=jax.devices()[:4])

    graphdef, state = build_train_state(family, config, mesh, total_steps=10, abstract=True)
    spec = {k: jax.ShapeDtypeStruct((8, 256), jnp.int32) for k in ("input_ids", "labels")}
    temp = {
        chunk: Stepper(graphdef, state, mesh, family.forward, loss=Loss(loss_chunk=chunk)).compile_train(state, spec)[
            "temp_bytes"
        ]
        for chunk in (0, 32)
    }
    logits_per_device = 4 * 256 * 8192 * 4 / 2  # batch 8 over data=2, vocab over tensor=2, float32
    assert temp[0] - temp[32] > logits_per_device, temp


def test_reported_bart_metrics_leave_out_the_special_labels():
    """A hand-built batch: <s> and </s> predicted with certainty, the content wrong. The scored sums (what a BART run
    reports, as the HF script counts) cover the content tokens only; the trained loss covers every label."""
    from spmdlm.engine.step import cross_entropy_sums, head_sums

    vocab, bos, pad, eos = 6, 0, 1, 2
    labels = jnp.asarray([[bos, 3, 4, eos], [bos, 5, eos, IGNORE_INDEX]], jnp.int32)
    logits = np.zeros((2, 4, vocab), np.float32)
    for row, positions in enumerate(np.asarray(labels)):
        for t, label in enumerate(positions):
            if label in (bos, eos):
                logits[row, t, label] = 30.0  # certain and right: loss ~0
            elif label != IGNORE_INDEX:
                logits[row, t, (label + 1) % vocab] = 2.0  # wrong: loss log(e^2 + 5)
    byte_lengths = jnp.asarray([0, 0, 0, 1, 2, 4], jnp.int32)  # the specials stand for no text
    sums = cross_entropy_sums(jnp.asarray(logits), labels, unscored=(bos, pad, eos, 3 + 100), byte_lengths=byte_lengths)
    wrong = np.log(np.exp(2.0) + vocab - 1)
    assert float(sums["tokens"]) == 7 and float(sums["scored_tokens"]) == 3
    np.testing.assert_allclose(float(sums["scored_loss_sum"]) / 3, wrong, rtol=1e-6)
    np.testing.assert_allclose(float(sums["loss_sum"]) / 7, 3 * wrong / 7, rtol=1e-5)
    assert float(sums["scored_correct"]) == 0 and float(sums["correct"]) == 4
    assert int(sums["bytes"]) == int(sums["scored_bytes"]) == 1 + 2 + 4
    # the chunked path reports the same
    features = jnp.asarray(logits)
    chunked = head_sums(
        lambda x: x, features, labels, loss_chunk=3, unscored=(bos, pad, eos), byte_lengths=byte_lengths
    )
    for key in ("scored_loss_sum", "scored_tokens", "scored_correct", "loss_sum", "tokens", "bytes", "scored_bytes"):
        np.testing.assert_allclose(float(chunked[key]), float(sums[key]), rtol=1e-6, err_msg=key)


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, str]]:
    """The operand dtypes of every dot_general in a jaxpr, nested jaxprs (custom_vjp, remat, scan) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _dot_operand_dtypes(sub)
    return found


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_a_bfloat16_models_backward_runs_no_float32_matmul(family):
    """float32 logits and attention scores (for the softmaxes) must not turn the backward's GEMMs into float32 ones:
    JAX's own transpose multiplies the float32 cotangent by the bfloat16 operand, and XLA upcasts that to a float32
    GEMM (41 ms of a 230 ms GPT-2 124M step on an H200). Only T5's float32 ones-vector bias sums remain."""
    config = families()[family].config_class.from_dict(FIXTURES[family].tiny_config)
    model = families()[family].make_model(config, rngs=nnx.Rngs(params=3), dtype=jnp.bfloat16)
    batch = random_batch(config, family, 16, np.random.default_rng(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return loss_sums(nnx.merge(graph, p, rest), batch, families()[family].forward)["loss_sum"]

    dtypes = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    float32 = [d for d in dtypes if "float32" in d and d != ("float32", "float32")]
    assert len(dtypes) > 10 and not float32, float32
