"""Bits per byte and `python -m spmdlm.evaluate`, against transformers' own loss on the same batches.

Bits per byte = summed NLL (nats) / ln 2 / the UTF-8 bytes of the text the scored labels stand for
(docs/evaluation.md). Each family: the run's figure equals transformers' loss on the export x target tokens / target
bytes / ln 2; the evaluator gives the run's numbers on its checkpoint and on its export; and on a checkpoint that
transformers made (random init, a tokenizer built here) it equals transformers' loss.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import STDLIB_JSON
from family_fixtures import ENGINE_FAMILIES, FIXTURES

from spmdlm.cli import evaluate
from spmdlm.data.objectives import IGNORE_INDEX
from spmdlm.data.tokenization import (
    all_special_ids,
    save_tokenizer,
    special_token_ids,
    token_byte_lengths,
    train_tokenizer,
)
from spmdlm.engine.step import Stepper
from spmdlm.families import get_family
from spmdlm.launch import main as launch

TEXT = "Déjà vu: 東京 and naïve cafés — 3.14 ≠ π 🙂 plain ASCII too."
HF_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def words(n: int = 400, ascii_only: bool = False) -> list[str]:
    """Lines of words; ASCII only where a test decodes single tokens (a piece may hold part of a character)."""
    rng = np.random.default_rng(n)
    vocab = ["alpha", "beta", "gamma", "delta", "x=1", "return", "def", "(", ")", ","]
    vocab += [] if ascii_only else ["naïve", "café", "東京"]
    return [" ".join(rng.choice(vocab, 12)) for _ in range(n)]


# -- the byte table, without compiling anything -----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "roberta"])
def test_byte_level_tokens_sum_to_the_texts_utf8_bytes(family):
    tok = train_tokenizer(get_family(family), words() + [TEXT], 400)
    lengths = token_byte_lengths(tok, 512)
    ids = tok.encode(TEXT).ids
    specials = set(all_special_ids(tok, get_family(family)))
    assert any(i in specials for i in ids) == (family == "roberta")  # <s> ... </s>: 0 bytes
    assert lengths[ids].sum() == len(TEXT.encode())
    assert not lengths[list(specials)].any() and not lengths[tok.get_vocab_size() :].any()


def test_sentencepiece_pieces_count_the_normalised_text_with_one_leading_space():
    tok = train_tokenizer(get_family("t5"), words() + [TEXT], 300)
    lengths = token_byte_lengths(tok, 320)
    ids = tok.encode(TEXT).ids  # ends in </s>; characters never seen are <unk>: both special, 0 bytes
    unknown = ids.count(tok.token_to_id("<unk>"))
    known_text = tok.decode([i for i in ids if i != tok.token_to_id("<unk>")])
    assert unknown == 0, "the test text should be covered by the tokenizer"
    assert (
        lengths[ids].sum()
        == len((" " + tok.normalizer.normalize_str(TEXT)).encode())
        == len((" " + known_text).encode())
    )
    assert not lengths[list(all_special_ids(tok, get_family("t5")))].any()


# -- a run's figures and the evaluator ---------------------------------------------------------------------------------
@pytest.fixture
def eval_batches(monkeypatch):
    """Every batch an evaluation step sees, as numpy, with the running sums the step returned."""
    seen = []
    original = Stepper.eval_step

    def recording(self, state, batch, totals):
        sums = original(self, state, batch, totals)
        seen.append(({k: np.asarray(v) for k, v in batch.items()}, {k: np.asarray(v) for k, v in sums.items()}))
        return sums

    monkeypatch.setattr(Stepper, "eval_step", recording)
    return seen


def hf_figures(family: str, folder: Path, batches: list[dict]) -> dict[str, float]:
    """transformers' model of `folder`: its logits' cross-entropy over `batches` (mean over the labels the run
    reports) x target tokens / target bytes / ln 2, the bytes from transformers' tokenizer: each label's piece,
    decoded alone (the texts are ASCII here, so no piece splits a character), a SentencePiece '▁' as one space,
    special tokens none."""
    model = FIXTURES[family].hf_model_class.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    unscored = set(tokenizer.all_special_ids) if family == "bart" else set()  # BART reports its non-special labels
    nll = tokens = size = 0.0
    for batch in batches:
        labels = np.where(np.isin(batch["labels"], list(unscored)), IGNORE_INDEX, batch["labels"])
        inputs = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items() if k in HF_INPUTS}
        with torch.no_grad():  # labels are aligned with the logits (GPT-2's shifted already: not model(labels=))
            logits = model(**inputs).logits
        target = torch.as_tensor(labels, dtype=torch.long)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX)
        count = int((labels != IGNORE_INDEX).sum())
        nll, tokens = nll + loss.item() * count, tokens + count
        for i in labels[labels != IGNORE_INDEX].tolist():
            if i in tokenizer.all_special_ids:
                continue
            size += (
                len(tokenizer.convert_ids_to_tokens(i).replace("▁", " ").encode())
                if family == "t5"
                else len(tokenizer.decode([i], clean_up_tokenization_spaces=False).encode())
            )
    return {"loss": nll / tokens, "tokens": tokens, "bytes": size, "bits_per_byte": nll / size / math.log(2)}


def run_evaluator(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert evaluate.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def assert_same(found: dict, expected: dict, rel: float = 1e-5):
    for key in ("loss", "bits_per_byte", "tokens", "bytes"):
        assert found[key] == pytest.approx(expected[key], rel=rel), key


def transformers_checkpoint(family: str, folder: Path) -> Path:
    """A random transformers model of `family` and a tokenizer trained here, saved as model.safetensors +
    tokenizer.json (nothing downloaded)."""
    fixture = FIXTURES[family]
    tok = train_tokenizer(get_family(family), words(), 512)
    ids = special_token_ids(tok, get_family(family))
    values = {
        k: v
        for k, v in fixture.tiny_config.items()
        if k not in ("model_type", "feed_forward_proj", "tie_word_embeddings")
    }
    specials = {f"{role}_token_id": i for role, i in ids.items() if i is not None and role != "mask"}
    config = fixture.hf_config_class(**{**values, **specials})  # the tokenizer's ids win over the fixture's
    if family == "t5":
        config.decoder_start_token_id = ids["pad"]
    torch.manual_seed(0)
    model = fixture.hf_model_class(config)
    fixture.prepare_hf(model)
    model.save_pretrained(folder)
    save_tokenizer(tok, folder, get_family(family), 64)
    return folder


def evaluation_flags(family: str, cache_dir: Path, held_out: Path) -> tuple[str, ...]:
    return (
        "--validation_file",
        str(held_out),
        "--cache_dir",
        str(cache_dir),
        *FIXTURES[family].run_flags[:2],
        "--per_device_eval_batch_size",
        "1",
        "--max_eval_samples",
        "6",
        "--seed",
        "3",
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ENGINE_FAMILIES)  # Llama: Qwen3 runs its code (family_fixtures.py)
def test_bits_per_byte_of_a_run_and_of_the_evaluator_are_transformers_loss_over_the_bytes(
    family, tmp_path, cache_dir, eval_batches, capsys
):
    """A run that evaluates a transformers checkpoint (random init, a tokenizer built here), and the evaluator on
    the same checkpoint on another mesh: the figures of both equal transformers' on the batches they saw."""
    folder = transformers_checkpoint(family, tmp_path / "hf")
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(words(40, ascii_only=True)) + "\n")
    flags = evaluation_flags(family, cache_dir, held_out)
    out = tmp_path / "run"
    assert (
        launch(
            [
                "--model_name_or_path",
                str(folder),
                *flags,
                "--do_eval",
                "--output_dir",
                str(out),
                "--mesh",
                "data=8",
                "--report_to",
                "none",
            ]
        )
        == 0
    )
    ran = {k.removeprefix("eval_"): v for k, v in json.loads((out / "eval_results.json").read_text()).items()}
    assert_same(ran, hf_figures(family, folder, [batch for batch, _ in eval_batches]), rel=2e-4)

    found = run_evaluator(capsys, "--model_name_or_path", str(folder), *flags, "--mesh", "data=4,fsdp=2")
    assert found["kind"] == "transformers" and found["model_type"] == family
    assert_same(found, ran)
    assert "comparable" in found["note"]


