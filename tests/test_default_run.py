"""The README's first command: `python -m spmdlm.launch --mesh data=8` on the embedded corpus, in a fresh process.

Shortened with --max_steps so the suite stays fast; everything else is the quick-start configuration.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import COMPILE_FLAGS, REPO


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path):
    env = {**os.environ, "XLA_FLAGS": COMPILE_FLAGS}  # the launcher must simulate the devices
    out = tmp_path / "default"
    cmd = [
        sys.executable,
        "-m",
        "spmdlm.launch",
        "--mesh",
        "data=8",
        "--output_dir",
        str(out),
        "--max_steps",
        "40",
        "--eval_steps",
        "20",
        "--save_steps",
        "20",
        "--cache_dir",
        str(tmp_path / "cache"),
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "simulating 8 CPU devices" in first.stdout
    assert "embedded corpus" in first.stdout and "summary: train loss" in first.stdout
    assert "model gpt2 (config gpt2-tiny)" in first.stdout
    # not a terminal: plain lines, one per logging step (the quick start logs every 20), no progress-bar fragments
    assert "\r" not in first.stdout + first.stderr
    progress = [line for line in first.stdout.splitlines() if " INFO step " in line]
    assert [line.split(" INFO step ")[1].split(" |")[0] for line in progress] == ["20/40", "40/40"], progress
    assert all(" | lr " in line and " | grad_norm " in line and " | ETA " in line for line in progress)
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] < 7.0  # from ln(4096) = 8.3 at initialisation
    for name in (
        "loss_curve.png",
        "metrics.jsonl",
        "tensorboard",
        "checkpoints",
        "hf/model.safetensors",
        "hf/tokenizer.json",
    ):
        assert (out / name).exists(), name

    # The same command again: the run is complete, the data cache is reused, nothing is re-tokenized or rewritten.
    results_bytes = (out / "eval_results.json").read_bytes()
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "reusing the tokenized train cache" in second.stdout
    assert "is complete (step 40 of 40)" in second.stdout and "nothing to do" in second.stdout
    assert (out / "eval_results.json").read_bytes() == results_bytes
