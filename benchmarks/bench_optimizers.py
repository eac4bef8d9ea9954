"""Eval loss at equal steps of the GPT-2 and T5 quick starts (embedded corpus) under each --optim.

    python benchmarks/bench_optimizers.py [--models gpt2,t5] [--optimizers adamw,lion,muon,schedule_free_adamw]
        [--max_steps 100] [--eval_steps 25] [--mesh data=8] [-- EXTRA LAUNCH FLAGS]

Each (model, optimizer) is one `python -m spmdlm.launch --model_type MODEL --optim NAME --max_steps N` in a fresh
--output_dir under /tmp (removed afterwards unless --keep), with the quick start's settings otherwise (README.md,
"Quick starts"; no export, no samples). Per optimizer, only what its own conventions need (docs/optimizers.md):
- lion: --learning_rate / 5 and --weight_decay x 5 (the Lion paper: a 3-10x smaller rate, a larger decay, the same
  lr x decay) and --adam_beta2 0.99 (its b2);
- schedule_free_adamw: --lr_scheduler_type constant (it needs no decay; the quick start's warmup stays);
- adamw, muon: the quick start's rate (Muon's updates are scaled to AdamW's RMS), and on T5 --optim adamw replaces
  the quick start's Adafactor (add adafactor to --optimizers for that baseline).
Prints one JSON line per run (eval losses by step, wall seconds), then a markdown table per model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--models", default="gpt2,t5")
    p.add_argument("--optimizers", default="adamw,lion,muon,schedule_free_adamw")
    p.add_argument("--max_steps", type=int, default=100)
    p.add_argument("--eval_steps", type=int, default=25, help="evaluate every N steps (and at the end)")
    p.add_argument("--mesh", default="data=8", help="as in the quick start (8 simulated devices on a CPU)")
    p.add_argument("--keep", action="store_true", help="keep the output dirs")
    p.add_argument("extra", nargs="*", help="more launch flags, after --")
    return p.parse_args(argv)


def own_flags(optimizer: str, quickstart: dict) -> list[str]:
    """The flags an optimizer's conventions need on top of the quick start's."""
    if optimizer == "lion":
        return [
            "--learning_rate",
            str(quickstart["learning_rate"] / 5),
            "--weight_decay",
            str(quickstart.get("weight_decay", 0.0) * 5),
            "--adam_beta2",
            "0.99",
        ]
    if optimizer == "schedule_free_adamw":
        return ["--lr_scheduler_type", "constant"]
    return []


def run(model: str, optimizer: str, args) -> dict:
    from spmdlm.cli.launch import family_choices
    from spmdlm.run_args.choices import quickstart

    out = Path(tempfile.mkdtemp(prefix=f"bench-optim-{model}-{optimizer}-", dir="/tmp"))
    command = [
        sys.executable,
        "-m",
        "spmdlm.launch",
        "--model_type",
        model,
        "--optim",
        optimizer,
        "--output_dir",
        str(out),
        "--max_steps",
        str(args.max_steps),
        "--eval_steps",
        str(args.eval_steps),
        "--save_steps",
        str(args.max_steps),
        "--mesh",
        args.mesh,
        "--export_hf",
        "false",
        "--sample_prompts=",
        *own_flags(optimizer, quickstart(family_choices(), model)),
        *args.extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    record = {"model": model, "optimizer": optimizer, "command": " ".join(command[1:]), "seconds": round(seconds, 1)}
    if done.returncode != 0:
        record["error"] = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    else:
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        record["eval_loss"] = {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m}
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return record


def table(records: list[dict]) -> str:
    steps = sorted({step for r in records for step in r.get("eval_loss", {})})
    rows = [
        "| optimizer | " + " | ".join(f"eval loss @{s}" for s in steps) + " | seconds |",
        "| --- |" + " ---: |" * (len(steps) + 1),
    ]
    for r in records:
        losses = r.get("eval_loss", {})
        cells = [f"{losses[s]:.4f}" if s in losses else "-" for s in steps]
        if "error" in r:
            cells = [f"failed: {r['error'][:80]}"] + [""] * max(len(steps) - 1, 0)
        rows.append(f"| {r['optimizer']} | " + " | ".join(cells) + f" | {r['seconds']} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    by_model = {}
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            record = run(model, optimizer, args)
            print(json.dumps(record), flush=True)
            by_model.setdefault(model, []).append(record)
    for model, records in by_model.items():
        print(f"\n{model} quick start, {args.max_steps} steps (--mesh {args.mesh})\n\n{table(records)}")


if __name__ == "__main__":
    main()
