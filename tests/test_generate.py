"""Generation (spmdlm.generate): greedy tokens equal transformers' generate token for token (GPT-2, T5, BART; batched
with padding and one by one), the KV cache equals a full recompute, the decode loop compiles once, sampling is
seeded and filters exactly, fill-mask equals transformers' pipeline, and the command line.

Models are tiny and random (see `random_model`), each exported with `save_hf` (weights, config, generation config
and tokenizer), which transformers then loads. Most generation calls share a few shapes (a batch of ten, or of four
on an 8-device mesh) so that the file compiles little.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import FIXTURES as DATA
from conftest import run_argv
from flax import nnx

from spmdlm import hf_export
from spmdlm.cli.generate import main
from spmdlm.data.tokenization import special_token_ids, train_tokenizer
from spmdlm.families import get_family
from spmdlm.families.base import Generation
from spmdlm.generation import GenerateError, decoding, fill_mask, generate, generate_ids
from spmdlm.generation.sampling import Sampling, choose, filter_logits
from spmdlm.mesh import make_mesh
from spmdlm.models.layers import Scale

WORDS = "cat dog bird fish tree rock river cloud stone green red blue small big old new runs sees the a of and".split()
CONFIGS = {
    "gpt2": dict(
        vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "t5": dict(
        vocab_size=420,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        tie_word_embeddings=False,
    ),
    "bart": dict(
        vocab_size=320,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    ),
    # grouped-query attention, head_dim other than hidden/heads, an untied head, Llama 3's RoPE scaling
    "llama": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500.0,
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8,
        ),
    ),
    # QK-norm and, from layer 1 on, a window of 4 tokens: shorter than the prompts plus the new tokens
    "qwen3": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    ),
    "roberta": dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=66,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
    ),
}
PROMPTS = [
    "the cat",
    "a big old dog sees the river",
    "fish",
    "green",
    "the small bird of the blue cloud runs",
    "stone and rock",
    "a tree",
    "the red fish sees a new stone and the old",
    "cloud",
    "dog runs",
]
NEW_TOKENS = 8


def corpus(n=300, seed=0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(4, 12))) for _ in range(n)]


def random_model(family, config):
    """Parameters drawn from numpy (no compilation): norm gains near 1, embeddings smaller than the rest, so that the
    random models continue each prompt differently rather than repeat what they read through tied embeddings."""
    model = nnx.eval_shape(lambda: family.make_model(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            noise = rng.normal(0, 0.05 if "embed" in str(path) else 0.3, var.shape).astype(np.float32)
            var.set_value(jnp.asarray(noise + (1 if isinstance(var, Scale) else 0)))
    return model


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """family -> (model, config, tokenizer, export dir), built on first use."""

    @functools.cache
    def get(family_name):
        family = get_family(family_name)
        tokenizer = train_tokenizer(family, corpus(), 300)
        config = family.config_class.from_dict(CONFIGS[family_name])
        config = config.replace(
            **{
                f"{role}_token_id": i
                for role, i in special_token_ids(tokenizer, family).items()
                if i is not None and hasattr(config, f"{role}_token_id")
            }
        )  # as training does
        model = random_model(family, config)
        return (
            model,
            config,
            tokenizer,
            hf_export.save_hf(model, config, tmp_path_factory.mktemp(family_name), tokenizer=tokenizer),
        )

    return get


def through_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


@functools.cache
def hf_model(path, config):
    model = (
        transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
        if config.is_encoder_decoder
        else transformers.AutoModelForCausalLM.from_pretrained(path)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if not config.is_encoder_decoder:
        tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    return model.eval(), tokenizer


def hf_greedy(path, config, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy new tokens for `prompts` as one padded batch (decoder-only: left padding)."""
    model, tokenizer = hf_model(path, config)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        # ids the tokenizer never assigned (the model's vocabulary is larger) are never chosen, as in ours
        out = model.generate(
            **batch,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            pad_token_id=tokenizer.pad_token_id,
            suppress_tokens=list(range(len(tokenizer), config.vocab_size)) or None,
        )
    new = out[:, 1 if config.is_encoder_decoder else batch["input_ids"].shape[1] :].tolist()
    return [through_eos(row, config.eos_token_id) for row in new]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5", "bart", "llama", "qwen3"])
