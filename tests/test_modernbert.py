"""ModernBERT against transformers' `ModernBertForMaskedLM` (PyTorch, fp32, eager attention): logits and gradients
with padding, packed documents against transformers run one document at a time, a transformers checkpoint (with a
tokenizer laid out as the released one) continued through the launcher, and a short run whose export fills a mask
in transformers as our fill-mask does. The suite of every family (test_families.py) covers the rest through
family_fixtures.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import FIXTURES as DATA
from conftest import read_metrics
from family_fixtures import FIXTURES
from flax import nnx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from spmdlm import hf_export
from spmdlm.data.tokenization import train_tokenizer
from spmdlm.errors import ConfigError
from spmdlm.families import checked_config, get_family, load_config
from spmdlm.generation import fill_mask
from spmdlm.launch import main
from spmdlm.load import load_model
from spmdlm.mesh import make_mesh
from spmdlm.models.stack import PER_LAYER, restack

FIXTURE = FIXTURES["modernbert"]
CONFIGS = sorted(FIXTURE.configs)


def random_hf_model(name: str, **overrides) -> transformers.ModernBertForMaskedLM:
    """A random transformers model of fixture config `name`, every parameter perturbed (norm gains around 1)."""
    torch.manual_seed(CONFIGS.index(name))
    model = FIXTURE.hf_model_class(FIXTURE.hf_config_class(**{**FIXTURE.configs[name], **overrides})).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param_name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.add_(0.05 * torch.randn_like(param))
    return model


def ours_of(model, tmp_path: Path):
    model.save_pretrained(tmp_path / "hf")
    return hf_export.load_hf(tmp_path / "hf")[0]


def hf_parameter_grads(model, batch: dict, weights: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """transformers' logits, and the gradients of sum(logits * weights) by parameter name."""
    model.zero_grad()
    logits = model(**{k: torch.tensor(v) for k, v in batch.items()}).logits
    (logits * torch.tensor(weights)).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().numpy(), grads


def our_parameter_grads(model, batch: dict, weights: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Ours, the gradients by transformers' name (through the rename table)."""
    graphdef, params = nnx.split(model, nnx.Param)

    def objective(params):
        logits = nnx.merge(graphdef, params)(**{k: jnp.asarray(v) for k, v in batch.items()})
        return jnp.sum(logits * weights), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)  # one program
    nnx.update(model, grads)  # the gradients in the parameters' places, to walk them with the export table
    by_name = dict(hf_export.hf_tensors(model))
    nnx.update(model, params)
    return np.asarray(logits), by_name


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_gradients_match_transformers_with_padding(name, tmp_path):
    torch_model = random_hf_model(name)
    ours = ours_of(torch_model, tmp_path)
    batch = FIXTURE.make_batch(FIXTURE.configs[name], np.random.default_rng(0))
    valid = batch["attention_mask"].astype(bool)
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(*valid.shape, FIXTURE.configs[name]["vocab_size"])).astype(np.float32) * valid[..., None]
    theirs, their_grads = hf_parameter_grads(torch_model, batch, weights)
    logits, grads = our_parameter_grads(ours, batch, weights)
    assert np.abs(logits[valid] - theirs[valid]).max() <= 1e-5
    assert set(grads) <= set(their_grads) and "decoder.weight" not in grads  # the tied decoder: in the embeddings
    embedding = "model.embeddings.tok_embeddings.weight"
    their_grads[embedding] = their_grads[embedding] + their_grads.pop("decoder.weight", 0.0)
    for hf_name, grad in grads.items():
        reference = their_grads[hf_name]
        assert np.abs(grad - reference).max() <= 1e-4 * np.abs(reference).max(), hf_name


