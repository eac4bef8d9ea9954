"""Corpus preparation and the Grain read path: throughput and memory, as JSON lines.

    python benchmarks/bench_prepare.py                      # 20 MB synthetic corpus, workers 1 and 2, read path
    python benchmarks/bench_prepare.py --large              # also 80 MB (peak RSS must not grow with the size)
    python benchmarks/bench_prepare.py --sizes 50,200 --workers 1,2,4 --read_threads 0,4,16 --batches 100

1. A synthetic corpus (Zipf-distributed made-up words, sentences with . ! ?, one document per line) of each size.
2. `prepare` lines: `python -m spmdlm.prepare`'s library path (`spmdlm.data.datasets.prepare_dataset`) run in a fresh
   subprocess per (size, workers) for GPT-2 records of 1025 tokens: tokens/s of the preparation (reading, tokenizing,
   cutting, writing, hashing) and peak RSS: of the preparing process (getrusage; it has imported JAX through
   spmdlm.families), of the largest worker and of all processes together (VmRSS sampled every 50 ms);
   `dataset_sha256` hashes all the files written, to compare worker counts.
3. `read` lines: per objective (gpt2 CLM, roberta MLM, t5 span corruption, bart denoising) at the quick-start
   length (128) and a global batch of 32: a dataset prepared from the first few MB, read with
   `spmdlm.data.pipeline.train_batches` (shuffle, objective transform, batching) at each Grain `num_threads`:
   examples/s and tokens/s (model input tokens: the objective's first example field), and the same tokens read as
   shuffled batches from a plain np.memmap in the same process (`memmap_limit_tokens_per_s`, bench_read.py's).

Times are wall-clock on whatever else the machine runs: state the load with the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SAMPLE_BYTES = 2 << 20  # the tokenizers are trained on this much of the corpus


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """Deterministic synthetic text: Zipf-distributed words from a made-up vocabulary, sentences of 5-25 words,
    documents of 1-12 sentences, one per line."""
    if path.exists() and path.stat().st_size >= megabytes * 1e6:
        return path
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnoprstuvyæøåé")
    vocab = np.array(["".join(rng.choice(letters, rng.integers(1, 10))) for _ in range(40_000)])
    target, written = int(megabytes * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = vocab[np.minimum(rng.zipf(1.15, 200_000), len(vocab)) - 1]
            lengths = rng.integers(5, 26, 20_000)
            ends = np.cumsum(lengths)
            ends = ends[ends < len(words)]
            sentences = [
                " ".join(words[a:b]).capitalize() + rng.choice([".", "!", "?", "."])
                for a, b in zip(np.r_[0, ends[:-1]], ends)
            ]
            per_doc = rng.integers(1, 13, len(sentences))
            lines, i = [], 0
            for n in per_doc:
                if i >= len(sentences):
                    break
                lines.append(" ".join(sentences[i : i + n]))
                i += n
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    return path


def train_tokenizers(corpus: Path, folder: Path, models: list[str], vocab: int) -> dict[str, Path]:
    from spmdlm.data.tokenization import save_tokenizer, train_tokenizer
    from spmdlm.families import get_family

    with open(corpus, encoding="utf-8") as f:
        sample = f.read(SAMPLE_BYTES).splitlines()[:-1]
    out = {}
    for model in models:
        target = folder / f"tok-{model}"
        if not (target / "tokenizer.json").exists():
            family = get_family(model)
            save_tokenizer(train_tokenizer(family, sample, vocab), target, family, model_max_length=1024)
        out[model] = target
    return out


CHILD = r"""
import json, os, resource, sys, threading, time

def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0

def children(pid):
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found

