"""End-to-end runs of the launcher in-process: meshes agree, resume is exact, a tiny model overfits."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, final_params, read_metrics, run_argv, run_killed_after_first_checkpoint

from spmdlm.launch import main


def launch(tmp_dir: Path, config: Path, cache_dir: Path, *extra: str) -> int:
    flags = dict(block_size=32, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate="3e-3")
    flags |= dict(warmup_steps=2, logging_steps=1, save_steps=100, max_eval_samples=32, export_hf=False, seed=7)
    return main(run_argv(tmp_dir, config, cache_dir, *extra, **flags))


def train_losses(output_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(output_dir) if "loss" in m]


@pytest.mark.slow
def test_tiny_model_overfits_a_small_text(tmp_path, cache_dir):
    config = tmp_path / "gpt2-overfit.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": 384,
                "n_positions": 64,
                "n_embd": 96,
                "n_layer": 2,
                "n_head": 4,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
            }
        )
    )
    out = tmp_path / "overfit"
    code = main(
        [
            "--train_file",
            str(FIXTURES / "overfit.txt"),
            "--config_name",
            str(config),
            "--output_dir",
            str(out),
            "--cache_dir",
            str(cache_dir),
            "--block_size",
            "24",
            "--per_device_train_batch_size",
            "1",
            "--mesh",
            "data=8",
            "--validation_split_percentage",
            "0",
            "--learning_rate",
            "5e-3",
            "--warmup_steps",
            "10",
            "--lr_scheduler_type",
            "constant",
            "--max_steps",
            "150",
            "--logging_steps",
            "10",
            "--save_steps",
            "1000",
            "--export_hf",
            "false",
            "--weight_decay",
            "0",
        ]
    )
    assert code == 0
    losses = train_losses(out)
    print("overfit losses:", [round(x, 3) for x in losses])
    assert losses[-1] < 0.1


@pytest.mark.slow
def test_run_outputs(tmp_path, tiny_gpt2_config, cache_dir):
    out = tmp_path / "outputs"
    assert (
        launch(
            out,
            tiny_gpt2_config,
            cache_dir,
            "--mesh",
            "data=4,tensor=2",
            "--max_steps",
            "6",
            "--logging_steps",
            "3",
            "--eval_steps",
            "3",
            "--do_train",
            "--do_eval",
        )
        == 0
    )
    names = {p.name for p in out.iterdir()}
    assert {
        "checkpoints",
        "metrics.jsonl",
        "eval_results.json",
        "loss_curve.png",
        "tensorboard",
        "tokenizer.json",
        "run_config.json",
    } <= names
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_perplexity"] == pytest.approx(np.exp(results["eval_loss"]), rel=1e-6)
    # bits per byte: the summed loss over the text's bytes (a byte-level BPE token has at least one byte)
    assert results["eval_bits_per_byte"] == pytest.approx(
        results["eval_loss"] * results["eval_tokens"] / results["eval_bytes"] / np.log(2), rel=1e-6
    )
    assert results["eval_bytes"] >= results["eval_tokens"]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics if "loss" in m] == [3, 6]
    assert [m["step"] for m in metrics if "eval_bits_per_byte" in m] == [3, 6]
    assert all(m["tokens_per_second"] > 0 for m in metrics if "loss" in m)
    # GPT-2's blocks of the joined stream have no padding: every token slot is a real token
    assert all(
        m["real_tokens_per_second"] == pytest.approx(m["tokens_per_second"]) and m["padding_fraction"] == 0
        for m in metrics
        if "loss" in m
    )


@pytest.mark.slow
def test_gradient_accumulation_matches_a_bigger_batch(tmp_path, tiny_gpt2_config, cache_dir):
    big = tmp_path / "big"
    accumulated = tmp_path / "accumulated"
    assert (
        launch(
            big,
            tiny_gpt2_config,
            cache_dir,
            "--mesh",
            "data=8",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
        )
        == 0
    )
    assert (
        launch(
            accumulated,
            tiny_gpt2_config,
            cache_dir,
            "--mesh",
            "data=8",
            "--max_steps",
            "3",
            "--gradient_accumulation_steps",
            "2",
        )
        == 0
    )
    np.testing.assert_allclose(train_losses(accumulated), train_losses(big), rtol=1e-5)


@pytest.mark.slow
def test_a_batch_size_ramp_resumed_mid_ramp_is_bitwise_the_uninterrupted_run(
    tmp_path, tiny_gpt2_config, cache_dir, monkeypatch, capsys
):
    """--batch_size_ramp 0:8,3:16 on 4 batch devices (at most 2 per device): 2 x 1 then 2 x 2 accumulation, one
    line at each change. Stopped at step 4 (in the second stage) and resumed, the run ends with the same parameters
    and losses, bit for bit; the learning rate of each step is the schedule at its final-batch step (examples / 16);
    the tokens seen count the real batches; a resume with another ramp is refused."""
    args = ("--mesh", "data=4,tensor=2", "--batch_size_ramp", "0:8,3:16", "--max_steps", "6", "--do_train")
    args += ("--save_steps", "4", "--lr_scheduler_type", "linear")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert launch(whole, tiny_gpt2_config, cache_dir, *args) == 0
    changes = [
        line.split(" INFO ", 1)[-1] for line in capsys.readouterr().out.splitlines() if ": global batch " in line
    ]
    assert changes == [
        "step 0: global batch 8 (2 per device x 4 batch devices x 1 accumulation; --batch_size_ramp 0:8,3:16)",
        "step 3: global batch 16 (2 per device x 4 batch devices x 2 accumulation; --batch_size_ramp 0:8,3:16)",
    ]
    run_killed_after_first_checkpoint(monkeypatch, lambda: launch(resumed, tiny_gpt2_config, cache_dir, *args))
    assert launch(resumed, tiny_gpt2_config, cache_dir, *args) == 0
    assert train_losses(resumed) == train_losses(whole)
    ours, theirs = final_params(resumed), final_params(whole)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)

    records = [m for m in read_metrics(whole) if "loss" in m]
    seen = np.cumsum([8, 8, 8, 16, 16, 16])
    assert [m["tokens_seen"] for m in records] == (seen * 32).tolist()  # --block_size 32
    x, horizon = np.concatenate([[0], seen[:-1]]) / 16, math.ceil(seen[-1] / 16)  # final-batch steps: 0 .. 3.5 of 5
    expected = 3e-3 * np.where(x < 2, x / 2, 1 - (x - 2) / (horizon - 2))  # --warmup_steps 2, then linear to 0
    np.testing.assert_allclose([m["learning_rate"] for m in records], expected, rtol=1e-6)
    assert json.loads((whole / "run_config.json").read_text())["batch_size_ramp"] == "0:8,3:16"
    other = [*args[:3], "0:8,2:16", *args[4:]]
    assert launch(resumed, tiny_gpt2_config, cache_dir, *other) == 2
    assert "other settings (batch_size_ramp)" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_onto_another_mesh_and_evaluate_only(tmp_path, tiny_gpt2_config, cache_dir, monkeypatch):
    args = ("--max_steps", "6", "--save_steps", "3", "--global_batch_size", "16", "--export_hf", "false")
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    assert launch(whole, tiny_gpt2_config, cache_dir, "--mesh", "data=8", *args) == 0
    run_killed_after_first_checkpoint(
        monkeypatch, lambda: launch(moved, tiny_gpt2_config, cache_dir, "--mesh", "data=8", *args)
    )
    # The restore target takes the new mesh's shardings: the run continues on 2x2x2, and with another attention
    # implementation (the same math).
    assert (
        launch(
            moved, tiny_gpt2_config, cache_dir, "--mesh", "data=2,fsdp=2,tensor=2", *args, "--attention", "dot_product"
        )
        == 0
    )
    np.testing.assert_allclose(train_losses(moved), train_losses(whole), rtol=1e-4)
    chosen = lambda out: json.loads((out / "run_config.json").read_text())["attention_implementation"]
    assert (chosen(whole), chosen(moved)) == ("xla", "dot_product")  # --attention auto is xla on the CPU

    final = json.loads((whole / "eval_results.json").read_text())["eval_loss"]
    assert launch(whole, tiny_gpt2_config, cache_dir, "--mesh", "fsdp=8", *args, "--do_eval") == 0
    assert json.loads((whole / "eval_results.json").read_text())["eval_loss"] == pytest.approx(final, rel=1e-5)


@pytest.mark.slow
def test_dry_run_compiles_and_stops_leaving_the_disk_unchanged(tmp_path, tiny_gpt2_config, cache_dir, capsys):
    out = tmp_path / "dry"
    snapshot = lambda: sorted((p, p.stat().st_mtime_ns) for d in (tmp_path, cache_dir) for p in d.rglob("*"))
    before = snapshot()
    assert launch(out, tiny_gpt2_config, cache_dir, "--mesh", "data=8", "--max_steps", "5", "--dry_run") == 0
    assert snapshot() == before and not out.exists()  # no tokenizer, run_config.json, metrics.jsonl or cache entry
    logged = [line.split(" INFO ", 1)[-1] for line in capsys.readouterr().out.splitlines()]
    assert logged[0] == f"output dir {out}: --dry_run writes nothing there"
    compiled = [line for line in logged if line.startswith("train step compiled in")]
    assert len(compiled) == 1 and "temporaries" in compiled[0]
