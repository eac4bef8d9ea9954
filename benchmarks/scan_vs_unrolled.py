"""Scanned vs unrolled layers: train-step compile time and step time by depth, one bench_train run per depth.

    python benchmarks/scan_vs_unrolled.py            # the table of benchmarks/README.md (about 10 minutes on 2 cores)
    python benchmarks/scan_vs_unrolled.py --quick    # 2 depths per model

Each depth runs `bench_train.py ... --compare unroll=true` in a fresh process: the same parameters (stacked), traced
once per layer instead of once, timed in the same process with steps interleaved. Prints a markdown table and
the JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPT2 = ["--model", "gpt2", "--config", "gpt2-tiny", "--set", "n_embd=256", "--set", "n_head=4", "--seq_len", "128"]
T5 = [
    "--model",
    "t5",
    "--config",
    "t5-v1_1-tiny",
    "--set",
    "d_model=256",
    "--set",
    "d_kv=64",
    "--set",
    "d_ff=512",
    "--set",
    "dropout_rate=0.0",
    "--seq_len",
    "128",
]
CASES = [("gpt2", f"{n} layers", GPT2 + ["--set", f"n_layer={n}"]) for n in (4, 12, 24, 48)] + [
    ("t5", f"{n}+{n} layers", T5 + ["--set", f"num_layers={n}", "--set", f"num_decoder_layers={n}"]) for n in (4, 12)
]


def run(case_args: list[str], steps: int) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "bench_train.py"),
        *case_args,
        "--mesh",
        "data=1",
        "--batch_size",
        "8",
        "--steps",
        str(steps),
        "--warmup",
        "1",
        "--compare",
        "unroll=true",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two depths per model")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cases = [c for c in CASES if not args.quick or c[1].split()[0] in ("4", "4+4", "12", "12+12")]
    print(
        "| model | depth | compile s scanned | compile s unrolled | step s scanned | step s unrolled | "
        "step unrolled/scanned |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    records = []
    for model, depth, case_args in cases:
        result = run(case_args, args.steps)
        records.append(result)
        unrolled = result["variants"][0]
        scanned_step, unrolled_step = result["step_time_s"]["median"], unrolled["step_time_s"]["median"]
        print(
            f"| {model} | {depth} | {result['compile_s']:.1f} | {unrolled['compile_s']:.1f} | {scanned_step:.3f} | "
            f"{unrolled_step:.3f} | {unrolled_step / scanned_step:.3f} |",
            flush=True,
        )
    for record in records:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
