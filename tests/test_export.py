"""Transformers interop of trained runs (GPT-2): the export scores like our eval, the export CLI, continued
pretraining and export errors. Parity on random models of every family: test_families.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import FIXTURES, STDLIB_JSON, run_argv
from safetensors.numpy import load_file

from spmdlm import hf_export, load
from spmdlm.cli.export import main as export_main
from spmdlm.launch import main


def train(out: Path, mesh: str, config: Path, cache_dir: Path, *extra) -> None:
    flags = dict(block_size=32, global_batch_size=16, mesh=mesh, max_steps=6, logging_steps=3, learning_rate="3e-3")
    flags |= dict(max_eval_samples=32, per_device_eval_batch_size=2)
    assert main(run_argv(out, config, cache_dir, *extra, **flags)) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_gpt2_config, cache_dir):
    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, "data=8", tiny_gpt2_config, cache_dir)
    return out


@pytest.mark.slow
def test_trained_export_gives_the_same_eval_loss_in_transformers(trained):
    hf_dir = trained / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    # Rebuild the held-out examples exactly as the run did and score them with PyTorch.
    from spmdlm.data import datasets, pipeline
    from spmdlm.data.objectives.clm import CausalLM
    from spmdlm.data.tokenization import load_tokenizer

    cache = Path(json.loads((trained / "run_config.json").read_text())["cache_dir"] or Path.home())
    ours_tokenizer = datasets.tokenizer_hash(load_tokenizer(trained / "tokenizer.json"))
    split = next(  # the run's held-out records: the validation cache of its tokenizer and length
        datasets.open_split(card_path.parent, card, "validation", verify=False)
        for card_path in cache.glob("*-validation/dataset.json")
        if (card := json.loads(card_path.read_text()))["tokenizer"]["sha256"] == ours_tokenizer
        and card["record_length"] == 32 + 1
    )
    batches = list(pipeline.eval_batches(split, CausalLM(32), seed=42, global_batch=16, max_examples=32))
    total, count = 0.0, 0
    for batch in batches:
        with torch.no_grad():
            logits = model(torch.tensor(batch["input_ids"], dtype=torch.long)).logits
        labels = torch.tensor(batch["labels"], dtype=torch.long)
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels != -100).sum())
    assert total / count == pytest.approx(ours, abs=1e-4)
    text = "def load(fp):"
    ids = tokenizer(text, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == export_ids(trained, text)
    generated = model.generate(
        **ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    assert generated.shape[1] == ids["input_ids"].shape[1] + 8


def export_ids(run_dir: Path, text: str) -> list[int]:
    from spmdlm.data.tokenization import load_tokenizer

    return load_tokenizer(run_dir).encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_export_cli_and_sharded_checkpoint_match(trained, tmp_path, tiny_gpt2_config, cache_dir, capsys):
    sharded = tmp_path / "sharded"
    train(sharded, "data=2,fsdp=2,tensor=2", tiny_gpt2_config, cache_dir, "--export_hf", "false")
    assert export_main(["--checkpoint", str(sharded), "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert (
        export_main(["--checkpoint", str(trained), "--out", str(tmp_path / "b"), "--step", "6", "--mesh", "fsdp=8"])
        == 0
    )
    # the card, the usage snippet on the local path, and what the transformers side needs (also in the output)
    card = (tmp_path / "b" / "README.md").read_text()
    assert "checkpoint at step 6" in card and f'model_id = "{tmp_path.name}/b"' in card
    assert hf_export.TORCH_CPU_INSTALL in card  # what the card's reader needs; the hint is printed only without PyTorch
    assert hf_export.TORCH_CPU_INSTALL not in capsys.readouterr().out
    assert hf_export.export_complete(tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    # Adam turns float-rounding differences in near-zero gradients into lr-sized steps, so weights agree to
    # ~lr; what the cross-mesh tolerance bounds is the model's loss.
    print(f"largest weight difference between data=8 and data=2,fsdp=2,tensor=2 exports: {worst:.2e}")
    assert worst < 1e-3
    ids = np.random.default_rng(0).integers(0, 512, (4, 32))
    losses = []
    for name in ("a", "b"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            losses.append(model(torch.tensor(ids), labels=torch.tensor(ids)).loss.item())
    print(f"loss of the two exports on a random batch: {losses}")
    assert abs(losses[0] - losses[1]) / losses[1] < 1e-4
    assert (tmp_path / "a" / "tokenizer.json").exists()


@pytest.mark.slow
def test_continued_pretraining_from_a_transformers_checkpoint(trained, tmp_path, cache_dir):
    out = tmp_path / "continued"
    code = main(
        [
            "--model_name_or_path",
            str(trained / "hf"),
            "--train_file",
            STDLIB_JSON,
            "--output_dir",
            str(out),
            "--cache_dir",
            str(cache_dir),
            "--block_size",
            "32",
            "--global_batch_size",
            "16",
            "--max_steps",
            "1",
            "--learning_rate",
            "0",
            "--warmup_steps",
            "0",
            "--max_eval_samples",
            "32",
            "--per_device_eval_batch_size",
            "2",
            "--export_hf",
            "false",
        ]
    )
    assert code == 0
    start = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    after = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert after == pytest.approx(start, abs=1e-5)  # lr 0: the loaded weights, unchanged


def test_export_errors_write_nothing(tmp_path, trained, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main(["--checkpoint", str(empty), "--out", str(tmp_path / "x")]) == 2
    assert "no run_config.json" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(trained), "--out", str(tmp_path / "x"), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at step 5" in err and "available: 6" in err
    assert not (tmp_path / "x").exists()
    bert = tmp_path / "bert"
    transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).save_pretrained(bert)
    with pytest.raises(Exception, match=r"holds a 'bert' model \(BertForMaskedLM\)"):
        hf_export.load_hf(bert)
    assert (
        main(
            [
                "--model_name_or_path",
                str(bert),
                "--train_file",
                str(FIXTURES / "overfit.txt"),
                "--output_dir",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    assert "holds a 'bert' model" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_export_of_a_schedule_free_run_is_the_model_it_evaluated_and_exported(
    tmp_path, tiny_gpt2_config, cache_dir, monkeypatch
):
    """Schedule-free AdamW evaluates its averaged parameters, not the interpolated ones it trains: `export
    --checkpoint` (and `generate --checkpoint`, which loads through it) gives the run's own hf/ export."""
    run = tmp_path / "run"
    train(
        run,
        "data=8",
        tiny_gpt2_config,
        cache_dir,
        "--optim",
        "schedule_free_adamw",
        "--max_steps",
        "2",
        "--do_eval",
        "false",
    )
    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "export")]) == 0
    own, exported = (load_file(path / "model.safetensors") for path in (run / "hf", tmp_path / "export"))
    assert own.keys() == exported.keys()
    for key in own:
        np.testing.assert_array_equal(exported[key], own[key], err_msg=key)
    monkeypatch.setattr(load, "evaluation_needs_optimizer", lambda optim: False)  # the interpolated parameters
    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "interpolated")]) == 0
    interpolated = load_file(tmp_path / "interpolated" / "model.safetensors")
    assert max(float(np.max(np.abs(interpolated[k] - own[k]))) for k in own) > 1e-4
