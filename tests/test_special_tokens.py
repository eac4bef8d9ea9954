"""Special tokens come from the checkpoint (issues 60, 68): a transformers checkpoint whose tokenizer names its own
BOS/EOS/PAD/UNK/MASK (Llama 3's <|begin_of_text|>/<|end_of_text|> without unk or pad, Llama 2's <s></s><unk>, an
instruct Qwen3's EOS <|im_end|> and pad <|endoftext|> without BOS, ModernBERT's [CLS]-style and <s>-style) is
continued with those tokens, and its export has the checkpoint's tokenizer files, special tokens and config.json /
generation_config.json ids (an EOS list kept a list); a decoder without a pad token pads with its EOS in the export
(one line says so). A token the objective needs and the checkpoint lacks is refused in one line whose advice works.

Checkpoints are tiny random transformers models saved by save_pretrained, their tokenizers built with `tokenizers`
and saved by transformers' PreTrainedTokenizerFast. Every layout is checked through the run's own resolution, its
objective and the export writer without training; one learning-rate-0 launcher run (the instruct Qwen3) shows the
whole path (a ModernBERT checkpoint's is test_modernbert.py's)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from family_fixtures import FIXTURES
from test_continued_pretraining import continue_run
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from spmdlm import hf_export
from spmdlm.cli.launch import parse_args
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.tokenization import special_token_ids
from spmdlm.errors import TokenizerError
from spmdlm.load import export_checkpoint
from spmdlm.train.stages.resolve import resolve
from spmdlm.train.stages.vocabulary import vocabulary_of

WORDS = "lamp keeper harbour boat sail letter apples tide wind north grey cape bay rowed smiled failed".split()
LINES = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + i % 5)) + f", day {i}." for i in range(300)]
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id")
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token", "sep_token")


# layout -> (family, its special tokens, before the BPE pieces (ids 0, 1, ...) or after them, the names the
# tokenizer's files give them, how a text is framed, the roles the run should find)
LAYOUTS = {
    "llama3": (
        "llama",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"],
        "after",
        dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"),
        ("<|begin_of_text|>", None),
        dict(bos="<|begin_of_text|>", eos="<|end_of_text|>", unk=None, pad=None, mask=None),
    ),
    "llama2": (
        "llama",
        ["<unk>", "<s>", "</s>"],
        "before",
        dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        ("<s>", None),
        dict(bos="<s>", eos="</s>", unk="<unk>", pad=None, mask=None),
    ),
    "qwen3-instruct": (
        "qwen3",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "after",
        dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None),
        None,
        dict(bos=None, eos="<|im_end|>", unk=None, pad="<|endoftext|>", mask=None),
    ),
    "modernbert-cls": (
        "modernbert",
        ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
        "after",
        dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]"),
        ("[CLS]", "[SEP]"),
        dict(bos="[CLS]", eos="[SEP]", unk="[UNK]", pad="[PAD]", mask="[MASK]"),
    ),
    "modernbert-s": (
        "modernbert",
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        "before",
        dict(
            bos_token="<s>",
            eos_token="</s>",
            cls_token="<s>",
            sep_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            mask_token="<mask>",
        ),
        ("<s>", "</s>"),
        dict(bos="<s>", eos="</s>", unk="<unk>", pad="<pad>", mask="<mask>"),
    ),
}


def write_tokenizer(folder: Path, specials: list[str], where: str, names: dict, frame) -> dict[str, int]:
    """A byte-level BPE with `specials` before or after its pieces, framed as `frame` says, saved by transformers'
    PreTrainedTokenizerFast with `names`. -> the special tokens' ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    first = specials if where == "before" else []
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=first, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(LINES, trainer=trainer)
    if where == "after":
        tok.add_special_tokens(specials)
    ids = {token: tok.token_to_id(token) for token in specials}
    if frame is not None:
        opening, closing = frame
        single = f"{opening} $A" + (f" {closing}" if closing else "")
        pair = f"{single} $B" + (f" {closing}" if closing else "")
        used = [token for token in frame if token]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(token, ids[token]) for token in used]
        )
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **names).save_pretrained(folder)
    return ids


