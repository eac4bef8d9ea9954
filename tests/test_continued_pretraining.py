"""Continued pretraining from transformers checkpoints laid out as released ones are (issue 38): every tokenizer and
weight layout transformers reads, for the four families, built here with transformers / tokenizers / sentencepiece.

The layout tests read without training (no step compiled); one 0-learning-rate run per family shows the whole path
(checkpoint's tokenizer, weights exported unchanged, step-0 loss = transformers' on the same batches), and one T5 run
the vocabulary extension."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import torch
import transformers
from family_fixtures import FIXTURES
from safetensors.numpy import load_file

from spmdlm import hf_export
from spmdlm.cli.launch import main, parse_args
from spmdlm.data import datasets, pipeline
from spmdlm.data.tokenization import load_tokenizer, save_tokenizer, train_tokenizer
from spmdlm.families import get_family
from spmdlm.train.stages.resolve import resolve

WORDS = "lamp keeper harbour boat sail letter apples tide wind north grey cape bay rowed smiled failed".split()
LINES = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + i % 5)) + f", day {i}." for i in range(300)]
SENTENCE = "The keeper rowed to the harbour, and the lamp never failed: day 42."
TOKENIZER_VOCAB = 400  # each tiny model has 512 embedding rows
T5_PIECES = 80  # as many as a Unigram model of LINES can have; T5's tokenizer adds 100 sentinels


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


# -- checkpoints ---------------------------------------------------------------------------------------------------
def hf_model(family: str, **overrides):
    """The family's tiny model (family_fixtures.py) as a random transformers model, special ids as our tokenizers'."""
    fixture = FIXTURES[family]
    given = ("model_type", "tie_word_embeddings", "feed_forward_proj")  # T5's config class sets the last two
    values = {k: v for k, v in fixture.tiny_config.items() if k not in given}
    if family in ("gpt2", "llama", "qwen3"):  # one <|endoftext|> at id 0
        values.update(bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = fixture.hf_model_class(fixture.hf_config_class(**{**values, **overrides})).eval()
    fixture.prepare_hf(model)
    return model


def write_tokenizer(folder: Path, family: str, layout: str, corpus: Path) -> None:
    """The family's tokenizer in one of the layouts transformers reads."""
    if layout in ("spiece.model", "sentencepiece.bpe.model"):
        # T5's ids (<pad>=0, </s>=1, <unk>=2; transformers appends 100 sentinels) or XLM-R's (SentencePiece's own)
        ids = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1) if layout == "spiece.model" else {}
        kind, size = ("unigram", T5_PIECES) if layout == "spiece.model" else ("bpe", 300)
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(folder / "spm"), vocab_size=size, model_type=kind, minloglevel=2, **ids
        )
        (folder / "spm.model").rename(folder / layout)
        (folder / "spm.vocab").unlink()
        return
    tok = train_tokenizer(get_family(family), LINES, TOKENIZER_VOCAB)
    if layout == "tokenizer.json":
        save_tokenizer(tok, folder, get_family(family), model_max_length=64)
    else:  # vocab.json + merges.txt; BART's with its special tokens named, the others' the family's defaults
        tok.model.save(str(folder))
        if family == "bart":
            specials = {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "mask_token": "<mask>",
                "cls_token": "<s>",
                "sep_token": "</s>",
            }
            (folder / "special_tokens_map.json").write_text(json.dumps(specials))


