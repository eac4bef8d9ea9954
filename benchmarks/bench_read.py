"""The training read path against the machine's limit, in one process: a table.

    python benchmarks/bench_read.py                       # CLM, MLM, T5, BART at lengths 128 and 512, batch 32
    python benchmarks/bench_read.py --objectives clm --lengths 128 --threads 0,1,2 --records 40000

For each objective and sequence length, a token file of `--records` synthetic records (Zipf-distributed ids, a
document separator every ~300 tokens, BART's sentence-end flag on ~1 token in 15) is written with the real writer
(spmdlm.data.records.RecordShards), then, alternately for `--seconds` each:
- `iterator`: `spmdlm.data.pipeline.train_batches` (the training iterator: shuffled order, this host's rows, the
  objective, host numpy batches), with Grain's `num_threads` of `--threads` (the training default is the
  objective's own, pipeline.read_options_for: 1, BART 0; 0: synchronous);
- `limit`: the same file read as a plain `np.memmap`, a batch of shuffled record indices gathered per step: what
  reading the tokens costs at all.
tokens/s count model input tokens (batch × the objective's input length). The load average is sampled after each
row: the numbers are wall-clock on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import grain
import numpy as np

from spmdlm.data import pipeline
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.objectives.mlm import MaskedLM
from spmdlm.data.records import TOKEN_DTYPE, PreparedSplit, RecordShards
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.families.bart.objective import Denoising
from spmdlm.families.t5.objective import SpanCorruption

VOCAB = 8192
BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 4  # RoBERTa/BART's layout; T5's sentinels are the top 100 ids
SPECIALS = (BOS, PAD, EOS, UNK, MASK)


def make_objective(name: str, length: int):
    framed = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, mask_id=MASK, special_ids=SPECIALS)
    if name == "clm":
        return CausalLM(length)
    if name == "mlm":
        return MaskedLM(length, vocab_size=VOCAB, **framed)
    if name == "t5":
        return SpanCorruption(length, tuple(range(VOCAB - 1, VOCAB - 101, -1)), EOS)
    if name == "bart":
        return Denoising(length, decoder_start_id=EOS, **framed)
    raise SystemExit(f"unknown objective {name!r}: clm, mlm, t5, bart")


def synthetic_split(folder: Path, name: str, objective, records: int, seed: int = 0) -> PreparedSplit:
    path = folder / f"{name}-{objective.record_length}.tokens"
    length = objective.record_length
    if not path.exists() or path.stat().st_size != records * length * TOKEN_DTYPE.itemsize:
        rng = np.random.default_rng(seed)
        sink = RecordShards(lambda index: path)
        for start in range(0, records, 4096):
            shape = (min(4096, records - start), length)
            ids = np.minimum(rng.zipf(1.2, shape) + len(SPECIALS), VOCAB - 101).astype(np.int32)
            ids[rng.random(shape) < 1 / 300] = EOS
            if name == "bart":
                ids |= np.where(rng.random(shape) < 1 / 15, SENTENCE_END, 0).astype(np.int32)
            sink.write(ids)
        sink.close()
    return PreparedSplit(path, records, records * length, length)


def iterator_rate(split, objective, batch: int, threads: int, seconds: float) -> float:
    """Batches/s of the training iterator."""
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)
    it = pipeline.train_batches(split, objective, seed=0, global_batch=batch, num_epochs=1000, read_options=options)
    next(it)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        next(it)
        count += 1
    return count / elapsed


def memmap_rate(split, batch: int, seconds: float) -> float:
    """Batches/s of a shuffled batch read from a plain memory map of the same file (a split's first shard)."""
    tokens = np.memmap(split.paths[0], dtype=TOKEN_DTYPE, mode="r").reshape(-1, split.record_length)
    order = np.random.default_rng(0).permutation(len(tokens))
    steps = len(tokens) // batch
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        step = count % steps
        np.asarray(tokens[order[step * batch : (step + 1) * batch]])
        count += 1
    return count / elapsed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objectives", default="clm,mlm,t5,bart")
    p.add_argument("--lengths", default="128,512", help="sequence lengths (model input tokens per example)")
    p.add_argument("--batch", type=int, default=32, help="global batch (one process reads all of it)")
    p.add_argument("--records", type=int, default=40_000, help="records per token file")
    p.add_argument("--threads", default="1", help="Grain num_threads values for the iterator (0: synchronous)")
    p.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    p.add_argument("--dir", default=None, help="where the token files go (default: a temp dir)")
    args = p.parse_args(argv)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="spmdlm-bench-read-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"cpus {len(os.sched_getaffinity(0))}, batch {args.batch}, {args.records} records per file in {folder}")
    header = ("objective", "length", "threads", "iterator tok/s", "memmap limit tok/s", "ratio", "load 1m/5m/15m")
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header), flush=True)
    for name in args.objectives.split(","):
        for length in [int(n) for n in args.lengths.split(",")]:
            objective = make_objective(name, length)
            split = synthetic_split(folder, name, objective, args.records)
            tokens = args.batch * objective.sequence_lengths()["input"]
            for threads in [int(t) for t in args.threads.split(",")]:
                limit = memmap_rate(split, args.batch, args.seconds / 2) * tokens
                rate = iterator_rate(split, objective, args.batch, threads, args.seconds) * tokens
                limit = (limit + memmap_rate(split, args.batch, args.seconds / 2) * tokens) / 2
                load = "/".join(f"{x:.1f}" for x in os.getloadavg())
                print(
                    f"| {name} | {length} | {threads} | {rate / 1e6:.2f}M | {limit / 1e6:.1f}M | "
                    f"{rate / limit:.1%} | {load} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