def checkpoint(folder: Path, layout: str, *, without: str | None = None) -> dict[str, int]:
    """A random transformers model of the layout's family saved with its tokenizer, config.json ids as the release
    has them (an instruct Qwen3: BOS <|endoftext|> in config.json, generation_config.json's EOS list [<|im_end|>,
    <|endoftext|>] and its sampling settings). `without`: a special token the tokenizer lacks."""
    family, specials, where, names, frame, _ = LAYOUTS[layout]
    if without:
        specials = [token for token in specials if token != without]
        names = {key: token for key, token in names.items() if token != without}
    ids = write_tokenizer(folder, specials, where, names, frame)
    fixture = FIXTURES[family]
    # the decoders as test_continued_pretraining.py's (untied): its runs' compiled steps are this file's
    given = ("model_type",) if family == "modernbert" else ("model_type", "tie_word_embeddings")
    values = {k: v for k, v in fixture.tiny_config.items() if k not in given}
    if family == "modernbert":
        role_ids = dict(bos=ids[names["cls_token"]], eos=ids[names["sep_token"]], pad=ids[names["pad_token"]])
        values.update(cls_token_id=role_ids["bos"], sep_token_id=role_ids["eos"])
    elif family == "qwen3":
        role_ids = dict(bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"], pad=None)
    else:
        role_ids = dict(bos=ids[names["bos_token"]], eos=ids[names["eos_token"]], pad=None)
    values.update({f"{role}_token_id": i for role, i in role_ids.items()})
    torch.manual_seed(0)
    fixture.hf_model_class(fixture.hf_config_class(**values)).save_pretrained(folder)
    if layout == "qwen3-instruct":
        generation = json.loads((folder / "generation_config.json").read_text())
        eos, other = ids["<|im_end|>"], ids["<|endoftext|>"]
        generation.update(eos_token_id=[eos, other], pad_token_id=other, do_sample=True, temperature=0.6, top_k=20)
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return ids


def resolved(folder: Path, tmp_path: Path, *extra: str):
    """The launcher's resolution of a run from `folder` and its vocabulary: nothing compiled, nothing written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    argv = ["--model_name_or_path", str(folder), "--train_file", str(corpus), "--output_dir", str(tmp_path / "out")]
    args, _ = parse_args([*argv, *extra])
    run = resolve(args, 0.0)
    return run, vocabulary_of(run.tokenizer, run.config, run.family)


def exported(folder: Path, run, vocabulary, out: Path) -> Path:
    """The checkpoint's weights exported as the run exports them, with the run's tokenizer (nothing trained)."""
    model, _ = hf_export.load_hf(folder, config=vocabulary.config)
    return hf_export.save_hf(model, vocabulary.config, out, tokenizer=run.tokenizer)


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def assert_keeps_special_tokens(source: Path, export: Path) -> None:
    """The export's tokenizer files, special tokens and ids are the checkpoint's; a decoder without a pad token
    pads with its EOS there (only that differs), so transformers' padding works on it."""
    source_ids = {k: read(source, "config.json").get(k) for k in ID_KEYS}
    assert {k: read(export, "config.json").get(k) for k in ID_KEYS} == source_ids
    if (source / "generation_config.json").is_file():  # whole: an EOS list, sampling settings
        assert read(export, "generation_config.json") == read(source, "generation_config.json")
    else:  # a masked LM's: the config's ids
        generation = read(export, "generation_config.json")
        assert all(generation.get(k) == v for k, v in source_ids.items() if k in hf_export.GENERATION_IDS and v)
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(export)
    assert {name: getattr(ours, name) for name in TOKEN_NAMES} == {
        **{name: getattr(theirs, name) for name in TOKEN_NAMES},
        "pad_token": theirs.pad_token or theirs.eos_token,
    }
    without_pad = lambda config: {k: v for k, v in config.items() if k != "pad_token"}
    source_config = read(source, "tokenizer_config.json")
    assert without_pad(read(export, "tokenizer_config.json")) == without_pad(source_config)
    assert ours("a b c")["input_ids"] == theirs("a b c")["input_ids"]
    padded = ours(["a", "a b c"], padding=True)
    assert len(set(map(len, padded["input_ids"]))) == 1 and sum(padded["attention_mask"][0]) < len(
        padded["attention_mask"][0]
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpoints_special_tokens_are_the_runs_and_its_exports(layout, tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    ids = checkpoint(folder, layout)
    run, vocabulary = resolved(folder, tmp_path)
    roles = LAYOUTS[layout][-1]
    expected = {role: None if token is None else ids[token] for role, token in roles.items()}
    assert special_token_ids(run.tokenizer, run.family) == expected
    objective = run.family.build_objective(run.args.objective, vocabulary.config, run.tokenizer)
    if isinstance(objective, CausalLM):  # documents joined by the checkpoint's EOS
        assert objective.eos_id == expected["eos"]
    else:  # framed by its cls/sep, padded and masked by its own
        found = (objective.bos_id, objective.eos_id, objective.pad_id, objective.mask_id)
        assert found == tuple(expected[role] for role in ("bos", "eos", "pad", "mask"))
        content = run.tokenizer.encode(" ".join(LINES), add_special_tokens=False).ids[: objective.record_length]
        row = objective(np.asarray(content), np.random.default_rng(0))["input_ids"]
        assert (row[0], row[-1]) == (expected["bos"], expected["eos"]) and expected["mask"] in row
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        export = exported(folder, run, vocabulary, tmp_path / "hf")
    assert_keeps_special_tokens(folder, export)
    pads_with_eos = [r for r in caplog.records if "names no pad token" in r.getMessage()]
    assert len(pads_with_eos) == (expected["pad"] is None)


def test_a_missing_mask_token_is_refused_with_advice_that_works(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    checkpoint(folder, "modernbert-cls", without="[MASK]")
    with pytest.raises(TokenizerError) as refused:
        resolved(folder, tmp_path)
    line = str(refused.value)
    assert "\n" not in line and "no mask token '[MASK]'" in line
    assert "tok.add_special_tokens({'mask_token': '[MASK]'})" in line and "--tokenizer_name NEW" in line
    # the advice, followed: the mask token appended, the tokenizer given beside the checkpoint
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"mask_token": "[MASK]"})
    tok.save_pretrained(tmp_path / "with-mask")
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        run, vocabulary = resolved(folder, tmp_path, "--tokenizer_name", str(tmp_path / "with-mask"))
    changed = [r.getMessage() for r in caplog.records if "changes the special tokens" in r.getMessage()]
    assert len(changed) == 1 and "mask None -> '[MASK]'" in changed[0]
    mask = run.tokenizer.token_to_id("[MASK]")
    assert mask == len(tok) - 1 and special_token_ids(run.tokenizer, run.family)["mask"] == mask
    export = exported(folder, run, vocabulary, tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(export).mask_token == "[MASK]"
    assert {k: read(export, "config.json").get(k) for k in ID_KEYS} == {
        k: read(folder, "config.json").get(k) for k in ID_KEYS
    }


def test_a_tokenizer_that_changes_the_pad_token_says_so_and_the_export_follows(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    checkpoint(folder, "llama2")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.save_pretrained(tmp_path / "with-pad")
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        run, vocabulary = resolved(folder, tmp_path, "--tokenizer_name", str(tmp_path / "with-pad"))
    changed = [r.getMessage() for r in caplog.records if "changes the special tokens" in r.getMessage()]
    assert len(changed) == 1 and "pad None -> '<pad>'" in changed[0]
    pad = run.tokenizer.token_to_id("<pad>")
    export = exported(folder, run, vocabulary, tmp_path / "hf")
    config, source = read(export, "config.json"), read(folder, "config.json")
    assert config["pad_token_id"] == pad == read(export, "generation_config.json")["pad_token_id"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (source["bos_token_id"], source["eos_token_id"])
    assert transformers.AutoTokenizer.from_pretrained(export).pad_token == "<pad>"


@pytest.mark.slow
def test_an_instruct_qwen3_continued_at_learning_rate_0_exports_its_own_special_tokens(tmp_path):
    """The launcher's whole path (test_continued_pretraining.py's run: the same compiled steps): the run's export and
    spmdlm.export of its checkpoint have the checkpoint's EOS <|im_end|>, its pad, no BOS, its EOS list."""
    folder, out = tmp_path / "checkpoint", tmp_path / "out"
    checkpoint(folder, "qwen3-instruct")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    continue_run("qwen3", folder, out, corpus)
    assert_keeps_special_tokens(folder, out / "hf")
    assert_keeps_special_tokens(folder, export_checkpoint(out, tmp_path / "exported"))
