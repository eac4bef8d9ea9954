"""Greedy decoding throughput: spmdlm.generate vs transformers' PyTorch `generate` on the same random GPT-2, in one
process.

    python benchmarks/bench_generate.py [--configs gpt2-tiny,gpt2] [--batch_sizes 1,8] [--new_tokens 128]

For each config and batch size, both decode the same prompt (PROMPT_TOKENS tokens, every row alike: no padding)
greedily. Decode tokens/s = batch × (new_tokens − 1) / (time of new_tokens − time of 1 new token), medians over
--repeats, so the prompt's prefill and the per-call overheads cancel. The timed calls of both are interleaved
round-robin, so that other work on the host slows them alike. Our model is created randomly, written with
`save_hf` and read by transformers, so both hold the same weights; the random models never emit EOS here (checked:
every row must reach new_tokens in both, and the tokens must be equal). Also reported: whether our decode loop
compiled exactly once per shape, compile times, and the prefill time. Prints one JSON line per case, then a table.
OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE), as in compare_hf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

PROMPT_TOKENS = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--configs", default="gpt2-tiny,gpt2", help="GPT-2 presets or JSON files, comma-separated")
    p.add_argument("--batch_sizes", default="1,8")
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per length (median)")
    p.add_argument("--torch_threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


def timed_round_robin(fns: list, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, called in turn `repeats` times."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def bench_config(name: str, args) -> list[dict]:
    import torch
    import transformers
    from flax import nnx

    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family, load_config
    from spmdlm.generation import decoding, generate_ids
    from spmdlm.hf_export import save_hf

    family = get_family("gpt2")
    config = load_config(name, "gpt2")
    words = [" ".join(f"w{i}{j}" for j in range(40)) for i in range(30)]
    tokenizer = train_tokenizer(family, words, 400)
    prompt = tokenizer.decode(tokenizer.encode(" ".join(words[:3])).ids[:PROMPT_TOKENS])
    assert len(tokenizer.encode(prompt).ids) == PROMPT_TOKENS
    model = nnx.jit(lambda: family.make_model(config, rngs=nnx.Rngs(0)))()
    with tempfile.TemporaryDirectory() as out:
        save_hf(model, config, out, tokenizer=tokenizer)
        hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf.generation_config.pad_token_id = config.eos_token_id
    n_params = sum(p.numel() for p in hf.parameters())
    results = []
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = [prompt] * batch

        def ours(n):
            return generate_ids(model, config, tokenizer, prompts, max_new_tokens=n)

        ids = torch.tensor([tokenizer.encode(prompt).ids] * batch)

        def theirs(n):
            with torch.inference_mode():
                return hf.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, num_beams=1
                )[:, PROMPT_TOKENS:].tolist()

        compiles = decoding.prefill._cache_size(), decoding.decode._cache_size()
        start = time.perf_counter()
        first = ours(args.new_tokens)
        compile_s = time.perf_counter() - start
        ours(1)
        compiled = decoding.prefill._cache_size() - compiles[0], decoding.decode._cache_size() - compiles[1]
        reference = theirs(args.new_tokens)
        n = args.new_tokens
        times = timed_round_robin(
            [lambda: ours(n), lambda: theirs(n), lambda: ours(1), lambda: theirs(1)], args.repeats
        )
        t_ours, t_theirs = (times[0], times[2]), (times[1], times[3])
        recompiled = (
            decoding.prefill._cache_size() - compiles[0],
            decoding.decode._cache_size() - compiles[1],
        ) != compiled
        decoded = batch * (args.new_tokens - 1)
        shapes = len({-(-(PROMPT_TOKENS + k) // decoding.SLOT_BUCKET) for k in (args.new_tokens, 1)})
        record = {
            "config": name,
            "parameters": n_params,
            "batch": batch,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": args.new_tokens,
            "ours_decode_tokens_per_s": decoded / (t_ours[0] - t_ours[1]),
            "hf_decode_tokens_per_s": decoded / (t_theirs[0] - t_theirs[1]),
            "ours_prefill_plus_one_s": t_ours[1],
            "hf_prefill_plus_one_s": t_theirs[1],
            "ours_first_call_s": compile_s,
            # one prefill and one decode loop per cache length (the two lengths may share one), none when timed
            "compiled_once_per_shape": compiled == (shapes, shapes) and not recompiled,
            "compiled_prefill_decode": compiled,
            "same_tokens": first == reference,
            "full_length": all(len(r) == args.new_tokens for r in first + reference),
        }
        record["ratio_ours_over_hf"] = record["ours_decode_tokens_per_s"] / record["hf_decode_tokens_per_s"]
        print(json.dumps(record), flush=True)
        results.append(record)
    return results


def main(argv=None):
    args = parse_args(argv)
    if "torch" in sys.modules:
        raise SystemExit("OMP_WAIT_POLICY must be set before torch is imported")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import jax
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results = [r for name in args.configs.split(",") for r in bench_config(name, args)]
    print(
        f"\njax {jax.__version__} ({jax.devices()[0].device_kind}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print("| config | params | batch | ours tok/s | transformers tok/s | ratio | compiled once | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['config']} | {r['parameters'] / 1e6:.1f}M | {r['batch']} | {r['ours_decode_tokens_per_s']:,.0f} | "
            f"{r['hf_decode_tokens_per_s']:,.0f} | {r['ratio_ours_over_hf']:.2f} | {r['compiled_once_per_shape']} | "
            f"{r['same_tokens'] and r['full_length']} |"
        )


if __name__ == "__main__":
    main()