def test_greedy_equals_transformers_batched_and_alone(family, exports):
    """Ten prompts of different lengths in one padded batch, against transformers' padded batch and against each
    prompt alone (no padding). GPT-2 also alone on our side; the others' batch of one is the same code (their
    decoders have no padding), so it is left out here to save its compilation."""
    model, config, tokenizer, path = exports(family)
    ours = generate_ids(model, config, tokenizer, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert ours == hf_greedy(path, config, PROMPTS)
    assert len({tuple(row) for row in ours}) > 3 and any(len(set(row)) > 2 for row in ours)  # not degenerate
    assert [hf_greedy(path, config, [p])[0] for p in PROMPTS[:5]] == ours[:5]
    if family == "gpt2":
        assert [generate_ids(model, config, tokenizer, [p], max_new_tokens=NEW_TOKENS)[0] for p in PROMPTS[:5]] == ours[
            :5
        ]
    # top-k = 1 keeps only the most likely token, whatever the temperature: greedy
    assert (
        generate_ids(model, config, tokenizer, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=1, seed=7)
        == ours
    )
    if family == "bart":  # forced_eos_token_id: the last new token is EOS (as transformers' generate)
        assert all(row[-1] == config.eos_token_id for row in ours)


@pytest.mark.slow
def test_ids_the_tokenizer_never_assigned_are_never_chosen(exports):
    """The model's vocabulary (320) is larger than the tokenizer's (300); a model whose unassigned rows dominate
    would otherwise continue with ids that decode to nothing."""
    model, config, tokenizer, _ = exports("gpt2")
    assigned = tokenizer.get_vocab_size()
    assert assigned < config.vocab_size
    graph, params = nnx.split(model)
    loud = nnx.merge(graph, jax.tree.map(lambda x: x, params))
    table = np.array(loud.wte.embedding[...])
    table[assigned:] *= 50.0  # tied head: these ids now win every argmax
    loud.wte.embedding.set_value(jnp.asarray(table))
    for settings in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=1.0, top_k=5, seed=4)):
        rows = generate_ids(loud, config, tokenizer, PROMPTS[:4], max_new_tokens=8, **settings)
        assert all(0 <= i < assigned for row in rows for i in row), settings