# ru_maxrss of a spawned child counts the parent's pages it had before exec: sample VmRSS of every process instead.
peak = {"total": 0, "worker": 0}
def sample():
    me = os.getpid()
    while True:
        kids = [rss_kb(c) for c in children(me)]
        peak["total"] = max(peak["total"], rss_kb(me) + sum(kids))
        peak["worker"] = max([peak["worker"], *kids])
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
from spmdlm.data.datasets import ForModel, prepare_dataset
from spmdlm.data.readers import open_corpus
from spmdlm.data.tokenization import load_tokenizer, special_token_ids
from spmdlm.cli.prepare import resolve_objective
from spmdlm.data.records import Cut
corpus_path, tok_dir, out, workers, block = sys.argv[1:6]
tok = load_tokenizer(tok_dir)
family, objective, flags, config = resolve_objective("gpt2", tok, {"block_size": int(block)})
ids = special_token_ids(tok, family)
corpus = open_corpus([corpus_path])
start = time.perf_counter()
cut = Cut(objective.record_length, ids["eos"], objective.preparation, ids.get("pad"), 5.0)
card = prepare_dataset(corpus, out, cut, ForModel(family, tok, flags), workers=int(workers), progress=False)
seconds = time.perf_counter() - start
tokens = sum(s["tokens"] for s in card["splits"].values() if s)
print(json.dumps({"seconds": seconds, "tokens": tokens, "documents": card["read"]["documents"],
                  "examples": card["splits"]["train"]["examples"],
                  "peak_rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_rss_worker_mb": peak["worker"] / 1024, "peak_rss_all_processes_mb": peak["total"] / 1024}))
