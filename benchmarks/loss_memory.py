"""Per-device memory of the compiled train step with and without --loss_chunk_size: how much of it the logits take.

    python benchmarks/loss_memory.py --config gpt2 --batch_size 8 --seq_len 1024 --chunks 0 128 256
    python benchmarks/loss_memory.py --config t5-v1_1-base --batch_size 8 --seq_len 512 --chunks 0 32

Compiles the real train step (AdamW, fp32 parameters) for one device from shapes only (nothing is allocated or
run) and prints one JSON line per chunk size: XLA's temporaries, arguments and outputs in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spmdlm.models.stack import REMAT_POLICIES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="preset name or config JSON")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 256])
    p.add_argument(
        "--remat",
        default="dots",
        choices=tuple(REMAT_POLICIES),
        help="what each layer keeps for its backward pass, as the launcher's flag",
    )
    args = p.parse_args()

    import jax
    from bench_train import build_objective

    from spmdlm.data.pipeline import batch_spec
    from spmdlm.engine.state import Compute, build_train_state
    from spmdlm.engine.step import Loss, Stepper
    from spmdlm.families import families, load_config
    from spmdlm.mesh import make_mesh

    config = load_config(args.config)
    family = families()[config.model_type]
    objective = build_objective(config.model_type, config, args.seq_len)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    compute = Compute(dtype=args.dtype, remat=args.remat)
    graphdef, state = build_train_state(family, config, mesh, total_steps=10, compute=compute, abstract=True)
    spec = batch_spec(objective, args.batch_size)
    for chunk in args.chunks:
        stats = Stepper(graphdef, state, mesh, family.forward, loss=Loss(loss_chunk=chunk)).compile_train(state, spec)
        print(
            json.dumps(
                {
                    "config": args.config,
                    "batch": args.batch_size,
                    "lengths": {k: v.shape[1] for k, v in spec.items()},
                    "vocab": config.vocab_size,
                    "dtype": args.dtype,
                    "remat": args.remat,
                    "loss_chunk_size": chunk,
                    **{k: stats.get(k) for k in ("temp_bytes", "argument_bytes", "output_bytes", "compile_seconds")},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