@pytest.mark.slow
def test_the_evaluator_gives_a_runs_numbers_from_its_checkpoint_and_its_export(
    tmp_path, tiny_gpt2_config, cache_dir, eval_batches, capsys
):
    """Schedule-free AdamW: the run evaluates and exports the averaged parameters, which the checkpoint's model
    does not hold (its optimizer state does): the evaluator finds them too."""
    out = tmp_path / "run"
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(words(40, ascii_only=True)) + "\n")
    flags = evaluation_flags("gpt2", cache_dir, held_out)
    assert (
        launch(
            [
                "--train_file",
                STDLIB_JSON,
                *flags,
                "--config_name",
                str(tiny_gpt2_config),
                "--output_dir",
                str(out),
                "--max_steps",
                "1",
                "--per_device_train_batch_size",
                "1",
                "--mesh",
                "data=8",
                "--optim",
                "schedule_free_adamw",
                "--learning_rate",
                "0.05",
                "--report_to",
                "none",
            ]
        )
        == 0
    )
    ran = {k.removeprefix("eval_"): v for k, v in json.loads((out / "eval_results.json").read_text()).items()}
    assert_same(ran, hf_figures("gpt2", out / "hf", [batch for batch, _ in eval_batches]), rel=2e-4)
    from_checkpoint = run_evaluator(capsys, "--model_name_or_path", str(out), *flags, "--mesh", "data=4,tensor=2")
    from_step = run_evaluator(capsys, "--model_name_or_path", str(out / "checkpoints" / "1"), *flags)
    written = tmp_path / "results.json"
    from_export = run_evaluator(capsys, "--model_name_or_path", str(out / "hf"), *flags, "--output_file", str(written))
    assert json.loads(written.read_text()) == from_export
    assert [(r["kind"], r["step"]) for r in (from_checkpoint, from_step, from_export)] == [
        ("checkpoint", 1),
        ("checkpoint", 1),
        ("export", None),
    ]
    for found in (from_checkpoint, from_step, from_export):
        assert_same(found, ran)