def packed_row(docs: list[np.ndarray], length: int, pad_id: int) -> dict[str, np.ndarray]:
    ids, segments = np.full(length, pad_id, np.int64), np.zeros(length, np.int32)
    at = 0
    for k, doc in enumerate(docs, 1):
        ids[at : at + len(doc)], segments[at : at + len(doc)] = doc, k
        at += len(doc)
    return {
        "input_ids": ids[None],
        "attention_mask": (segments > 0)[None].astype(np.int32),
        "segment_ids": segments[None],
    }


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "dot_product"])
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_documents_match_transformers_one_document_at_a_time(name, implementation, tmp_path):
    """Unpadding as packing: each document of a packed row (with windows shorter than it) gets the logits
    transformers gives it alone; positions and the sliding window restart in each document."""
    torch_model = random_hf_model(name)
    ours = get_family("modernbert").make_model(
        ours_of(torch_model, tmp_path).config, rngs=nnx.Rngs(0), attention=implementation
    )
    nnx.update(ours, nnx.state(ours_of(torch_model, tmp_path / "again"), nnx.Param))
    rng = np.random.default_rng(2)
    docs = [rng.integers(3, FIXTURE.configs[name]["vocab_size"], n) for n in (13, 1, 17)]
    packed = packed_row(docs, 36, pad_id=0)
    logits = np.asarray(ours(**{k: jnp.asarray(v) for k, v in packed.items()}))[0]
    at = 0
    for doc in docs:
        with torch.no_grad():
            alone = torch_model(input_ids=torch.tensor(doc[None])).logits[0].numpy()
        assert np.abs(logits[at : at + len(doc)] - alone).max() <= 1e-5
        at += len(doc)


@pytest.mark.slow
def test_per_layer_and_unrolled_stacks_compute_and_export_the_same():
    """--scan_unroll per_layer (each layer its own arrays) and 0 (unrolled scan) over the periods and the tail."""
    config = load_config("modernbert-tiny")
    assert config.periods == (1, 1)  # layer 0, a period (2 sliding-window layers, a global one), one left over
    batch = {k: jnp.asarray(v) for k, v in FIXTURE.make_batch(FIXTURE.tiny_config, np.random.default_rng(4)).items()}
    models = {
        unroll: get_family("modernbert").make_model(config, rngs=nnx.Rngs(0), scan_unroll=unroll)
        for unroll in (1, True, PER_LAYER)
    }
    logits = {unroll: np.asarray(model(**batch)) for unroll, model in models.items()}
    for unroll in (True, PER_LAYER):
        np.testing.assert_allclose(logits[unroll], logits[1], atol=1e-5, rtol=0)
    scanned, per_layer = (dict(hf_export.hf_tensors(restack(models[u]))) for u in (1, PER_LAYER))
    assert (
        scanned.keys() == per_layer.keys() and len({k for k in scanned if k.startswith("model.layers.")}) == 5 * 6 - 1
    )
    for name, value in scanned.items():
        np.testing.assert_array_equal(per_layer[name], value, err_msg=name)


def test_the_base_preset_is_the_released_model():
    """modernbert-base against transformers' defaults (ModernBERT-base's config): the same 149,655,232 parameters."""
    config = load_config("modernbert-base")
    model = nnx.eval_shape(lambda: get_family("modernbert").make_model(config, rngs=nnx.Rngs(0)))
    with torch.device("meta"):
        reference = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig())
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == sum(p.numel() for p in reference.parameters()) == 149_655_232
    assert config.periods == (7, 0) and config.layer_types == tuple(reference.config.layer_types)


def test_refused_transformers_options_say_so_in_one_line():
    base = FIXTURE.hf_config_class(**FIXTURE.configs["local-global"]).to_dict()
    cases = {
        "layer_types": dict(layer_types=["full_attention", "full_attention", "sliding_attention", "full_attention"]),
        "rope_type 'linear'": dict(
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}
        ),
        "untied decoder": dict(tie_word_embeddings=False),
    }
    for says, change in cases.items():
        with pytest.raises(ConfigError, match=says) as raised:
            checked_config({**base, **change}, None, "test")
        assert "\n" not in str(raised.value)
    config = checked_config(base, None, "test")  # transformers 5's forms read back
    assert (config.global_attn_every_n_layers, config.global_rope_theta, config.local_rope_theta) == (3, 1000.0, 50.0)


def test_the_masking_rate_defaults_to_30_percent_for_this_family_only():
    tokenizers = {
        name: train_tokenizer(get_family(name), ["a b c d e f"] * 4, 300) for name in ("modernbert", "roberta")
    }
    rates = {
        name: get_family(name).build_objective(flags, load_config(f"{name}-tiny"), tokenizers[name]).mlm_probability
        for name in tokenizers
        for flags in ({}, {"mlm_probability": 0.2})
        if not flags or name == "modernbert"
    }
    assert rates == {"modernbert": 0.2, "roberta": 0.15}
    modernbert = get_family("modernbert").build_objective({}, load_config("modernbert-tiny"), tokenizers["modernbert"])
    assert modernbert.mlm_probability == 0.3 and modernbert.mask_id == tokenizers["modernbert"].token_to_id("[MASK]")
    tokens = tokenizers["modernbert"].encode("a b").tokens
    assert (tokens[0], tokens[-1]) == ("[CLS]", "[SEP]")  # framed, as the released tokenizer frames


