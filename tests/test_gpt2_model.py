"""GPT-2 model behaviour that from-scratch implementations get wrong: causality, label alignment, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdlm.data.objectives import IGNORE_INDEX
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.engine.step import cross_entropy_sums
from spmdlm.families.gpt2.model import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=3)


@pytest.fixture(scope="module")
def model():
    return GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_changing_a_future_token_never_changes_past_logits(model):
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, 16))
    base = np.asarray(model(jnp.asarray(ids)))
    for t in range(15):
        changed = ids.copy()
        changed[0, t + 1] = (changed[0, t + 1] + 1) % CONFIG.vocab_size
        out = np.asarray(model(jnp.asarray(changed)))
        np.testing.assert_array_equal(out[0, : t + 1], base[0, : t + 1])
        assert not np.allclose(out[0, t + 1], base[0, t + 1])


def test_padding_mask_hides_padded_keys(model):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CONFIG.vocab_size, (1, 12))
    mask = np.concatenate([np.zeros((1, 4)), np.ones((1, 8))], axis=1)  # 4 left pads
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    changed = ids.copy()
    changed[0, :4] = rng.integers(0, CONFIG.vocab_size, 4)
    out_changed = np.asarray(model(jnp.asarray(changed), attention_mask=jnp.asarray(mask)))
    np.testing.assert_allclose(out_changed[0, 4:], out[0, 4:], atol=1e-6)
    unmasked = np.asarray(model(jnp.asarray(changed)))
    assert not np.allclose(unmasked[0, 4:], out[0, 4:], atol=1e-4)


def test_clm_targets_are_the_next_tokens():
    record = np.arange(10, 19, dtype=np.int32)
    example = CausalLM(block_size=8)(record, None)
    np.testing.assert_array_equal(example["input_ids"], record[:-1])
    np.testing.assert_array_equal(example["labels"], record[1:])
    with pytest.raises(ValueError, match="expected"):
        CausalLM(block_size=8)(record[:-1], None)


@pytest.mark.slow
def test_loss_is_token_weighted_and_ignores_ignored_labels():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    labels = jnp.array([[1, 2, IGNORE_INDEX], [0, IGNORE_INDEX, IGNORE_INDEX]])
    sums = cross_entropy_sums(logits, labels)
    logp = jax.nn.log_softmax(logits)
    expected = -(logp[0, 0, 1] + logp[0, 1, 2] + logp[1, 0, 0])
    np.testing.assert_allclose(sums["loss_sum"], expected, rtol=1e-6)
    assert float(sums["tokens"]) == 3.0
    # label id 0 is a real token (the HF scripts' `labels > 0` dropped it)
    assert float(cross_entropy_sums(logits[:, :1], jnp.zeros((2, 1), jnp.int32))["tokens"]) == 2.0


@pytest.mark.slow
def test_remat_with_dropout_gives_the_same_gradients():
    config = GPT2Config(
        vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=3, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)))

    def loss_and_grads(remat: str, rngs):
        model = GPT2LMHeadModel(config, rngs=nnx.Rngs(0), remat=remat)
        loss = lambda m: cross_entropy_sums(m(ids, rngs=rngs() if rngs else None), ids)["loss_sum"]
        return jax.jit(lambda m: nnx.value_and_grad(loss)(m))(model)

    key = lambda: nnx.Rngs(dropout=jax.random.key(3))
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads("none", key), loss_and_grads("full", key)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    loss_eval, _ = loss_and_grads("full", None)
    assert abs(float(loss_eval) - float(loss_a)) > 1e-3  # dropout is on only when rngs are given
