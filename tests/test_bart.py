"""BART denoising pretraining end to end: a tiny model trained on a generated corpus reconstructs a masked sentence
with transformers' generate on its export, and sentence ends reach the prepared records as flags."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import COMPILE_FLAGS, REPO, read_metrics

from spmdlm.data import records, token_cache
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.data.tokenization import train_tokenizer
from spmdlm.families import get_family

TINY = {
    "model_type": "bart",
    "vocab_size": 512,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
    "max_position_embeddings": 64,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}


WORDS = (
    "apple river stone cloud green quick silent bridge north keeper paper window garden yellow seven little "
    "table market winter summer horse engine signal copper bright rain forest letter basket sail harbour island "
    "morning evening candle mirror silver thunder valley meadow orange purple castle tower shadow ladder pocket "
    "button rabbit kettle needle pillow saddle tunnel violin wagon"
).split()
TARGET = "The keeper lit the lamp."


def denoising_corpus(path) -> None:
    """20,000 lines of random words (nothing to memorise: the model must learn to copy its input) and, every fifth
    line, one fixed sentence (something to know when a word of it is masked)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(20_000):
        lines.append(" ".join(rng.choice(WORDS, rng.integers(3, 7))).capitalize() + ".")
        if i % 5 == 0:
            lines.append(TARGET)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_export_reconstructs_a_masked_sentence(tmp_path, cache_dir):
    config, corpus, out = tmp_path / "bart-micro.json", tmp_path / "corpus.txt", tmp_path / "bart"
    config.write_text(json.dumps(TINY))
    denoising_corpus(corpus)
    # One device in a process of its own: 1,100 steps of this tiny model cost 40 ms each there against 68 ms on
    # this process's 8 simulated devices (what is learnt is the same; the meshes have tests of their own). Copying
    # comes at step ~700 (eval accuracy 0.22 at 600, 0.82 at 700, 0.92 at 800 on jax 0.10.2): 1,100 steps leave
    # 400 of margin (a learning rate of 4e-3 was tried: no copying by step 900).
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmdlm.launch",
            "--config_name",
            str(config),  # no --model_type: the config says bart
            "--train_file",
            str(corpus),
            "--output_dir",
            str(out),
            "--cache_dir",
            str(cache_dir),
            "--max_seq_length",
            "16",
            "--mesh",
            "data=1",
            "--per_device_train_batch_size",
            "64",
            "--max_steps",
            "1100",
            "--learning_rate",
            "2e-3",
            "--warmup_steps",
            "50",
            "--lr_scheduler_type",
            "constant",
            "--logging_steps",
            "200",
            "--eval_steps",
            "1100",
            "--max_eval_samples",
            "256",
            "--save_steps",
            "5000",
            "--seed",
            "2",
            # 5% masked, not BART's 30%, and 64 per batch: the model must discover copying, a sudden transition whose
            # timing at 30% (or 15%) and 32 per batch depended on the data order (some seeds had it by step 1000,
            # others not by 1800); now it comes by step ~700 for the seeds tried, and ~1300 on jax 0.12, whose
            # rounding differs. The infilling itself: test_denoising_objective.py.
            "--mask_ratio",
            "0.05",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "XLA_FLAGS": COMPILE_FLAGS},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    print(
        "bart eval loss",
        [round(m["eval_loss"], 3) for m in evals],
        "accuracy",
        [round(m["eval_accuracy"], 3) for m in evals],
    )
    assert evals[-1]["eval_accuracy"] > 0.6  # copying through cross-attention: random words cannot be predicted
    # eval_* count the content targets (as the HF script); <s> and </s> are the easy ones
    assert evals[-1]["eval_tokens"] < evals[-1]["eval_tokens_all_positions"]
    assert evals[-1]["eval_accuracy_all_positions"] > evals[-1]["eval_accuracy"]

    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert isinstance(tokenizer, transformers.BartTokenizerFast) and tokenizer.mask_token_id == 4
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out / "hf").eval()
    assert model.generation_config.decoder_start_token_id == 2 and model.generation_config.forced_eos_token_id == 2
    for masked in ("The keeper lit the<mask>.", "The<mask> lit the lamp."):
        with torch.no_grad():
            generated = model.generate(
                **tokenizer(masked, return_tensors="pt"), max_new_tokens=20, num_beams=1, do_sample=False
            )
        text = tokenizer.decode(generated[0], skip_special_tokens=True)
        print(f"{masked!r} -> {text!r}")
        assert text.strip() == TARGET


def test_sentence_ends_are_flagged_in_prepared_records(tmp_path):
    docs = ["One sentence here. Another one follows! And a third?", "Second document without punctuation"]
    tok = train_tokenizer(get_family("bart"), docs * 5, 300)
    split = token_cache.prepare_split(docs, tok, records.Cut(8, 2, "sentences"), cache_dir=tmp_path, name="train")
    stream = records.record_source(split).read(np.arange(split.num_records)).reshape(-1)
    ids, ends = stream & (SENTENCE_END - 1), (stream & SENTENCE_END) != 0
    expected = []
    for doc in docs:
        enc = tok.encode(doc, add_special_tokens=False)
        expected += enc.ids + [2]
    np.testing.assert_array_equal(ids, np.asarray(expected[: len(ids)]))
    decoded_ends = [tok.decode(ids[: i + 1].tolist()).rstrip()[-1] for i in np.flatnonzero(ends)]
    assert decoded_ends[:3] == [".", "!", "?"]  # the last token of each sentence carries the flag