"""


def bench_prepare(corpus: Path, tok_dir: Path, folder: Path, workers: int, block: int) -> dict:
    out = folder / f"ds-{corpus.stem}-w{workers}"
    shutil.rmtree(out, ignore_errors=True)  # else the re-run is a no-op (same inputs)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(corpus), str(tok_dir), str(out), str(workers), str(block)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"prepare failed: {result.stderr.strip().splitlines()[-1]}")
    child = json.loads(result.stdout.strip().splitlines()[-1])
    digest = hashlib.sha256()
    for path in sorted(out.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return {
        "bench": "prepare",
        "corpus_mb": round(corpus.stat().st_size / 1e6, 1),
        "workers": workers,
        "record_length": block + 1,
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in child.items()},
        "tokens_per_s": round(child["tokens"] / child["seconds"]),
        "mb_per_s": round(corpus.stat().st_size / 1e6 / child["seconds"], 2),
        "process_wall_s": round(wall, 2),
        "dataset_sha256": digest.hexdigest()[:16],
    }


def bench_read(
    corpus: Path,
    tok_dir: Path,
    folder: Path,
    model: str,
    seq_len: int,
    global_batch: int,
    batches: int,
    threads: list[int],
    megabytes: float,
) -> list[dict]:
    import grain
    from bench_read import memmap_rate

    from spmdlm.cli.prepare import resolve_objective
    from spmdlm.data import datasets, pipeline, readers
    from spmdlm.data.records import Cut
    from spmdlm.data.tokenization import load_tokenizer, special_token_ids
    from spmdlm.families import get_family

    family = get_family(model)
    small = folder / f"read-{megabytes:g}mb.txt"
    if not small.exists():
        with open(corpus, encoding="utf-8") as f:
            small.write_text("".join(f.readlines(int(megabytes * 1e6))), encoding="utf-8")
    tok = load_tokenizer(tok_dir)
    flag = family.flags[0].name
    family, objective, flags, config = resolve_objective(
        model, tok, {flag: seq_len}, config_name=family.quickstart["config_name"]
    )
    ids = special_token_ids(tok, family)
    mode = objective.preparation
    out = folder / f"read-{model}-{seq_len}"
    card = datasets.prepare_dataset(
        readers.open_corpus([str(small)]),
        out,
        Cut(objective.record_length, ids["eos"], mode, ids.get("pad")),
        datasets.ForModel(family, tok, flags),
        workers=2,
        progress=False,
    )
    train, _, _ = datasets.open_dataset(out, tokenizer=tok, record_length=objective.record_length, mode=mode)
    first = next(iter(objective.example_spec()))
    input_tokens = int(np.prod(objective.example_spec()[first][0]))
    lines = []
    for num_threads in threads:
        it = pipeline.train_batches(
            train,
            objective,
            seed=0,
            global_batch=global_batch,
            num_epochs=100,
            read_options=grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=2 * global_batch),
        )
        # Timed from the first batch on: a prefetching reader has batches ready before the clock starts otherwise.
        start = time.perf_counter()
        next(it)
        first_s = time.perf_counter() - start
        for _ in range(batches - 1):
            next(it)
        seconds = time.perf_counter() - start
        examples = batches * global_batch
        limit = memmap_rate(train, global_batch, seconds=1.0) * global_batch * input_tokens
        lines.append(
            {
                "bench": "read",
                "model": model,
                "objective": type(objective).__name__,
                "mode": mode,
                "seq_len": seq_len,
                "record_length": objective.record_length,
                "input_field": first,
                "input_tokens_per_example": input_tokens,
                "global_batch": global_batch,
                "grain_num_threads": num_threads,
                "batches": batches,
                "seconds": round(seconds, 3),
                "first_batch_s": round(first_s, 3),
                "examples_per_s": round(examples / seconds),
                "tokens_per_s": round(examples * input_tokens / seconds),
                "record_tokens_per_s": round(examples * objective.record_length / seconds),
                "memmap_limit_tokens_per_s": round(limit),
                "load_avg": os.getloadavg(),
                "dataset_examples": card["splits"]["train"]["examples"],
            }
        )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="20", help="corpus sizes in MB, comma-separated (default 20)")
    p.add_argument("--large", action="store_true", help="add an 80 MB corpus (4x the default)")
    p.add_argument("--workers", default="1,2", help="worker counts for preparation (default 1,2)")
    p.add_argument("--block_size", type=int, default=1024, help="GPT-2 block size for preparation (default 1024)")
    p.add_argument("--vocab_size", type=int, default=8192, help="tokenizers' vocabulary (default 8192)")
    p.add_argument("--models", default="gpt2,roberta,t5,bart", help="objectives of the read path")
    p.add_argument("--read_threads", default="0,16", help="Grain num_threads values for the read path")
    p.add_argument("--read_mb", type=float, default=4.0, help="MB of the corpus prepared for the read path")
    p.add_argument("--seq_len", type=int, default=128, help="read path sequence length (quick-start's 128)")
    p.add_argument("--global_batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=200, help="measured batches per read setting (the first included)")
    p.add_argument("--skip_prepare", action="store_true")
    p.add_argument("--skip_read", action="store_true")
    p.add_argument("--dir", default=None, help="work dir (default: a temp dir, kept for re-runs when given)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    folder = Path(args.dir or tempfile.mkdtemp(prefix="spmdlm-bench-prepare-"))
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes.split(",")] + ([80.0] if args.large else [])
    models = args.models.split(",")
    print(
        json.dumps(
            {
                "bench": "env",
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpus": len(os.sched_getaffinity(0)),
                "load_avg": os.getloadavg(),
                "dir": str(folder),
            }
        ),
        flush=True,
    )
    corpora = {size: make_corpus(folder / f"corpus-{size:g}mb.txt", size) for size in sizes}
    smallest = corpora[min(sizes)]
    toks = train_tokenizers(smallest, folder, sorted(set(models) | {"gpt2"}), args.vocab_size)
    if not args.skip_prepare:
        for corpus in corpora.values():
            for workers in [int(w) for w in args.workers.split(",")]:
                print(json.dumps(bench_prepare(corpus, toks["gpt2"], folder, workers, args.block_size)), flush=True)
    if not args.skip_read:
        threads = [int(t) for t in args.read_threads.split(",")]
        for model in models:
            for line in bench_read(
                smallest,
                toks[model],
                folder,
                model,
                args.seq_len,
                args.global_batch,
                args.batches,
                threads,
                args.read_mb,
            ):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
