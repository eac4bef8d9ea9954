"""spmdlm's GPT-2 training step side by side with karpathy/nanoGPT's (PyTorch, CPU) on identical shapes.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt      # any checkout; never vendored here
    python benchmarks/peer_nanogpt.py --nanogpt /tmp/nanogpt --shape tiny --pairs 4
    python benchmarks/peer_nanogpt.py --nanogpt /tmp/nanogpt --shape base --pairs 2 --steps 4 --warmup 1 --compile

Both programs train fp32 with AdamW (0.9, 0.99), weight decay 0.1, gradient clipping at 1.0 on one fixed synthetic
batch (random ids; no data loading on either side) and are timed the same way: the median wall time of a steady-state
step after `--warmup` unmeasured ones (compilation excluded), ending when the step's results are ready. Shapes:
tiny = 4 layers x 4 heads x 128 wide, vocabulary 4096, block 128, batch 16; base = GPT-2 124M (12 x 12 x 768,
vocabulary 50257, 1024 positions) at batch 2 x 256. Each pair runs one process per program, in turn (A B A B), so a
neighbour's load hits both alike; torch runs with OMP_WAIT_POLICY=PASSIVE (its spinning default loses most of a busy
host's time). spmdlm runs through benchmarks/bench_train.py (its compiled training step); `--ours KEY=VALUE` passes
flags to it (e.g. --ours scan_unroll=0). Prints one JSON line per run and a table of paired ratios (ours / nanoGPT)
with the 1-minute load average at each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 4096, "block": 128, "batch": 16, "seq": 128},
    "base": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "block": 1024, "batch": 2, "seq": 256},
}
ADAMW = {"learning_rate": 6e-4, "weight_decay": 0.1, "betas": (0.9, 0.99), "clip": 1.0}


def nanogpt_step_times(
    path: str, shape: dict, steps: int, warmup: int, compile_model: bool, profile: str | None = None
) -> list[float]:
    """nanoGPT's train.py step (forward, backward, clip, AdamW, zero_grad) on one synthetic batch; -> step seconds.
    `profile`: also trace the measured steps with torch.profiler and print its operator table (self CPU time)."""
    import contextlib

    import torch

    sys.path.insert(0, path)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    torch.manual_seed(0)
    config = GPTConfig(
        block_size=shape["block"],
        vocab_size=shape["vocab_size"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
        dropout=0.0,
        bias=True,
    )
    model = GPT(config)
    optimizer = model.configure_optimizers(ADAMW["weight_decay"], ADAMW["learning_rate"], ADAMW["betas"], "cpu")
    step_model = torch.compile(model) if compile_model else model
    x = torch.randint(shape["vocab_size"], (shape["batch"], shape["seq"]))
    y = torch.randint(shape["vocab_size"], (shape["batch"], shape["seq"]))
    times = []
    tracing = contextlib.nullcontext()
    if profile:
        tracing = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    for i in range(warmup + steps):
        if i == warmup:
            tracing.__enter__()
        start = time.perf_counter()
        _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ADAMW["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if profile:
        tracing.__exit__(None, None, None)
        table = tracing.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30)
        with open(profile, "w") as f:
            f.write(table)
        print(table, file=sys.stderr)
    return times


def run_nanogpt(args) -> dict:
    shape = SHAPES[args.shape]
    times = nanogpt_step_times(args.nanogpt, shape, args.steps, args.warmup, args.compile, args.profile)
    step = statistics.median(times)
    return {"program": "nanogpt-compile" if args.compile else "nanogpt", "step_s": step}


def ours_command(args) -> list[str]:
    shape = SHAPES[args.shape]
    sets = {k: shape[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size")} | {"n_positions": shape["block"]}
    command = [sys.executable, os.path.join(HERE, "bench_train.py"), "--model", "gpt2"]
    command += ["--config", os.path.join(HERE, "gpt2-d768-l4.json"), "--mesh", "data=1"]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    command += ["--batch_size", str(shape["batch"]), "--seq_len", str(shape["seq"])]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--learning_rate", str(ADAMW["learning_rate"]), "--weight_decay", str(ADAMW["weight_decay"])]
    command += ["--max_grad_norm", str(ADAMW["clip"])]
    for option in args.ours:
        key, _, value = option.partition("=")
        command += [f"--{key}", value] if value else [f"--{key}"]
    return command


def run_child(command: list[str], env: dict) -> dict:
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"peer_nanogpt.py: {' '.join(command[:3])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"load_1m": load}


def run_pairs(args) -> None:
    shape = SHAPES[args.shape]
    tokens = shape["batch"] * shape["seq"]
    torch_env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    peers = ["nanogpt"] + (["nanogpt-compile"] if args.compile else [])
    me = [sys.executable, os.path.abspath(__file__), "--nanogpt", args.nanogpt, "--shape", args.shape]
    me += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--child"]
    ratios = {peer: [] for peer in peers}
    for pair in range(args.pairs):
        ours = run_child(ours_command(args), dict(os.environ))
        ours_step = ours["step_time_s"]["median"]
        print(json.dumps({"pair": pair, "program": "spmdlm", "step_s": ours_step, "load_1m": ours["load_1m"]}))
        for peer in peers:
            peer_run = run_child(me + (["--compile"] if peer.endswith("compile") else []), torch_env)
            ratios[peer].append(peer_run["step_s"] / ours_step)
            print(json.dumps({"pair": pair, **peer_run, "tokens_per_s": tokens / peer_run["step_s"]}))
            print(
                f"  pair {pair}: spmdlm {tokens / ours_step:,.0f} tok/s (load {ours['load_1m']:.1f}), {peer} "
                f"{tokens / peer_run['step_s']:,.0f} tok/s (load {peer_run['load_1m']:.1f}) -> "
                f"{ratios[peer][-1]:.2f}x",
                file=sys.stderr,
            )
    for peer, values in ratios.items():
        print(
            f"{args.shape}: spmdlm / {peer}: paired median {statistics.median(values):.2f}x "
            f"(pairs: {', '.join(f'{r:.2f}' for r in values)})",
            file=sys.stderr,
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", required=True, help="a karpathy/nanoGPT checkout (its model.py is imported)")
    p.add_argument("--shape", choices=SHAPES, default="tiny")
    p.add_argument("--pairs", type=int, default=3, help="alternating (spmdlm, nanoGPT) runs")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--compile", action="store_true", help="also torch.compile(model) in each pair")
    p.add_argument("--ours", action="append", default=[], metavar="KEY=VALUE", help="a bench_train.py flag")
    p.add_argument(
        "--profile", metavar="FILE", help="run nanoGPT once under torch.profiler and write its op table to FILE"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one nanoGPT run (internal)
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
        sys.exit(f"peer_nanogpt.py: {args.nanogpt} has no model.py; give --nanogpt a karpathy/nanoGPT checkout")
    if args.child or args.profile:
        print(json.dumps(run_nanogpt(args)))
    else:
        run_pairs(args)


if __name__ == "__main__":
    main()
