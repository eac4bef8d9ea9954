"""Llama and Qwen3 against transformers (PyTorch, float32, random weights): logits with padding and with packed
documents (each run alone by transformers), and gradients. The configs exercise every option we read: grouped-query
attention (2 key/value heads for 4 query heads), head_dim other than hidden/heads, an untied head, biases on
(llama) and off (qwen3), RoPE scaled as Llama 3 (llama), QK-norm and a sliding window shorter than the sequence
(qwen3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from spmdlm import hf_export
from spmdlm.models.attention import set_attention

LENGTH = 24
CONFIGS = {
    "llama": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            # positions past 16 / low_freq_factor are "long": the scaling changes the rotations these rows see
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(
            vocab_size=103,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,  # layer 0 full, layers 1-2 sliding: two stacks
            rope_theta=1000.0,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    """(family name, transformers model, our model loaded from its save_pretrained checkpoint)."""
    hf_class, config = CONFIGS[request.param]
    torch.manual_seed(0)
    hf = hf_class(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, _ = hf_export.load_hf(path)
    return request.param, hf, ours


def torch_logits(hf, ids, mask=None) -> np.ndarray:
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return hf(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "dot_product"])
def test_logits_match_with_padding(models, implementation):
    _, hf, ours = models
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf.config.vocab_size, (3, LENGTH))
    mask = np.ones_like(ids)
    mask[1, 15:] = 0  # right padding
    mask[2, :6] = 0  # left padding (positions still count from the row's start, as transformers' forward)
    theirs = torch_logits(hf, ids, mask)
    logits = np.asarray(set_attention(ours, implementation)(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    set_attention(ours, "xla")
    valid = mask.astype(bool)
    assert np.abs(logits[valid] - theirs[valid]).max() <= 1e-5


def test_logits_of_packed_documents_match_each_alone(models):
    _, hf, ours = models
    rng = np.random.default_rng(1)
    lengths = [9, 1, 11]  # longer than the window, a one-token document, then padding
    docs = [rng.integers(0, hf.config.vocab_size, n) for n in lengths]
    ids, segments = np.zeros((1, LENGTH), np.int64), np.zeros((1, LENGTH), np.int32)
    at = 0
    for k, doc in enumerate(docs, 1):
        ids[0, at : at + len(doc)], segments[0, at : at + len(doc)] = doc, k
        at += len(doc)
    packed = np.asarray(ours(jnp.asarray(ids), segment_ids=jnp.asarray(segments)))
    at = 0
    for doc in docs:
        theirs = torch_logits(hf, doc[None])[0]
        assert np.abs(packed[0, at : at + len(doc)] - theirs).max() <= 1e-5
        at += len(doc)


@pytest.mark.slow
def test_gradients_match(models):
    _, hf, ours = models
    rng = np.random.default_rng(2)
    ids = rng.integers(0, hf.config.vocab_size, (2, LENGTH))
    mask = np.ones_like(ids)
    mask[1, 17:] = 0
    weights = rng.normal(size=(2, LENGTH, hf.config.vocab_size)).astype(np.float32) * mask[..., None]

    hf.zero_grad()
    logits = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    (logits * torch.tensor(weights)).sum().backward()
    theirs = {name: p.grad.numpy() for name, p in hf.named_parameters()}

    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
    loss = lambda p: (nnx.merge(graphdef, p, rest)(jnp.asarray(ids), attention_mask=jnp.asarray(mask)) * weights).sum()
    grads = jax.jit(jax.grad(loss))(params)  # one program, not op by op
    as_model = nnx.merge(graphdef, grads, rest)
    mine = dict(hf_export.hf_tensors(as_model))
    assert set(mine) == set(theirs)
    for name, grad in mine.items():
        scale = np.abs(theirs[name]).max()
        assert np.abs(grad - theirs[name]).max() <= 1e-4 * scale, name