def test_gpt2_text_and_samples(exports):
    """Batches of ten rows, as above: compiled already (the sampling settings are traced values)."""
    model, config, tokenizer, _ = exports("gpt2")
    ids = generate_ids(model, config, tokenizer, PROMPTS, max_new_tokens=NEW_TOKENS)
    texts = generate(model, config, tokenizer, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert texts == [tokenizer.decode([i for i in row if i != config.eos_token_id]) for row in ids]
    sample = lambda seed, prompts=PROMPTS, **kw: generate_ids(
        model, config, tokenizer, prompts, max_new_tokens=12, temperature=1.0, seed=seed, **kw
    )
    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    twice = sample(1, PROMPTS[:5], num_samples=2)
    assert len(twice) == 10 and all(twice[i] != twice[i + 1] for i in range(0, 10, 2))  # prompt-major, independent
    assert sample(1, top_p=0.9, top_k=20) == sample(1, top_p=0.9, top_k=20) != sample(1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5", "bart", "llama", "qwen3"])
def test_cache_equals_full_recompute(family, exports):
    """Logits of a prefill plus one-token steps through the cache vs the training forward pass on whole sequences.
    GPT-2 is fed left-padded rows: the cached positions must skip the padding."""
    model, config, _, _ = exports(family)
    rng = np.random.default_rng(0)
    steps = 3
    if config.is_encoder_decoder:
        source = rng.integers(3, 300, (2, 9))
        source_mask = np.ones_like(source)
        source_mask[1, 6:] = 0
        target = rng.integers(3, 300, (2, steps))

        @jax.jit
        def both(model):
            cache = model.init_cache(model.encode(source, source_mask), source_mask, 8)
            logits, cache = model.extend(target[:, :1], cache)  # the decoder start
            for t in range(1, steps):
                step, cache = model.extend(target[:, t : t + 1], cache)
                logits = jnp.concatenate([logits, step], axis=1)
            return logits, model(source, target, source_mask)

        cached, full = both(model)
        np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-4, rtol=0)
    else:
        ids = rng.integers(0, 300, (2, 5 + steps))
        mask = np.ones((2, 5), np.int32)
        mask[1, :3] = 0  # row 1: 3 left pads, then 2 prompt tokens

        @jax.jit
        def both(model):
            logits, cache = model.extend(ids[:, :5], model.init_cache(2, 8), mask)
            for t in range(5, 5 + steps):
                step, cache = model.extend(ids[:, t : t + 1], cache)
                logits = jnp.concatenate([logits, step], axis=1)
            return logits, model(ids[:1]), model(ids[1:, 3:])

        cached, row0, row1 = map(np.asarray, both(model))
        np.testing.assert_allclose(cached[0], row0[0], atol=1e-4, rtol=0)
        np.testing.assert_allclose(cached[1, 3:], row1[0], atol=1e-4, rtol=0)


def test_decode_compiles_once_per_shape(exports):
    """Different prompts, lengths and sampling settings in the same buckets: one prefill and one decode loop."""
    model, config, tokenizer, _ = exports("gpt2")
    prompts = ["the cat", "dog", "a fish"]  # a batch size no other test uses: fresh entries in the jit caches
    sizes = decoding.prefill._cache_size(), decoding.decode._cache_size()
    generate_ids(model, config, tokenizer, prompts, max_new_tokens=20)
    generate_ids(
        model,
        config,
        tokenizer,
        ["the old red", "stone", "x"],
        max_new_tokens=30,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=3,
    )
    assert (decoding.prefill._cache_size(), decoding.decode._cache_size()) == (sizes[0] + 1, sizes[1] + 1)


MESH = "data=2,fsdp=2,tensor=2"  # the command-line tests use it too, and reuse the code compiled for it here


@pytest.fixture(scope="module")
def sharded(exports):
    """family -> the export loaded on MESH, as the command line loads it."""

    @functools.cache
    def get(family):
        with jax.set_mesh(make_mesh(MESH)):
            return hf_export.load_hf(exports(family)[3])[0]

    return get


@pytest.mark.slow
def test_sharded_generation_equals_unsharded(exports, sharded):
    """On a data x fsdp x tensor mesh (batch over data and fsdp, heads over tensor, as training): the same greedy
    tokens."""
    _, config, tokenizer, path = exports("gpt2")
    model = sharded("gpt2")
    assert "tensor" in str(model.h.layers.attn.qkv.kernel[...].sharding.spec)
    assert generate_ids(model, config, tokenizer, PROMPTS[:4], max_new_tokens=NEW_TOKENS) == hf_greedy(
        path, config, PROMPTS[:4]
    )
    ids = np.ones((4, decoding.PROMPT_BUCKET), np.int32)  # the prefill just compiled: its cache is sharded too
    with jax.set_mesh(make_mesh(MESH)):
        state = decoding.prefill(
            *nnx.split(model),
            ids,
            ids,
            slots=decoding.SLOT_BUCKET,
            specials=decoding.Specials.of(config, Generation.DECODER_ONLY),
        )
    assert state.cache.key.sharding.spec[1:3] == (("data", "fsdp"), "tensor")  # [layers, batch, heads, ...]


# -- sampling ------------------------------------------------------------------------------------------------------
PROBS = np.array([0.1, 0.5, 0.05, 0.2, 0.15])  # ranked: 1 (0.5), 3 (0.2), 4 (0.15), 0 (0.1), 2 (0.05)
kept_by_filter = jax.jit(lambda logits, k, p: jnp.isfinite(filter_logits(logits, k, p)))  # k, p traced: one compile
draws = jax.jit(
    lambda logits, k, p: jax.vmap(lambda key: choose(logits, key, Sampling(1.0, k, p)))(
        jax.random.split(jax.random.key(0), 200)
    )
)


@pytest.mark.parametrize(
    "top_k,top_p,support",
    [
        (0, 1.0, {0, 1, 2, 3, 4}),
        (2, 1.0, {1, 3}),
        (1, 1.0, {1}),
        (9, 1.0, {0, 1, 2, 3, 4}),
        (0, 0.45, {1}),
        (0, 0.55, {1, 3}),
        (0, 0.75, {1, 3, 4}),
        (0, 0.99, {0, 1, 2, 3, 4}),
        (3, 0.6, {1, 3}),  # top-p on what top-k kept, renormalised: 0.5/0.85 = 0.59 < 0.6 < (0.5+0.2)/0.85
        (3, 0.55, {1}),
    ],
)
def test_filter_support(top_k, top_p, support):
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    assert set(np.flatnonzero(kept_by_filter(logits, top_k, top_p)[0])) == support
    warpers = []  # transformers' warpers agree
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    scores = torch.log(torch.tensor(PROBS, dtype=torch.float32))[None]
    for warper in warpers:
        scores = warper(None, scores)
    assert set(np.flatnonzero(np.isfinite(scores.numpy()[0]))) == support
    assert set(np.unique(draws(logits, top_k, top_p))) == support  # samples: the whole support, and only it


def test_filter_keeps_ties_and_greedy_ignores_filters():
    logits = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.15, 0.05]]))
    assert kept_by_filter(logits, 2, 1.0)[0].tolist() == [True, True, True, False, False]  # the tie at k: both kept
    random = jax.random.normal(jax.random.key(0), (16, 50))
    pick = jax.jit(lambda sampling: choose(random, jax.random.key(1), sampling))
    np.testing.assert_array_equal(pick(Sampling(0.0, 3, 0.5)), jnp.argmax(random, -1))  # greedy ignores filters
    np.testing.assert_array_equal(pick(Sampling(2.0, 1, 1.0)), jnp.argmax(random, -1))  # top-k 1 is greedy
    with pytest.raises(ValueError, match="--top_p"):
        Sampling(1.0, 0, 0.0).check()