def test_each_mixture_source_gets_its_bits_per_byte(tmp_path, cache_dir, capsys):
    folder = transformers_checkpoint("gpt2", tmp_path / "hf")
    texts = {"short": words(30, ascii_only=True), "long": [line + " " + line for line in words(20, ascii_only=True)]}
    sources = []
    for name, lines in texts.items():
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
        sources.append({"name": name, "train_file": f"{name}.txt", "validation_file": f"{name}.txt", "weight": 1})
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(json.dumps({"sources": sources}))  # JSON is YAML
    found = run_evaluator(
        capsys,
        "--model_name_or_path",
        str(folder),
        "--data_mixture",
        str(mixture),
        *evaluation_flags("gpt2", cache_dir, tmp_path / "short.txt")[2:],
        "--mesh",
        "data=4,fsdp=2",
    )
    per_source = found["per_source"]
    assert set(per_source) == {"short", "long"}
    assert sum(s["bytes"] for s in per_source.values()) == found["bytes"]
    nats = sum(s["bits_per_byte"] * s["bytes"] for s in per_source.values())
    assert found["bits_per_byte"] == pytest.approx(nats / found["bytes"], rel=1e-5)
    assert found["loss"] * found["tokens"] == pytest.approx(nats * math.log(2), rel=1e-5)


def bad_run(tmp_path) -> Path:
    """An output dir that looks like a run (run_config.json, a checkpoint folder) to the evaluator's first checks."""
    run = tmp_path / "run"
    (run / "checkpoints" / "1").mkdir(parents=True)
    (run / "run_config.json").write_text("{}")
    return run


@pytest.mark.parametrize(
    "argv, message",
    [
        ((), "give --model_name_or_path"),
        (("--model_name_or_path", "{tmp}"), "nothing to evaluate on"),
        (("--model_name_or_path", "{tmp}/nowhere", "--validation_file", "{tmp}/held_out.txt"), "no spmdlm run"),
        (
            ("--model_name_or_path", "{tmp}", "--validation_file", "{tmp}/held_out.txt", "--step", "3"),
            "--step applies to a training run",
        ),
        (
            (
                "--model_name_or_path",
                "{tmp}/run/checkpoints/1",
                "--validation_file",
                "{tmp}/held_out.txt",
                "--step",
                "3",
            ),
            "contradicts the checkpoint",
        ),
        (
            (
                "--model_name_or_path",
                "{tmp}",
                "--validation_file",
                "{tmp}/held_out.txt",
                "--output_file",
                "{tmp}/held_out.txt",
            ),
            "exists; give a new path",
        ),
        (("--model_name_or_path", "{tmp}", "--validation_file", "x", "--block_sizes", "3"), "unrecognized arguments"),
        (
            ("--model_name_or_path", "{tmp}", "--validation_file", "x", "--learning_rate", "3"),
            "--learning_rate does not",
        ),
        (("--model_name_or_path", "{tmp}", "--validation_file", "x", "--tasks_dir", "{tmp}"), "apply to --tasks"),
        (("--model_name_or_path", "{tmp}", "--tasks", "tiny_mc", "--tasks_dir", "{tmp}/nowhere"), "no such directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    bad_run(tmp_path)
    (tmp_path / "held_out.txt").write_text("kept as it is\n")
    assert evaluate.main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert (tmp_path / "held_out.txt").read_text() == "kept as it is\n"