# -- a transformers checkpoint, with a tokenizer laid out as the released one ---------------------------------------
RELEASED_SPECIALS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")  # after the BPE pieces, in this order


def released_style_tokenizer(folder: Path, vocab_pieces: int) -> dict[str, int]:
    """ModernBERT-base's tokenizer layout, built here (nothing is downloaded): a byte-level BPE, the five specials
    appended after its pieces, `[CLS] $A [SEP]` framing, [MASK] stripping the space before it, saved by
    transformers' PreTrainedTokenizerFast. -> the special ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_pieces, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((DATA / "overfit.txt").read_text().splitlines(), trainer=trainer)
    tok.add_special_tokens(
        [AddedToken(t, lstrip=t == "[MASK]", normalized=False, special=True) for t in RELEASED_SPECIALS]
    )
    ids = {t: tok.token_to_id(t) for t in RELEASED_SPECIALS}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_max_length=8192,
    )
    wrapped.save_pretrained(folder)
    return ids


@pytest.mark.slow
def test_a_transformers_checkpoint_continues_and_at_learning_rate_0_exports_its_own_logits(tmp_path, cache_dir):
    folder = tmp_path / "checkpoint"
    ids = released_style_tokenizer(folder, 400)
    values = {k: v for k, v in FIXTURE.tiny_config.items() if k != "model_type"}
    special = dict(pad_token_id=ids["[PAD]"], bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"])
    config = transformers.ModernBertConfig(
        **{**values, **special, "cls_token_id": ids["[CLS]"], "sep_token_id": ids["[SEP]"], "vocab_size": 408}
    )
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(config).save_pretrained(folder)
    out = tmp_path / "out"
    flags = ["--max_seq_length", "32", "--learning_rate", "0", "--warmup_steps", "0", "--max_steps", "2"]
    assert (
        main(
            [
                "--model_name_or_path",
                str(folder),
                "--train_file",
                str(DATA / "overfit.txt"),
                "--output_dir",
                str(out),
                "--cache_dir",
                str(cache_dir),
                "--global_batch_size",
                "8",
                *flags,
            ]
        )
        == 0
    )
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert (exported["pad_token_id"], exported["cls_token_id"]) == (ids["[PAD]"], ids["[CLS]"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    inputs = tokenizer(["the lighthouse keeper lit the [MASK].", "a [MASK]"], padding=True, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == ids["[CLS]"]
    with torch.no_grad():
        before = transformers.AutoModelForMaskedLM.from_pretrained(folder)(**inputs).logits
        after = transformers.AutoModelForMaskedLM.from_pretrained(out / "hf")(**inputs).logits
    valid = inputs["attention_mask"].bool()
    assert torch.equal(before[valid], after[valid])


# -- it learns, and its export fills a mask in transformers as ours does ----------------------------------------------
@pytest.mark.slow
def test_a_short_run_learns_and_its_export_fills_masks_as_ours(tmp_path, tiny_configs, cache_dir):
    out = tmp_path / "run"
    text = str(DATA / "overfit.txt")
    argv = [
        "--model_type",
        "modernbert",
        "--config_name",
        str(tiny_configs["modernbert"]),
        "--train_file",
        text,
        "--validation_file",
        text,
        "--output_dir",
        str(out),
        "--cache_dir",
        str(cache_dir),
        "--max_seq_length",
        "32",
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--max_steps",
        "250",
        "--learning_rate",
        "3e-3",
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "10",
        "--weight_decay",
        "0",
        "--eval_steps",
        "125",
        "--logging_steps",
        "50",
        "--seed",
        "3",
    ]
    assert main(argv) == 0
    evals = [m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m]
    print("modernbert eval loss", evals)
    assert len(evals) >= 2 and evals[-1] < evals[0] - 1.0, evals

    sentence = "The lighthouse keeper wrote the same three lines in his log every evening before he lit the[MASK]."
    loaded = load_model(out / "hf", make_mesh("data=-1"))
    ours = fill_mask(loaded.model, loaded.config, loaded.tokenizer, sentence, top_k=5)[0]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    fill = transformers.pipeline("fill-mask", model=str(out / "hf"), tokenizer=hf_tokenizer, device="cpu")
    theirs = fill(sentence, top_k=5)
    assert [a["token"] for a in theirs] == [token_id for _, token_id, _ in ours]
    np.testing.assert_allclose([a["score"] for a in theirs], [p for _, _, p in ours], rtol=1e-4)
