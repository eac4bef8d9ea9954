"""T5 v1.1: parity with transformers' T5ForConditionalGeneration, export round trips, causality, a train step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spmdlm.families import load_config, load_pretrained_config  # noqa: E402
from spmdlm.families.t5.model import T5Config, T5ForConditionalGeneration, relative_position_buckets  # noqa: E402
from spmdlm.hf_export import load_hf, save_hf  # noqa: E402
from spmdlm.models.hf_config import ConfigError  # noqa: E402

# Odd head sizes and counts, vocabularies that are not multiples of 8, unequal encoder/decoder depths, bucket
# settings whose logarithmic range and max_distance clamp are both reached by the sequence lengths below.
HF_CONFIGS = {
    "odd-heads": dict(
        vocab_size=103,
        d_model=36,
        d_kv=12,
        d_ff=40,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=3,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
    ),
    "base-buckets": dict(
        vocab_size=212,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=3,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
    ),
    "short-distance": dict(
        vocab_size=77,
        d_model=48,
        d_kv=16,
        d_ff=56,
        num_layers=1,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=10,
        layer_norm_epsilon=1e-5,
    ),
}
ENC_LEN, DEC_LEN = 150, 136


def _random_hf_model(name: str) -> "transformers.T5ForConditionalGeneration":
    """A random HF T5 v1.1 with its own lm_head (else it is tied to shared) and non-trivial norm gains."""
    torch.manual_seed(sorted(HF_CONFIGS).index(name))
    config = transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **HF_CONFIGS[name])
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * config.d_model**-0.5)
        for param_name, param in model.named_parameters():
            if "layer_norm" in param_name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (HF model, directory it was saved to with save_pretrained)."""
    out = {}
    for name in HF_CONFIGS:
        model = _random_hf_model(name)
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def _batch(vocab_size: int, seed: int = 0, batch: int = 4, enc_len: int = ENC_LEN, dec_len: int = DEC_LEN):
    """Ids below vocab_size - 10 (the vocab is larger than needed); right and left padding on both sides."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab_size - 10, (batch, enc_len))
    dec = rng.integers(2, vocab_size - 10, (batch, dec_len))
    mask, dec_mask = np.ones_like(ids), np.ones_like(dec)
    if batch >= 4:
        mask[1, enc_len - enc_len // 4 :] = 0
        mask[2, : enc_len // 8] = 0
        dec_mask[1, dec_len - dec_len // 4 :] = 0
        dec_mask[3, : dec_len // 8] = 0
    return ids, dec, mask, dec_mask


def _hf_logits(model, ids, dec, mask, dec_mask) -> np.ndarray:
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
            decoder_attention_mask=torch.tensor(dec_mask),
        ).logits.numpy()


@jax.jit
def _forward(model, *inputs):
    return model(*inputs)  # jitted: one compile is far quicker than eager op-by-op dispatch


def _init(config: T5Config, remat: str = "none") -> T5ForConditionalGeneration:
    # Jitted, with the rbg generator: XLA:CPU compiles threefry sampling (init and dropout) several times slower.
    rngs = lambda: nnx.Rngs(jax.random.key(0, impl="rbg"))
    return nnx.jit(lambda: T5ForConditionalGeneration(config, rngs=rngs(), remat=remat))()


def _ours(model, ids, dec, mask, dec_mask) -> np.ndarray:
    return np.asarray(_forward(model, *(jnp.asarray(a) for a in (ids, dec, mask, dec_mask))))


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20), (16, 10), (33, 100), (64, 1000)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_match_transformers(buckets, max_distance, bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(1500)[None, :] - torch.arange(700)[:, None]
    expected = T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
    ).numpy()
    ours = relative_position_buckets(
        700, 1500, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
    )
    np.testing.assert_array_equal(ours, expected)


@pytest.fixture(scope="module")
def exported(hf_dirs, tmp_path_factory):
    """(original HF model, our export of its load_hf copy, the export reloaded in transformers, loading info)."""
    hf, path = hf_dirs["odd-heads"]
    model, config = load_hf(path)
    out = save_hf(model, config, tmp_path_factory.mktemp("t5-export"))
    reloaded, info = transformers.T5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    return hf, out, reloaded.eval(), info


def test_save_hf_round_trip(exported):
    hf, out, reloaded, info = exported
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] is False and written["feed_forward_proj"] == "gated-gelu"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {"shared.weight", "lm_head.weight"} <= set(f.keys())
    # transformers 5 reports tie_word_embeddings=True for every T5; what matters is that nothing is tied or scaled.
    assert not reloaded.config.scale_decoder_outputs
    assert reloaded.lm_head.weight.data_ptr() != reloaded.shared.weight.data_ptr()
    assert not torch.equal(reloaded.lm_head.weight, reloaded.shared.weight)
    original, back = hf.state_dict(), reloaded.state_dict()
    assert set(original) == set(back)
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key  # bitwise
    batch = _batch(hf.config.vocab_size, seed=2)
    np.testing.assert_allclose(_hf_logits(reloaded, *batch), _hf_logits(hf, *batch), atol=1e-5, rtol=0)


def test_generate_runs_on_exported_model(exported, hf_dirs):
    _, _, reloaded, _ = exported
    ids, _, mask, _ = _batch(reloaded.config.vocab_size, seed=3, enc_len=30, dec_len=1)
    # transformers 5.24 sizes the decoder's DynamicCache by num_layers (the encoder's depth), so cached generation
    # fails with IndexError when num_decoder_layers > num_layers; this export has 2 + 3 layers.
    with torch.no_grad():
        generated = reloaded.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=4,
            do_sample=False,
            use_cache=False,
        ).numpy()
    assert generated.shape == (4, 5) and (generated[:, 0] == 0).all()  # decoder_start_token_id from our export
    # Greedy decoding is consistent with our model's logits.
    model, _ = load_hf(hf_dirs["odd-heads"][1])
    logits = _ours(model, ids, generated[:, :-1], mask, np.ones_like(generated[:, :-1]))
    np.testing.assert_array_equal(logits.argmax(-1), generated[:, 1:])


@pytest.mark.slow
def test_fresh_tiny_model_exports_to_transformers(tmp_path):
    config = load_config("t5-v1_1-tiny")
    assert isinstance(config, T5Config) and config.num_decoder_layers == 2
    model = _init(config)
    save_hf(model, config, tmp_path)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    batch = _batch(config.vocab_size, seed=4, enc_len=40, dec_len=24)
    expected, got = _hf_logits(hf, *batch), _ours(model, *batch)
    diff = np.abs(got - expected)[batch[3].astype(bool)].max()
    print(f"fresh tiny: max |logit diff| {diff:.2e} (logits up to {np.abs(expected).max():.1f})")
    assert diff < 1e-4  # a d_model**-0.5 scaling or a tied head in transformers would be far off
    assert 0.2 < np.abs(got).std() < 5.0  # the init gives O(1) logits
    with torch.no_grad():  # equal depths: transformers' cached generation works
        generated = hf.generate(
            input_ids=torch.tensor(batch[0]), attention_mask=torch.tensor(batch[2]), max_new_tokens=3, do_sample=False
        )
    assert generated.shape == (4, 4)


@pytest.mark.slow
def test_decoder_is_causal(hf_dirs):
    model, _ = load_hf(hf_dirs["odd-heads"][1])
    ids, dec, mask, _ = _batch(103, seed=5, batch=1, enc_len=20, dec_len=12)
    length = dec.shape[1]
    # Row 0 is the original; row r changes decoder token r only, so its logits before r must not notice.
    rows = np.repeat(dec, length, axis=0)
    rows[np.arange(1, length), np.arange(1, length)] = rows[np.arange(1, length), np.arange(1, length)] % 90 + 3
    logits = _ours(model, np.repeat(ids, length, 0), rows, np.repeat(mask, length, 0), np.ones_like(rows))
    for r in range(1, length):
        np.testing.assert_allclose(logits[r, :r], logits[0, :r], atol=1e-5, rtol=0)
        assert np.abs(logits[r, r] - logits[0, r]).max() > 1e-3  # the change is visible where it should be


@pytest.mark.slow
def test_train_step_with_dropout_and_remat():
    config = load_config("t5-v1_1-tiny", num_layers=1, num_decoder_layers=1)  # one block each: compile time
    ids, dec, mask, dec_mask = (jnp.asarray(a) for a in _batch(config.vocab_size, seed=6, enc_len=32, dec_len=16))

    def loss_fn(model, rngs):
        logits = model(ids, dec, mask, dec_mask, rngs=rngs).astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), dec[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * dec_mask) / jnp.sum(dec_mask)

    @nnx.jit
    def step(model, key):
        return nnx.value_and_grad(loss_fn)(model, nnx.Rngs(dropout=key))

    model = _init(config)
    model_remat = nnx.eval_shape(lambda: T5ForConditionalGeneration(config, rngs=nnx.Rngs(0), remat="full"))
    nnx.update(model_remat, nnx.state(model))
    key, other_key = jax.random.key(1, impl="rbg"), jax.random.key(2, impl="rbg")
    (loss, grads), (loss_remat, grads_remat) = step(model, key), step(model_remat, key)
    assert np.isfinite(loss) and abs(loss - np.log(config.vocab_size)) < 2.0
    assert abs(float(step(model, other_key)[0]) - float(loss)) > 1e-4  # dropout acted
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
    leaves, leaves_remat = jax.tree.leaves(grads), jax.tree.leaves(grads_remat)
    assert all(np.isfinite(g).all() for g in leaves)
    for g, g_remat in zip(leaves, leaves_remat, strict=True):
        np.testing.assert_allclose(g_remat, g, atol=1e-5)


def test_config_checks(tmp_path):
    def read(values):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", **values}))
        return load_pretrained_config(tmp_path)

    with pytest.raises(ConfigError, match="feed_forward_proj 'relu'"):
        read({"tie_word_embeddings": False})  # transformers' default feed_forward_proj is relu
    with pytest.raises(ConfigError, match="original T5"):
        read({"feed_forward_proj": "gated-gelu"})  # tied and scaled by default
    # What transformers 5 itself writes for a v1.1 model: tie true, scale false.
    config = read(
        {
            "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": True,
            "scale_decoder_outputs": False,
            "num_layers": 3,
        }
    )
    assert not config.tie_word_embeddings and config.num_decoder_layers == 3 and config.dense_act_fn == "gelu_new"
    base = load_config("t5-v1_1-base")
    assert (base.d_model, base.d_ff, base.num_layers, base.num_decoder_layers, base.vocab_size) == (
        768,
        2048,
        12,
        12,
        32128,
    )
