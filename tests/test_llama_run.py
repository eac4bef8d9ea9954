"""Llama and Qwen3 learn through the launcher: a tiny run on data/ text lowers its evaluation loss, and its export
loads in transformers' AutoModelForCausalLM and continues prompts with the same greedy tokens as our
`spmdlm.generate` (through the KV cache: grouped key/value heads, and Qwen3's sliding window shorter than the
prompts plus the new tokens). Exact resumption after a kill is test_families.py's, for every family."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from conftest import REPO, read_metrics
from family_fixtures import FIXTURES

from spmdlm import hf_export
from spmdlm.data.tokenization import load_tokenizer
from spmdlm.generation import generate_ids
from spmdlm.launch import main

PROMPTS = ["The lighthouse keeper", "She asked whether the lamp", "the sea", "A woman rowed ashore with a basket of"]
NEW_TOKENS = 12
WINDOW = 6  # qwen3's sliding layers: shorter than every prompt plus its new tokens


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tiny_run_learns_and_its_export_generates_as_transformers(family, tmp_path, cache_dir):
    values = {**FIXTURES[family].tiny_config, "max_position_embeddings": 64}
    if family == "qwen3":
        values.update(sliding_window=WINDOW)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(values))
    out = tmp_path / "run"
    flags = ["--config_name", str(config_path), "--train_file", str(REPO / "data" / "overfit.txt")]
    flags += ["--output_dir", str(out), "--cache_dir", str(cache_dir), "--mesh", "data=2,fsdp=2,tensor=2"]
    flags += ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--max_steps", "40"]
    flags += ["--eval_steps", "10", "--logging_steps", "10", "--save_steps", "40", "--warmup_steps", "4", "--seed", "3"]
    assert main([*flags, "--block_size", "32", "--learning_rate", "1e-2"]) == 0

    # a random model's logits are near uniform, its loss near ln(vocab_size) = 6.2; data/overfit.txt is 17 training
    # records, so the held-out loss falls fast and then rises as the model memorises them (train loss ~1.2 at 40)
    evals = [record["eval_loss"] for record in read_metrics(out) if "eval_loss" in record]
    assert len(evals) == 4 and evals[0] < math.log(values["vocab_size"]) - 1 and min(evals[1:]) < evals[0], evals

    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert type(hf).__name__ == FIXTURES[family].hf_model_class.__name__
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    hf_tokenizer.pad_token, hf_tokenizer.padding_side = hf_tokenizer.eos_token, "left"
    batch = hf_tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    theirs = generated[:, batch["input_ids"].shape[1] :].tolist()

    model, config = hf_export.load_hf(out / "hf")
    ours = generate_ids(model, config, load_tokenizer(out / "hf"), PROMPTS, max_new_tokens=NEW_TOKENS)
    eos = config.eos_token_id
    assert ours == [row[: row.index(eos) + 1] if eos in row else row for row in theirs]
    assert len({tuple(row) for row in ours}) > 1  # not one continuation for every prompt
