"""RoBERTa masked-LM pretraining end to end: it learns below the unigram entropy, its export answers
transformers' fill-mask pipeline, line-by-line data works, and bad inputs get one-line errors."""

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from conftest import FIXTURES, read_metrics, run_argv

from spmdlm.data.tokenization import load_tokenizer, save_tokenizer, train_tokenizer
from spmdlm.families import get_family
from spmdlm.launch import main

TINY = {
    "model_type": "roberta",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 66,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "type_vocab_size": 1,
    "layer_norm_eps": 1e-5,
}


@pytest.fixture()
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "roberta-micro.json"
    path.write_text(json.dumps(TINY))
    return path


def launch(out: Path, config: Path, cache_dir: Path, *extra: str) -> int:
    flags = dict(model_type="roberta", max_seq_length=32, mesh="data=2,fsdp=2,tensor=2", per_device_train_batch_size=4)
    flags |= dict(per_device_eval_batch_size=4, warmup_steps=10, save_steps=1000, seed=1)
    return main(run_argv(out, config, cache_dir, *extra, train_file=None, **flags))


def unigram_entropy(tokenizer_dir: Path, files: list[Path]) -> float:
    """Entropy (nats/token) of the training text's token frequencies: what a model without context can reach."""
    tok = load_tokenizer(tokenizer_dir)
    counts = Counter()
    for path in files:
        for line in path.read_text().splitlines():
            counts.update(tok.encode(line, add_special_tokens=False).ids)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


@pytest.mark.slow
def test_roberta_learns_and_its_export_fills_masks(tmp_path, tiny_config, cache_dir):
    """Trained and evaluated on one small text: the masked-LM loss must fall far below the text's unigram entropy
    (impossible without using the context), and transformers' fill-mask pipeline must answer from the export."""
    out = tmp_path / "overfit"
    text = str(FIXTURES / "overfit.txt")
    assert (
        launch(
            out,
            tiny_config,
            cache_dir,
            "--train_file",
            text,
            "--validation_file",
            text,
            "--max_steps",
            "300",
            "--learning_rate",
            "5e-3",
            "--lr_scheduler_type",
            "constant",
            "--logging_steps",
            "50",
            "--eval_steps",
            "100",
            "--weight_decay",
            "0",
        )
        == 0
    )
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    entropy = unigram_entropy(out, [FIXTURES / "overfit.txt"])
    print(
        "roberta eval loss",
        [round(m["eval_loss"], 3) for m in evals],
        "accuracy",
        [round(m["eval_accuracy"], 3) for m in evals],
        f"unigram entropy {entropy:.3f}",
    )
    assert evals[-1]["eval_loss"] < entropy - 1.0
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"] + 0.2

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert isinstance(tokenizer, transformers.RobertaTokenizerFast) and tokenizer.mask_token_id == 4
    fill = transformers.pipeline("fill-mask", model=str(out / "hf"), tokenizer=tokenizer, device="cpu")
    sentence = "The lighthouse keeper wrote the same three lines in his log every evening before he lit the<mask>."
    answers = fill(sentence, top_k=5)
    print("fill-mask:", [(a["token_str"], round(a["score"], 3)) for a in answers])
    assert "lamp" in [a["token_str"].strip() for a in answers]


@pytest.mark.slow
def test_line_by_line_with_padding(tmp_path, tiny_config, cache_dir):
    out = tmp_path / "lines"
    assert (
        launch(
            out,
            tiny_config,
            cache_dir,
            "--train_file",
            str(FIXTURES / "overfit.txt"),
            "--line_by_line",
            "--pad_to_max_length",
            "--validation_split_percentage",
            "0",
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--learning_rate",
            "1e-3",
            "--export_hf",
            "false",
        )
        == 0
    )
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_tokenizer_without_mask_token_is_refused(tmp_path, tiny_config, cache_dir, capsys):
    gpt2_tok = tmp_path / "gpt2-tokenizer"
    save_tokenizer(
        train_tokenizer(get_family("gpt2"), (FIXTURES / "overfit.txt").read_text().splitlines(), 300),
        gpt2_tok,
        get_family("gpt2"),
        model_max_length=64,
    )
    out = tmp_path / "out"
    assert (
        launch(
            out,
            tiny_config,
            cache_dir,
            "--train_file",
            str(FIXTURES / "overfit.txt"),
            "--tokenizer_name",
            str(gpt2_tok),
            "--max_steps",
            "2",
        )
        == 2
    )
    assert "mask token '<mask>'" in one_error_line(capsys)


def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path, cache_dir, capsys):
    config = tmp_path / "small-vocab.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 300}))
    tok_dir = tmp_path / "tok"
    save_tokenizer(
        train_tokenizer(get_family("roberta"), (FIXTURES / "overfit.txt").read_text().splitlines(), 400),
        tok_dir,
        get_family("roberta"),
        model_max_length=64,
    )
    assert (
        launch(
            tmp_path / "out",
            config,
            cache_dir,
            "--train_file",
            str(FIXTURES / "overfit.txt"),
            "--tokenizer_name",
            str(tok_dir),
            "--max_steps",
            "2",
        )
        == 2
    )
    assert "vocab_size is 300" in one_error_line(capsys)


def test_sequence_longer_than_the_positions_is_refused(tmp_path, tiny_config, cache_dir, capsys):
    assert (
        main(
            [
                "--model_type",
                "roberta",
                "--config_name",
                str(tiny_config),
                "--train_file",
                str(FIXTURES / "overfit.txt"),
                "--output_dir",
                str(tmp_path / "out"),
                "--max_seq_length",
                "128",
                "--mesh",
                "data=8",
            ]
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "--max_seq_length 128" in line and "64 positions" in line
    assert not (tmp_path / "out").exists()
