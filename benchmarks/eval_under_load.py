"""Evaluation on simulated CPU meshes with CPU-bound processes beside it: does it stall, and how much slower is it?

    python benchmarks/eval_under_load.py                           # 3 tries per mesh, the evaluator
    python benchmarks/eval_under_load.py --tries 20 --mode both    # issue 54's acceptance run (on a quiet host)
    python benchmarks/eval_under_load.py --meshes data=2 --busy 2 --model_name_or_path runs/x/hf --validation_file t

For each mesh (default `data=2`, `data=4`, `data=2,fsdp=2,tensor=2`) and mode, one quiet try (nothing started
beside it), then `--tries` tries each with `--busy` processes spinning (`while 1: pass`) beside it. A try is a whole
command in a fresh process, timed from start to exit:

- `evaluate`: `python -m spmdlm.evaluate --model_name_or_path EXPORT --validation_file TEXT --block_size 32 --mesh M`;
- `launch`: the launcher's own evaluation: `python -m spmdlm.launch --model_name_or_path EXPORT --do_train false
  --do_eval --validation_file TEXT --block_size 32 --mesh M` into a fresh output dir.

EXPORT is a gpt2-tiny trained for 20 steps into a temporary folder unless `--model_name_or_path` is given; TEXT is
~200 KB of this repository's docs unless `--validation_file` is. A try that runs past `--timeout` seconds (default:
max(120, 10 x its quiet time)) is killed and counted as a stall. One line per try, then one JSON line per (mesh,
mode): the quiet time, each try's time, the worst as a multiple of the quiet time, and the stalls. Times are
wall-clock on whatever else the machine runs (its load average is in the JSON): state the load with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MESHES = ("data=2", "data=4", "data=2,fsdp=2,tensor=2")
TEXT_BYTES = 200_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=3, help="loaded tries per mesh and mode")
    p.add_argument("--meshes", default=";".join(MESHES), help="';'-separated --mesh values")
    p.add_argument("--mode", choices=("evaluate", "launch", "both"), default="evaluate")
    p.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside each loaded try")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a try counts as a stall")
    p.add_argument("--model_name_or_path", default=None, help="an export (default: train a gpt2-tiny for 20 steps)")
    p.add_argument("--validation_file", default=None, help="held-out text (default: ~200 KB of docs/)")
    return p.parse_args(argv)


def run(command: list[str], timeout: float | None, cwd: Path) -> tuple[float, int | None]:
    """Seconds the command took and its exit status (None: killed at `timeout`)."""
    start = time.perf_counter()
    with open(cwd / "log.txt", "ab") as log:
        proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=log)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
    return time.perf_counter() - start, code


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.kill()
        proc.wait()


def export(work: Path) -> str:
    out = work / "run"
    command = [sys.executable, "-m", "spmdlm.launch", "--config_name", "gpt2-tiny", "--max_steps", "20"]
    seconds, code = run([*command, "--output_dir", str(out)], None, work)
    if code != 0:
        sys.exit(f"training the gpt2-tiny export failed (exit {code}); see {work / 'log.txt'}")
    print(f"trained a gpt2-tiny export in {seconds:.0f} s: {out / 'hf'}", flush=True)
    return str(out / "hf")


def held_out_text(work: Path) -> str:
    text = "".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
    path = work / "heldout.txt"
    path.write_text(text[:TEXT_BYTES])
    return str(path)


def command(mode: str, mesh: str, model: str, text: str, out: Path) -> list[str]:
    common = ["--model_name_or_path", model, "--validation_file", text, "--block_size", "32", "--mesh", mesh]
    if mode == "evaluate":
        return [sys.executable, "-m", "spmdlm.evaluate", *common]
    launch = [sys.executable, "-m", "spmdlm.launch", *common, "--do_train", "false", "--do_eval", "true"]
    return [*launch, "--output_dir", str(out), "--overwrite_output_dir"]


def measure(args: argparse.Namespace, mode: str, mesh: str, model: str, text: str, work: Path) -> dict:
    out = work / "out"
    quiet, code = run(command(mode, mesh, model, text, out), args.timeout, work)
    if code != 0:
        sys.exit(f"the quiet {mode} on --mesh {mesh} failed (exit {code}); see {work / 'log.txt'}")
    print(f"{mode} --mesh {mesh}: quiet {quiet:.1f} s", flush=True)
    limit = args.timeout or max(120.0, 10 * quiet)
    times, stalls = [], 0
    for attempt in range(1, args.tries + 1):
        busy = busy_processes(args.busy)
        try:
            seconds, code = run(command(mode, mesh, model, text, out), limit, work)
        finally:
            stop(busy)
        stalls += code is None
        times.append(round(seconds, 1))
        state = "STALLED (killed)" if code is None else f"exit {code}"
        print(f"{mode} --mesh {mesh}: try {attempt} with {args.busy} busy: {seconds:.1f} s, {state}", flush=True)
    return {
        "mode": mode,
        "mesh": mesh,
        "busy": args.busy,
        "quiet_s": round(quiet, 1),
        "tries_s": times,
        "worst_over_quiet": round(max(times) / quiet, 2),
        "stalls": stalls,
        "timeout_s": limit,
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eval-under-load-") as tmp:
        work = Path(tmp)
        model = args.model_name_or_path or export(work)
        text = args.validation_file or held_out_text(work)
        modes = ("evaluate", "launch") if args.mode == "both" else (args.mode,)
        for mesh in args.meshes.split(";"):
            for mode in modes:
                print(json.dumps(measure(args, mode, mesh, model, text, work)), flush=True)


if __name__ == "__main__":
    main()
