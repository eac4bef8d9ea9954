"""MLM --line_by_line with and without --packing on a real short-line corpus: padding, real tokens/s, eval loss.

    python benchmarks/bench_packing.py                       # 320 steps, batch 32, length 128 (2 CPUs: ~15 min)
    python benchmarks/bench_packing.py --steps 100 --out /tmp/bench-packing

1. The corpus: the first line of every docstring (module, class, function) of this Python's standard library
   sources (spmdlm.data.readers.embedded_corpus_files: no tests), files in path order, nodes in source order,
   each line once; one per line in OUT/docstrings.txt. Deterministic for a given Python.
2. One tokenizer for all runs (python -m spmdlm.tokenizer, the roberta-tiny vocabulary).
3. Three launcher runs (python -m spmdlm.launch --model_type roberta --config_name roberta-tiny --line_by_line,
   the same seed, constant learning rate after 30 warmup steps, evaluated on the same held-out lines: the
   launcher's hash split of the documents, every held-out line, no cap), R being how many times more real tokens a
   packed example holds than a padded one:
   - padded: --batch_size examples a step, --steps steps, evaluated every --eval_every steps;
   - packed: --packing, the same batch and steps (equal compute: the same shapes), evaluated every --eval_every / R
     steps, at about the padded run's real-token counts;
   - packed_small: --packing with batch --batch_size / R and as many more steps: each step sees about the padded
     run's real tokens, so equal real tokens come at about equal optimizer steps and warmup.

"Real" tokens are the non-pad tokens the model reads (each line's <s> and </s> included), as the launcher counts
them (metrics.jsonl: padding_fraction, real_tokens_per_second; logged every step, so the count at each evaluation
is exact). Reported (one JSON line, then a summary):
- the padding fraction of the prepared records (pad tokens / record tokens; the token cache's metadata) and of the
  examples the model reads (a padded line's example adds its <s> </s> to the record);
- real tokens per second of training: the median over the steps (the launcher's real_tokens_per_second of each),
  leaving out the first and each one after an evaluation (its interval includes the evaluation);
- eval loss at equal real tokens: at each of the padded run's evaluations, each packed run's eval loss
  interpolated (linearly in real tokens) at the same real-token count. For `packed` this compares R times fewer,
  R times larger optimizer steps (and a warmup spread over R times the tokens); `packed_small` is the like-for-like
  comparison;
- eval loss at the end (padded and packed: equal steps, equal compute).

Wall-clock figures depend on the machine and its load: state them with the numbers.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def docstring_lines() -> list[str]:
    """The first non-empty line of each docstring of the standard library, in file and source order, each once."""
    from spmdlm.data.readers import embedded_corpus_files

    lines, seen = [], set()

    def visit(node) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            first = next((line.strip() for line in (doc or "").splitlines() if line.strip()), "")
            if first and first not in seen:
                seen.add(first)
                lines.append(first)
        for child in ast.iter_child_nodes(node):  # in source order
            visit(child)

    for path in embedded_corpus_files():
        try:
            visit(ast.parse(path.read_text(encoding="utf-8", errors="replace")))
        except SyntaxError:  # a file of another Python's grammar (lib2to3 fixtures and the like)
            continue
    return lines


def launch(
    out: Path, corpus: Path, tokenizer: Path, args, *, packing: bool, batch: int, steps: int, eval_steps: int
) -> float:
    command = [
        sys.executable,
        "-m",
        "spmdlm.launch",
        "--model_type",
        "roberta",
        "--config_name",
        "roberta-tiny",
        "--train_file",
        str(corpus),
        "--tokenizer_name",
        str(tokenizer),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "--cache_dir",
        str(out.parent / "cache"),
        "--line_by_line",
        "--max_seq_length",
        str(args.max_seq_length),
        "--per_device_train_batch_size",
        str(batch),
        "--per_device_eval_batch_size",
        "64",
        "--mesh",
        "data=1",
        "--max_steps",
        str(steps),
        "--learning_rate",
        "1e-3",
        "--warmup_steps",
        "30",
        "--lr_scheduler_type",
        "constant",
        "--weight_decay",
        "0.01",
        "--adam_beta2",
        "0.98",
        "--logging_steps",
        "1",
        "--eval_steps",
        str(eval_steps),
        "--save_steps",
        str(10 * steps),
        "--export_hf",
        "false",
        "--seed",
        "0",
        *(["--packing"] if packing else []),
    ]
    print("+", " ".join(command), f"> {out}.log", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(f"{out}.log", "w") as log:  # a line a step (logging every step: exact real-token counts)
        subprocess.run(command, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def cache_metas(cache: Path) -> dict[tuple[str, int], dict]:
    """{(split, record_length): the token cache's metadata}: the padded run's records are max_seq_length - 2 long,
    the packed run's max_seq_length."""
    return {
        (path.stem, json.loads(path.read_text())["record_length"]): json.loads(path.read_text())
        for path in cache.glob("*/*.json")
    }


def curves(out: Path, tokens_per_step: int) -> tuple[list[dict], list[dict]]:
    """(train records with their cumulative real tokens, eval records with theirs) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train, evals, real, last = [], [], 0.0, 0
    by_step = {}
    for row in rows:
        if "padding_fraction" in row:
            real += (1 - row["padding_fraction"]) * (row["step"] - last) * tokens_per_step
            last = row["step"]
            by_step[row["step"]] = real
            train.append({**row, "real_tokens": real})
    for row in rows:
        if "eval_loss" in row and row["step"] in by_step:
            evals.append({**row, "real_tokens": by_step[row["step"]]})
    return train, evals


def steady(run: dict, field: str) -> float:
    """The median of a per-step rate, leaving out the first step (compilation) and each one after an evaluation."""
    after_eval = {row["step"] + 1 for row in run["evals"]}
    rates = [row[field] for row in run["train"][1:] if row["step"] not in after_eval]
    return float(np.median(rates or [row[field] for row in run["train"][1:]]))  # (an evaluation every step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-packing")
    p.add_argument("--steps", type=int, default=320, help="train steps of the padded and packed runs")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--eval_every", type=int, default=40, help="the padded run's eval interval (steps)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "docstrings.txt"
    lines = docstring_lines()
    corpus.write_text("\n".join(lines) + "\n")
    tokenizer = args.out / "tokenizer"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spmdlm.tokenizer",
            "--for_model",
            "roberta",
            "--vocab_size",
            "4096",
            "--overwrite",
            "--out",
            str(tokenizer),
            str(corpus),
        ],
        check=True,
        cwd=REPO,
    )

    from spmdlm.data import records
    from spmdlm.data.tokenization import load_tokenizer

    tok = load_tokenizer(tokenizer)
    lengths = np.array([len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False)])
    # R: real tokens of a packed example over those of a padded one, from a preparation in this process
    sink = records.RecordShards(lambda i: None)
    rows = []
    sink.write = rows.append
    ids = {"bos": tok.token_to_id("<s>"), "eos": tok.token_to_id("</s>"), "pad": tok.token_to_id("<pad>")}
    packed = records.tokenize_into(
        lines,
        tok,
        {"train": sink},
        records.Cut(args.max_seq_length, ids["eos"], "packed_lines", ids["pad"], bos_id=ids["bos"]),
    )["train"]
    ratio = packed.tokens / packed.examples / (np.minimum(lengths, args.max_seq_length - 2) + 2).mean()

    # padded and packed: the same batch and steps (equal compute); packed_small: batch / R, as many more steps, so
    # each step sees about the padded run's real tokens (equal real tokens at equal steps)
    small = max(1, round(args.batch_size / ratio))
    small_steps = math.ceil(args.steps * args.batch_size / (small * ratio))
    plan = {
        "padded": (False, args.batch_size, args.steps, args.eval_every),
        "packed": (True, args.batch_size, args.steps, max(1, round(args.eval_every / ratio))),
        "packed_small": (True, small, small_steps, round(args.eval_every * small_steps / args.steps)),
    }
    runs = {}
    for name, (packing, batch, steps, eval_steps) in plan.items():
        seconds = launch(
            args.out / name, corpus, tokenizer, args, packing=packing, batch=batch, steps=steps, eval_steps=eval_steps
        )
        train, evals = curves(args.out / name, batch * args.max_seq_length)
        results = json.loads((args.out / name / "eval_results.json").read_text())
        runs[name] = dict(seconds=seconds, train=train, evals=evals, results=results)

    metas = cache_metas(args.out / "cache")
    length = args.max_seq_length
    padded_meta, packed_meta = metas[("train", length - 2)], metas[("train", length)]
    padding = {
        "padded_records": padded_meta["pad_tokens"] / (padded_meta["num_records"] * (length - 2)),
        "padded_examples": 1
        - (padded_meta["num_tokens"] + 2 * padded_meta["num_records"]) / (padded_meta["num_records"] * length),
        "packed_records": packed_meta["pad_tokens"] / (packed_meta["num_records"] * length),
        "packed_examples": packed_meta["pad_tokens"] / (packed_meta["num_records"] * length),
    }
    at_equal_tokens = []
    for row in runs["padded"]["evals"]:
        point = {"step_padded": row["step"], "real_tokens": row["real_tokens"], "eval_loss_padded": row["eval_loss"]}
        for name in ("packed", "packed_small"):
            curve = runs[name]["evals"]
            xs = [e["real_tokens"] for e in curve]
            if xs and xs[0] <= row["real_tokens"] <= xs[-1]:
                point[f"step_{name}"] = float(np.interp(row["real_tokens"], xs, [e["step"] for e in curve]))
                point[f"eval_loss_{name}"] = float(np.interp(row["real_tokens"], xs, [e["eval_loss"] for e in curve]))
        at_equal_tokens.append(point)
    report = {
        "corpus": {
            "lines": len(lines),
            "train_lines": padded_meta["documents"],
            "mean_tokens_per_line": float(lengths.mean()),
            "max_seq_length": length,
            "lines_truncated": int((lengths > length - 2).sum()),
        },
        "records": {"padded": padded_meta["num_records"], "packed": packed_meta["num_records"]},
        "padding_fraction": padding,
        "real_tokens_per_example_ratio": float(ratio),
        "real_tokens_per_second": {name: steady(run, "real_tokens_per_second") for name, run in runs.items()},
        "tokens_per_second": {name: steady(run, "tokens_per_second") for name, run in runs.items()},
        "eval_loss_at_equal_real_tokens": at_equal_tokens,
        "eval_loss_at_end": {name: run["results"]["eval_loss"] for name, run in runs.items()},
        "real_tokens_at_end": {name: run["train"][-1]["real_tokens"] for name, run in runs.items()},
        "run_seconds": {name: run["seconds"] for name, run in runs.items()},
        "settings": {
            "runs": {
                name: dict(zip(("packing", "global_batch", "steps", "eval_steps"), settings))
                for name, settings in plan.items()
            },
            "python": sys.version.split()[0],
            "load_average": os.getloadavg(),
        },
    }
    print(json.dumps(report))
    print(f"\n{len(lines)} lines, {lengths.mean():.1f} tokens a line; records: {report['records']}")
    print(
        f"padding: records {padding['padded_records']:.1%} -> {padding['packed_records']:.1%}, examples "
        f"{padding['padded_examples']:.1%} -> {padding['packed_examples']:.1%}"
    )
    rates = report["real_tokens_per_second"]
    print(
        "real tokens/s: "
        + ", ".join(f"{name} {rate:,.0f} ({rate / rates['padded']:.2f}x)" for name, rate in rates.items())
    )
    print(
        "eval loss at equal real tokens (real tokens | padded step, loss | packed step, loss | packed_small step, "
        "loss):"
    )
    for row in at_equal_tokens:
        print(
            f"  {row['real_tokens']:9,.0f} | "
            + " | ".join(
                f"{row.get('step_' + name, float('nan')):6.1f} {row.get('eval_loss_' + name, float('nan')):.4f}"
                for name in ("padded", "packed", "packed_small")
            )
        )
    print(f"eval loss at the end: {report['eval_loss_at_end']} (padded and packed: equal steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