# -- fill-mask -----------------------------------------------------------------------------------------------------
def test_fill_mask_equals_transformers_pipeline(exports, sharded):
    _, config, tokenizer, path = exports("roberta")
    model = sharded("roberta")
    text = "the big<mask> sees a<mask> river"
    ours = fill_mask(model, config, tokenizer, text, top_k=5)
    pipe = transformers.pipeline("fill-mask", model=str(path), tokenizer=str(path), top_k=5, device="cpu")
    theirs = pipe(text)
    assert len(ours) == len(theirs) == 2
    for found, expected in zip(ours, theirs):
        assert [i for _, i, _ in found] == [e["token"] for e in expected]
        assert [t for t, _, _ in found] == [e["token_str"] for e in expected]
        np.testing.assert_allclose([p for _, _, p in found], [e["score"] for e in expected], atol=1e-5)
    with pytest.raises(GenerateError, match="no <mask>"):
        fill_mask(model, config, tokenizer, "no mask here")
    with pytest.raises(GenerateError, match="does not generate"):
        generate(model, config, tokenizer, ["the cat"])


# -- command line --------------------------------------------------------------------------------------------------
def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*argv, "--mesh", MESH])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def test_cli_on_an_export(capsys, exports, sharded, tmp_path):
    _, config, tokenizer, path = exports("gpt2")
    model = sharded("gpt2")
    prompts = [arg for p in PROMPTS[:4] for arg in ("--prompt", p)]  # four rows, as the sharded test: compiled
    code, out, _ = cli(capsys, "--model_name_or_path", str(path), *prompts, "--max_new_tokens", "6")
    assert code == 0
    texts = generate(model, config, tokenizer, PROMPTS[:4], max_new_tokens=6)
    assert out == "\n---\n".join(texts) + "\n"
    code, out, _ = cli(capsys, "--model_name_or_path", str(path), *prompts, "--max_new_tokens", "6", "--with_prompt")
    assert out == "\n---\n".join(p + t for p, t in zip(PROMPTS, texts)) + "\n"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n\ndog runs\n")
    code, out, _ = cli(
        capsys,
        "--model_name_or_path",
        str(path),
        "--prompt_file",
        str(prompts),
        "--json",
        "--max_new_tokens",
        "6",
        "--temperature",
        "0.9",
        "--num_samples",
        "2",
        "--seed",
        "4",
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["prompt"], r["sample"]) for r in records] == [
        ("the cat", 0),
        ("the cat", 1),
        ("dog runs", 0),
        ("dog runs", 1),
    ]
    assert [r["continuation"] for r in records] == generate(
        model, config, tokenizer, ["the cat", "dog runs"], max_new_tokens=6, temperature=0.9, num_samples=2, seed=4
    )