def write_weights(folder: Path, model, layout: str) -> None:
    if layout.endswith("safetensors"):
        model.save_pretrained(folder, max_shard_size="40KB" if layout == "sharded.safetensors" else "1GB")
        return
    model.config.save_pretrained(folder)
    state = model.state_dict()
    if layout == "pytorch_model.bin":
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = list(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        torch.save({name: state[name] for name in part}, folder / file)
    weight_map = {name: file for file, part in shards.items() for name in part}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def checkpoint(folder: Path, family: str, tokenizer: str | None, weights: str, corpus: Path, **overrides):
    folder.mkdir(parents=True)
    model = hf_model(family, **overrides)
    write_weights(folder, model, weights)
    if tokenizer:
        write_tokenizer(folder, family, tokenizer, corpus)
    return model


def reference_tokenizer(folder: Path, layout: str):
    """The checkpoint's tokenizer as transformers reads it."""
    cls = {"spiece.model": transformers.T5Tokenizer, "sentencepiece.bpe.model": transformers.XLMRobertaTokenizer}
    return cls.get(layout, transformers.AutoTokenizer).from_pretrained(folder, local_files_only=True)


# -- every layout, read without training ---------------------------------------------------------------------------
LAYOUTS = [  # (family, tokenizer layout, weight layout): every tokenizer layout of each family, every weight layout
    ("gpt2", "tokenizer.json", "sharded.safetensors"),
    ("gpt2", "vocab.json", "pytorch_model.bin"),
    ("roberta", "vocab.json", "model.safetensors"),
    ("roberta", "sentencepiece.bpe.model", "sharded.bin"),
    ("bart", "tokenizer.json", "pytorch_model.bin"),
    ("bart", "vocab.json", "sharded.safetensors"),
    ("t5", "spiece.model", "sharded.bin"),
    ("t5", "tokenizer.json", "model.safetensors"),
    ("llama", "tokenizer.json", "sharded.safetensors"),
    ("llama", "tokenizer.json", "sharded.bin"),
    ("qwen3", "tokenizer.json", "model.safetensors"),
]


@pytest.mark.parametrize("family,tokenizer,weights", LAYOUTS, ids=["-".join(case) for case in LAYOUTS])
def test_each_layout_gives_the_checkpoints_tokenizer_and_weights(family, tokenizer, weights, tmp_path, corpus):
    folder = tmp_path / "checkpoint"
    model = checkpoint(folder, family, tokenizer, weights, corpus)
    assert_reads_as(folder, family, model, reference_tokenizer(folder, tokenizer))


def assert_reads_as(source, family: str, model, tokenizer) -> None:
    """`source` (a directory or gs:// URL) gives `tokenizer`'s ids and, exported again, `model`'s tensors exactly."""
    assert load_tokenizer(source, get_family(family)).encode(SENTENCE).ids == tokenizer(SENTENCE)["input_ids"]
    loaded, _ = hf_export.load_hf(source)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    for name, value in hf_export.hf_tensors(loaded):
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_a_checkpoint_in_a_bucket(gcs_bucket, tmp_path, corpus):
    """--model_name_or_path gs://...: T5 v1.1 as published (spiece.model, pytorch_model.bin), read from the bucket."""
    from spmdlm import storage

    folder = tmp_path / "checkpoint"
    model = checkpoint(folder, "t5", "spiece.model", "pytorch_model.bin", corpus)
    storage.upload(folder, f"{gcs_bucket}/t5-v1_1")
    assert_reads_as(f"{gcs_bucket}/t5-v1_1", "t5", model, reference_tokenizer(folder, "spiece.model"))


def test_a_pytorch_checkpoint_runs_no_pickled_code_and_without_torch_names_the_extra(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    config = hf_model("gpt2").config
    config.save_pretrained(folder)
    torch.save({"weights": Evil()}, folder / "pytorch_model.bin")
    with pytest.raises(hf_export.ExportError, match=r"^cannot read .*pytorch_model.bin as plain tensors .*[^\n]$"):
        hf_export.load_hf(folder)
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
    with pytest.raises(
        hf_export.ExportError, match=r"needs torch to read \(pip install 'spmdlm\[torch\]'\), or convert"
    ):
        hf_export.load_hf(folder)


class Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


# -- refusals before any corpus is read (the --train_file does not exist: its error would come later) -------------
def refused(capsys, *argv) -> str:
    capsys.readouterr()  # what building the checkpoint printed
    assert main([*argv, "--train_file", "/absent/corpus.txt", "--output_dir", "/absent/out"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "corpus.txt" not in err
    return err


def test_a_checkpoint_without_a_tokenizer_and_a_damaged_one_are_refused_first(tmp_path, corpus, capsys):
    folder = tmp_path / "no-tokenizer"
    checkpoint(folder, "roberta", None, "model.safetensors", corpus)
    assert "has no tokenizer" in refused(capsys, "--model_name_or_path", str(folder))
    assert "--tokenizer_name" in refused(capsys, "--model_name_or_path", str(folder))
    write_tokenizer(folder, "roberta", "vocab.json", corpus)
    for file in folder.glob("model.safetensors"):
        tensors = load_file(file)
        del tensors["roberta.encoder.layer.1.output.dense.weight"]
        from safetensors.numpy import save_file

        save_file(tensors, file, metadata={"format": "pt"})
    assert "missing tensors roberta.encoder.layer.1.output.dense.weight" in refused(
        capsys, "--model_name_or_path", str(folder)
    )


def test_a_tokenizer_that_moves_the_checkpoints_ids_is_refused(tmp_path, corpus, capsys):
    folder = tmp_path / "checkpoint"
    checkpoint(folder, "gpt2", "vocab.json", "model.safetensors", corpus)
    other = train_tokenizer(get_family("gpt2"), LINES[::-1] + ["zebra quartz"] * 5, TOKENIZER_VOCAB + 20)
    save_tokenizer(other, tmp_path / "other", get_family("gpt2"), model_max_length=64)
    err = refused(capsys, "--model_name_or_path", str(folder), "--tokenizer_name", str(tmp_path / "other"))
    assert "does not extend the tokenizer of --model_name_or_path" in err and "add_tokens" in err
    # a prepared dataset's tokenizer the same: its ids must mean what they meant to the checkpoint
    save_tokenizer(other, tmp_path / "data" / datasets.TOKENIZER_DIR, get_family("gpt2"), model_max_length=64)
    card = {"format": datasets.CARD_FORMAT, "version": datasets.CARD_VERSION}  # a whole dataset: its card is there
    (tmp_path / "data" / datasets.CARD_NAME).write_text(json.dumps(card))
    capsys.readouterr()
    argv = ["--model_name_or_path", str(folder), "--dataset_dir", str(tmp_path / "data"), "--output_dir", "/absent/o"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"the tokenizer of --dataset_dir {tmp_path / 'data'} does not extend" in err and "\n" not in err


# -- a run from each family's checkpoint: its tokenizer, its weights, its loss --------------------------------------
RUNS = {
    "gpt2": ("vocab.json", "pytorch_model.bin"),
    "roberta": ("vocab.json", "sharded.safetensors"),
    "bart": ("vocab.json", "sharded.bin"),
    "t5": ("spiece.model", "pytorch_model.bin"),
    "llama": ("tokenizer.json", "sharded.safetensors"),
    "qwen3": ("tokenizer.json", "model.safetensors"),
}


def continue_run(family: str, folder: Path, out: Path, corpus: Path, *extra) -> list[dict]:
    """A 1-step run at learning rate 0 from `folder`; -> the batches its evaluation read."""
    flags = list(FIXTURES[family].run_flags)
    flags[flags.index("--learning_rate") + 1] = "0"
    assert (
        main(
            [
                "--model_name_or_path",
                str(folder),
                "--train_file",
                str(corpus),
                "--output_dir",
                str(out),
                "--cache_dir",
                str(out.parent / "cache"),
                *flags,
                "--global_batch_size",
                "8",
                "--max_steps",
                "1",
                "--warmup_steps",
                "0",
                "--max_eval_samples",
                "16",
                "--per_device_eval_batch_size",
                "1",
                *extra,
            ]
        )
        == 0
    )
    return json.loads((out / "eval_results.json").read_text())


def hf_loss(model, batches: list[dict]) -> float:
    """transformers' mean cross-entropy over the labelled positions of the batches."""
    total, count = 0.0, 0
    inputs = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
    for batch in batches:
        with torch.no_grad():
            logits = model(
                **{k: torch.tensor(np.asarray(v), dtype=torch.long) for k, v in batch.items() if k in inputs}
            ).logits
        labels = torch.tensor(np.asarray(batch["labels"]), dtype=torch.long)
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1), ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels != -100).sum())
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("family", list(RUNS))
def test_a_continued_run_starts_from_the_checkpoint(family, tmp_path, corpus, monkeypatch, caplog):
    tokenizer, weights = RUNS[family]
    folder = tmp_path / "checkpoint"
    model = checkpoint(folder, family, tokenizer, weights, corpus)
    batches = []
    read = pipeline.eval_batches
    monkeypatch.setattr(pipeline, "eval_batches", lambda *a, **k: (batches.append(b) or b for b in read(*a, **k)))
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        results = continue_run(family, folder, tmp_path / "out", corpus)
    assert not [r for r in caplog.records if "training a" in r.getMessage()]
    # step 0: the run's evaluation is transformers' loss of the checkpoint on the same batches
    ours = results.get("eval_loss_all_positions", results["eval_loss"])
    assert ours == pytest.approx(hf_loss(model, batches), rel=2e-5)
    # its weights, exported unchanged; its tokenizer, exported with the same ids
    exported = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    state = model.state_dict()
    for name, value in exported.items():
        np.testing.assert_allclose(value, state[name].numpy(), rtol=0, atol=1e-7, err_msg=name)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "hf")
    assert reloaded(SENTENCE)["input_ids"] == reference_tokenizer(folder, tokenizer)(SENTENCE)["input_ids"]


def test_a_tokenizer_extending_the_checkpoints_grows_the_embeddings(tmp_path, corpus):
    """T5 (its head untied): the run's config grows, the loader appends mean rows, transformers reloads the export.
    Nothing is compiled: the run's own resolve and the loader its state takes the weights from."""
    folder = tmp_path / "checkpoint"
    size = T5_PIECES + 100
    model = checkpoint(folder, "t5", "spiece.model", "model.safetensors", corpus, vocab_size=size)
    extended = reference_tokenizer(folder, "spiece.model")
    assert len(extended) == size
    extended.add_tokens(["keeperhouse", "lampwick", "<north>"])
    extended.save_pretrained(tmp_path / "extended")
    args, _ = parse_args(
        [
            "--model_name_or_path",
            str(folder),
            "--tokenizer_name",
            str(tmp_path / "extended"),
            "--train_file",
            str(corpus),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_seq_length",
            "32",
        ]
    )
    run = resolve(args, 0.0)
    assert run.config.vocab_size == size + 3 and run.checkpoint_config.vocab_size == size
    ours, _ = hf_export.load_hf(folder, config=run.config)
    hf_export.save_hf(ours, run.config, tmp_path / "hf", tokenizer=run.tokenizer)
    grown = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    assert grown.config.vocab_size == size + 3
    for name in ("shared.weight", "lm_head.weight"):
        old, new = model.state_dict()[name].numpy(), grown.state_dict()[name].numpy()
        assert new.shape == (size + 3, old.shape[1])
        np.testing.assert_array_equal(new[:size], old)  # the old ids' rows unchanged
        np.testing.assert_allclose(new[size:], np.broadcast_to(old.mean(0), (3, old.shape[1])), rtol=1e-6, atol=1e-7)
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("the lampwick")["input_ids"]
    assert ids == extended("the lampwick")["input_ids"] and size + 1 in ids
