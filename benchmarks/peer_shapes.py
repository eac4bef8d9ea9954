"""Our train step on a peers-harness model shape, printed as one JSON line in the harness's format (an `--extra`
peer of its run_peers.py; see benchmarks/README.md, "Side by side with the HF Flax scripts and PyTorch").

    python benchmarks/peer_shapes.py --peers PEERS_DIR --model t5 --steps 20 --warmup 3 [bench_train flags ...]

The shape (layers, widths, vocabulary, batch, lengths) comes from the harness's peer_common.MODELS; any further flags
go to bench_train.py (e.g. --scan_unroll 0 is spelled --unroll there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from spmdlm import host

    host.restart_with_huge_page_malloc()  # the allocator the launcher runs with
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", required=True, help="the peers harness directory (peer_common.py)")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tag", default="", help="a name for this variant in the harness's table")
    args, bench_flags = p.parse_known_args()
    sys.path.insert(0, args.peers)
    import bench_train
    from peer_common import MODELS  # noqa: E402

    spec = MODELS[args.model]
    config = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(config, "w") as f:
        json.dump(dict(spec["hf"], model_type=args.model), f)
    result = bench_train.run_benchmark(
        bench_train.parse_args(
            [
                "--model",
                args.model,
                "--config",
                config,
                "--mesh",
                "data=1",
                "--batch_size",
                str(spec["batch"]),
                "--seq_len",
                str(spec.get("seq") or spec["src"]),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                *bench_flags,
            ]
        )
    )
    print(
        json.dumps(
            {
                "peer": "spmdlm" + (f"-{args.tag}" if args.tag else ""),
                "model": args.model,
                "tok_s_median": result["tokens_per_s"]["median"],
                "tokens_per_step": result["tokens_per_step"],
                "lengths": result["lengths"],
                "mfu": result["mfu"],
                "compile_s": result["compile_s"],
                "step_s_median": result["step_time_s"]["median"],
                "flags": bench_flags,
                "load_average_1m": result["host"]["load_average_1m"],
                "glibc_tunables": result["host"]["glibc_tunables"],
            }
        )
    )


if __name__ == "__main__":
    main()
