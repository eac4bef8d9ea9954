"""T5 v1.1 span-corruption pretraining end to end: it learns and exports (exact resume: test_families.py)."""

import json
from pathlib import Path

import pytest
from conftest import read_metrics, run_argv

from spmdlm.launch import main


def launch(out: Path, cache_dir: Path, *extra: str) -> int:
    flags = dict(model_type="t5", adafactor=True, mesh="data=4,fsdp=2", max_seq_length=64, learning_rate="1e-2")
    flags |= dict(per_device_train_batch_size=2, per_device_eval_batch_size=4, warmup_steps=5, weight_decay="0.001")
    flags |= dict(logging_steps=5, max_eval_samples=64, seed=3)
    return main(run_argv(out, "t5-v1_1-tiny", cache_dir, *extra, **flags))


@pytest.mark.slow
def test_t5_learns_and_exports(tmp_path, cache_dir):
    out = tmp_path / "t5"
    assert launch(out, cache_dir, "--max_steps", "60", "--eval_steps", "5", "--save_steps", "1000") == 0
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    first, last = evals[0], evals[-1]
    print(
        "t5 eval loss",
        [round(m["eval_loss"], 3) for m in evals],
        "accuracy",
        [round(m["eval_accuracy"], 3) for m in evals],
    )
    assert last["eval_loss"] < first["eval_loss"] - 1.0
    assert last["eval_accuracy"] > first["eval_accuracy"] + 0.05
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["model_type"] == "t5" and config["tie_word_embeddings"] is False
