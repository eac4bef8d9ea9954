"""spmdlm vs Hugging Face transformers (PyTorch) training throughput, same model, batch and optimizer, one process.

    python benchmarks/compare_hf.py --model gpt2 --config gpt2-tiny --mesh data=1 --steps 10 [--torch_compile|--both]

Ours runs first (bench_train.py's measurement, base variant only), then transformers: the same config (HF names),
the same synthetic batch (same numpy seed), the same loss (token-summed fp32 cross-entropy over the same targets,
divided by the token count), AdamW with the same hyperparameters (lr, betas, eps, weight decay on matrices and
embeddings only, linear decay of the lr to 0 over warmup+steps, global-norm clipping at 1.0), eager unless
--torch_compile (--both: eager, then torch.compile on a fresh model). Prints one JSON line, then one line for
people. OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, see --omp_wait_policy): spinning ones collapse when
the host is shared.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402


def extra_flags(p):
    p.add_argument("--torch_compile", action="store_true", help="torch.compile the transformers model")
    p.add_argument("--both", action="store_true", help="transformers eager, then torch.compile (a fresh model)")
    p.add_argument("--torch_threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--omp_wait_policy",
        default="PASSIVE",
        choices=("PASSIVE", "ACTIVE", "unset"),
        help="OpenMP idle threads sleep (PASSIVE, default) or spin (ACTIVE, libgomp's default). On a "
        "host shared with other work, spinning torch threads collapse (50x slower seen here)",
    )


def hf_model(config):
    """The transformers model of the same family and config (random init)."""
    import torch
    import transformers

    values = {k: v for k, v in config.to_hf_dict().items() if k not in ("model_type", "architectures")}
    model_class = getattr(transformers, config.architecture)
    model = model_class(transformers.AutoConfig.for_model(config.model_type, **values))
    untied = getattr(config, "tie_word_embeddings", True) is False
    if untied and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        # transformers 5 ties T5's head to `shared` whatever the config says (docs/architecture.md §5);
        # ours is untied, which costs AdamW a second vocab×d_model matrix: give the head its own weight.
        model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    return model


def run_hf(args, config, objective, global_batch: int, torch_compile: bool) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = hf_model(config).to(dtype)
    model.train()  # dropout as configured, like ours (GPT-2 presets: 0; T5 v1.1: dropout_rate)
    n_params = sum(p.numel() for p in model.parameters())
    batch = {
        k: torch.from_numpy(v.astype(np.int64))
        for k, v in bench_train.synthetic_batch(objective, global_batch, config.vocab_size, args.seed).items()
    }
    decay = [p for p in model.parameters() if p.ndim >= 2]  # kernels and embeddings; no biases or norm scales
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    total_steps = args.warmup + args.steps
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / total_steps))
    forward = torch.compile(model) if torch_compile else model
    labels = batch["labels"]

    def step() -> float:
        if "decoder_input_ids" in batch:
            logits = forward(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"]).logits
        else:
            logits = forward(input_ids=batch["input_ids"]).logits
        loss_sum = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        tokens = (labels != -100).sum()
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.detach()) / float(tokens)

    start = time.perf_counter()
    losses = [step() for _ in range(max(args.warmup, 1 if torch_compile else 0))]
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    tokens_per_step = global_batch * bench_train.tokens_per_example(objective)
    step_time = bench_train.summary(times)
    return {
        "tokens_per_s": {
            "median": tokens_per_step / step_time["median"],
            "min": tokens_per_step / step_time["max"],
            "max": tokens_per_step / step_time["min"],
        },
        "step_time_s": step_time,
        "warmup_s": warmup_s,
        "parameters": n_params,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_compile": torch_compile,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def main(argv=None):
    args = bench_train.parse_args(argv, extra=extra_flags)
    if args.omp_wait_policy != "unset":
        if "torch" in sys.modules:
            bench_train.fail("--omp_wait_policy must be set before torch is imported")
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # read once, when torch's OpenMP starts
    if args.compare:
        bench_train.fail("compare_hf.py measures the base settings only; drop --compare")
    ours = bench_train.run_benchmark(args)
    arms = ours.pop("_arms")
    config = bench_train.load_model_config(args)
    objective = bench_train.build_objective(args.model, config, args.seq_len)
    del arms  # free our state before torch allocates its own
    gc.collect()
    theirs = run_hf(args, config, objective, ours["global_batch"], args.torch_compile and not args.both)
    compiled = run_hf(args, config, objective, ours["global_batch"], True) if args.both else None
    ours_tps = ours["tokens_per_s"]["median"]
    keep = ("variant", "tokens_per_s", "step_time_s", "compile_s", "mfu", "parameters", "loss_first", "loss_last")
    record = {
        "model": args.model,
        "config": ours["config"],
        "overrides": args.set,
        "global_batch": ours["global_batch"],
        "lengths": ours["lengths"],
        "tokens_per_step": ours["tokens_per_step"],
        "dtype": args.dtype,
        "mesh": ours["mesh"],
        "device_kind": ours["device_kind"],
        "host": ours["host"],
        "ours": {k: ours[k] for k in keep},
        "hf": theirs,
        "ratio_ours_over_hf": ours_tps / theirs["tokens_per_s"]["median"],
        "versions": {**ours["versions"], **theirs["versions"]},
        "settings": vars(args),
    }
    if compiled:
        record["hf_compile"] = compiled
        record["ratio_ours_over_hf_compile"] = ours_tps / compiled["tokens_per_s"]["median"]
    print(json.dumps(record))
    per_example = ours["tokens_per_step"] // ours["global_batch"]
    print(
        f"{args.model} {ours['config']} batch {ours['global_batch']}x{per_example} {args.dtype}: "
        f"spmdlm {ours_tps:,.0f} tok/s vs transformers "
        + "; ".join(
            f"({'torch.compile' if arm['torch_compile'] else 'eager'}) {arm['tokens_per_s']['median']:,.0f} tok/s "
            f"-> {ours_tps / arm['tokens_per_s']['median']:.2f}x"
            for arm in (theirs, compiled)
            if arm
        )
    )


if __name__ == "__main__":
    main()