def test_cli_fill_mask(capsys, exports, sharded):
    _, config, tokenizer, path = exports("roberta")
    text = "the big<mask> sees a<mask> river"  # as above: compiled
    code, out, _ = cli(
        capsys, "--model_name_or_path", str(path), "--prompt", text, "--fill_mask", "--top_k", "3", "--json"
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [[c["id"] for c in r["candidates"]] for r in records] == [
        [i for _, i, _ in found] for found in fill_mask(sharded("roberta"), config, tokenizer, text, top_k=3)
    ]


@pytest.mark.parametrize(
    "case,argv,message",
    [
        ("empty prompt", ["--prompt", ""], "empty"),
        ("prompt too long", ["--prompt", "the cat " * 40], "positions"),
        ("top_p 0", ["--prompt", "the cat", "--top_p", "0"], "--top_p"),
        ("fill_mask on gpt2", ["--prompt", "the<mask>", "--fill_mask"], "masked language model"),
        ("greedy samples", ["--prompt", "the cat", "--num_samples", "2"], "--temperature"),
        ("step of an export", ["--prompt", "the cat", "--step", "3"], "--step"),
    ],
)
def test_cli_errors_on_an_export(capsys, exports, case, argv, message):
    code, out, err = cli(capsys, "--model_name_or_path", str(exports("gpt2")[3]), *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_cli_errors_without_a_model(capsys, exports, tmp_path):
    code, _, err = cli(capsys, "--checkpoint", str(tmp_path), "--prompt", "x")
    assert code == 2 and "no run_config.json" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "--model_name_or_path", str(tmp_path / "absent"), "--prompt", "x")
    assert code == 2 and "no such directory" in err
    code, _, err = cli(capsys, "--model_name_or_path", str(exports("roberta")[3]), "--prompt", "the cat")
    assert code == 2 and "fill-mask" in err


@pytest.mark.slow
def test_cli_on_a_training_run(capsys, tmp_path, cache_dir):
    """Two steps of a tiny run: its checkpoints (the newest, or --step) and its export give the same text. The model
    has the GPT-2 export's shapes and four prompts are asked, so generation reuses the code compiled above."""
    from spmdlm.cli.launch import main as launch

    config, out = tmp_path / "gpt2.json", tmp_path / "run"
    config.write_text(json.dumps({"model_type": "gpt2", **CONFIGS["gpt2"]}))
    flags = dict(block_size=16, per_device_train_batch_size=1, mesh=MESH, max_steps=2, save_steps=1)
    flags |= dict(learning_rate="1e-3", do_train=True)
    assert launch(run_argv(out, config, cache_dir, train_file=DATA / "overfit.txt", **flags)) == 0
    capsys.readouterr()
    args = [arg for p in PROMPTS[:4] for arg in ("--prompt", p)] + ["--max_new_tokens", "5"]
    code, newest, _ = cli(capsys, "--checkpoint", str(out), *args)
    assert code == 0 and len(newest.split("\n---\n")) == 4
    assert cli(capsys, "--model_name_or_path", str(out / "hf"), *args)[1] == newest
    assert cli(capsys, "--checkpoint", str(out), "--step", "1", *args)[0] == 0
    code, _, err = cli(capsys, "--checkpoint", str(out), "--step", "3", *args)
    assert code == 2 and "no checkpoint at step 3" in err
