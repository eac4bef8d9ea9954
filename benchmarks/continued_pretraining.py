"""Continued pretraining against training from scratch at equal steps on a new corpus (docs/continued_pretraining.md).

    python benchmarks/continued_pretraining.py [--families roberta,t5] [--steps_a 600] [--steps_b 100]
        [--continued_lr_scale 1.0] [--keep]

Per family, with tiny models whose checkpoints transformers writes:
1. a random transformers model (RoBERTa, or T5 v1.1-shaped) and a tokenizer trained on corpus A, saved as released
   checkpoints are (pytorch_model.bin; vocab.json + merges.txt, or spiece.model);
2. pretrained on corpus A for --steps_a steps (`--model_name_or_path` that checkpoint), its export saved again in the
   released layout: the "released checkpoint";
3. on corpus B, the same number of steps (--steps_b) twice: continued from the released checkpoint (its own
   tokenizer), and from scratch (same architecture and tokenizer). Both take the pretraining's optimizer flags and
   warmup, and its rate (the continued run's times --continued_lr_scale): only the starting point differs.
Corpus A is this Python's standard-library sources of some packages, corpus B another package's (asyncio): the
same language, another domain. Prints one JSON line per run and a markdown table of B's eval loss by step (step 0:
an evaluation-only run of each starting point).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_A = ("email", "http", "json", "logging", "urllib", "xml", "importlib", "concurrent")
CORPUS_B = ("asyncio",)
COMMON = [
    "--mesh",
    "data=1",
    "--global_batch_size",
    "16",
    "--export_hf",
    "true",
    "--sample_prompts=",
    "--logging_steps",
    "50",
    "--max_eval_samples",
    "256",
    "--per_device_eval_batch_size",
    "32",
]
FAMILIES = {  # the model (transformers config), its length flags, its optimizer and learning rate
    "roberta": dict(
        config=dict(
            vocab_size=2048,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=66,
        ),
        lengths=["--max_seq_length", "64"],
        optimizer=[],
        learning_rate=1e-3,
    ),
    "t5": dict(
        config=dict(
            vocab_size=2048,
            d_model=128,
            d_kv=32,
            d_ff=256,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            dropout_rate=0.0,
        ),
        lengths=["--max_seq_length", "64"],
        optimizer=["--adafactor"],
        learning_rate=1e-2,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--families", default="roberta,t5")
    p.add_argument("--steps_a", type=int, default=600, help="pretraining steps on corpus A")
    p.add_argument("--steps_b", type=int, default=100, help="steps on corpus B, continued and from scratch")
    p.add_argument("--eval_steps", type=int, default=25)
    p.add_argument(
        "--continued_lr_scale",
        type=float,
        default=1.0,
        help="the continued run's learning rate as a multiple of the pretraining (and scratch) rate",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args(argv)


def write_corpus(path: Path, packages: tuple[str, ...]) -> Path:
    path.write_text("".join(p.read_text() for package in packages for p in sorted((STDLIB / package).rglob("*.py"))))
    return path


def base_checkpoint(family: str, folder: Path, corpus_a: Path) -> None:
    """A random transformers model and a tokenizer trained on corpus A, in the layout released checkpoints have."""
    import torch
    import transformers

    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    folder.mkdir(parents=True)
    config = dict(FAMILIES[family]["config"])
    torch.manual_seed(0)  # the random initialisation: the same checkpoint every time
    if family == "t5":
        import sentencepiece

        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus_a),
            model_prefix=str(folder / "spiece"),
            vocab_size=config["vocab_size"] - 100,
            model_type="unigram",
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            minloglevel=2,
            max_sentence_length=100_000,
        )
        (folder / "spiece.vocab").unlink()
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**config))
    else:
        lines = corpus_a.read_text().splitlines()
        train_tokenizer(get_family(family), lines, config["vocab_size"]).model.save(str(folder))
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**config))
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


def release(export: Path, base: Path, folder: Path) -> None:
    """The pretrained export, saved again as released checkpoints are: pytorch_model.bin and the base's tokenizer
    files (the run used that tokenizer)."""
    import torch
    from safetensors.torch import load_file

    folder.mkdir(parents=True)
    shutil.copy(export / "config.json", folder / "config.json")
    torch.save(load_file(export / "model.safetensors"), folder / "pytorch_model.bin")
    for name in ("vocab.json", "merges.txt", "spiece.model"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)


def launch(out: Path, *flags: str) -> dict:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "spmdlm.launch", "--output_dir", str(out), *COMMON, *flags],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{out.name} failed:\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {m["step"]: round(m["eval_loss"], 4) for m in metrics if "eval_loss" in m}
    if not evals:  # an evaluation-only run: its one evaluation
        evals = {0: round(json.loads((out / "eval_results.json").read_text())["eval_loss"], 4)}
    return {"run": out.name, "eval_loss": evals, "wall_s": round(time.perf_counter() - start, 1)}


def compare(family: str, work: Path, args) -> list[dict]:
    spec = FAMILIES[family]
    corpus_a = write_corpus(work / "a.txt", CORPUS_A)
    corpus_b = write_corpus(work / "b.txt", CORPUS_B)
    base, released = work / f"{family}-base", work / f"{family}-released"
    base_checkpoint(family, base, corpus_a)
    every = ["--eval_steps", str(args.eval_steps), *spec["lengths"], *spec["optimizer"]]
    rate = spec["learning_rate"]
    pretrain = ["--learning_rate", str(rate), "--warmup_steps", "30"]
    continued = ["--learning_rate", str(rate * args.continued_lr_scale), "--warmup_steps", "30"]
    runs = [
        launch(
            work / f"{family}-pretrain-a",
            "--model_name_or_path",
            str(base),
            "--train_file",
            str(corpus_a),
            "--max_steps",
            str(args.steps_a),
            *pretrain,
            *every,
        )
    ]
    release(work / f"{family}-pretrain-a" / "hf", base, released)
    on_b = ["--train_file", str(corpus_b), "--max_steps", str(args.steps_b), *every]
    scratch = ["--config_name", str(released), "--tokenizer_name", str(released)]
    runs += [
        launch(work / f"{family}-continued-step0", "--model_name_or_path", str(released), "--do_eval", *on_b),
        launch(work / f"{family}-scratch-step0", *scratch, "--do_eval", *on_b),
        launch(work / f"{family}-continued", "--model_name_or_path", str(released), *continued, *on_b),
        launch(work / f"{family}-scratch", *scratch, *pretrain, *on_b),
    ]
    for run in runs:
        print(json.dumps({"family": family, **run}), flush=True)
    return runs


def table(family: str, runs: list[dict]) -> str:
    by_name = {run["run"].removeprefix(f"{family}-"): run["eval_loss"] for run in runs}
    continued = {**by_name["continued-step0"], **by_name["continued"]}
    scratch = {**by_name["scratch-step0"], **by_name["scratch"]}
    rows = [f"| {family} step on B | from scratch | continued |", "| ---: | ---: | ---: |"]
    rows += [f"| {step} | {scratch[step]:.3f} | {continued[step]:.3f} |" for step in sorted(continued)]
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-continued-", dir="/tmp"))
    try:
        tables = [table(family, compare(family, work, args)) for family in args.families.split(",")]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
