"""The read path of a dataset in a bucket, against the local GCS emulator: JSON lines.

    python benchmarks/bench_gcs_read.py                       # 8 MB corpus, gpt2 and t5 at length 128, batch 32
    python benchmarks/bench_gcs_read.py --mb 32 --models gpt2 --batches 400

1. A synthetic corpus (benchmarks/bench_prepare.py's) is prepared by `spmdlm.data.datasets.prepare_dataset` straight
   into gs://bench/<model>-<len> on the emulator (tests/gcs_emulator.py, in memory, on a free loopback port).
2. `stream` lines: every shard read through the path abstraction (spmdlm.storage: gcsfs) in 8 MiB chunks, as a
   reader without a local copy would: MB/s and record tokens/s.
3. `copy` lines: `spmdlm.data.datasets.open_dataset` on the bucket, cold (each shard downloaded to this host's disk
   with its sha256 checked) and warm (the verified copy reused): seconds, MB/s, record tokens/s.
4. `read` lines: the Grain pipeline (`spmdlm.data.pipeline.train_batches`: shuffle, the objective, batches) over
   that local copy: tokens/s of model input, the number to set against a model's training tokens/s.

Wall-clock on whatever else the machine runs: state the load with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def start_emulator(bucket: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            str(HERE.parent / "tests" / "gcs_emulator.py"),
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            bucket,
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def bench(
    model: str, corpus: Path, folder: Path, bucket: str, seq_len: int, global_batch: int, batches: int, vocab: int
) -> list[dict]:
    from bench_read import memmap_rate

    from spmdlm import storage
    from spmdlm.cli.prepare import resolve_objective
    from spmdlm.data import datasets, pipeline, readers
    from spmdlm.data.records import Cut
    from spmdlm.data.tokenization import special_token_ids, train_tokenizer
    from spmdlm.families import get_family

    family = get_family(model)
    docs = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok = train_tokenizer(family, docs[:20000], vocab)
    family, objective, flags, _ = resolve_objective(
        model, tok, {family.flags[0].name: seq_len}, config_name=family.quickstart["config_name"]
    )
    ids = special_token_ids(tok, family)
    mode = objective.preparation
    remote = f"{bucket}/{model}-{seq_len}"
    start = time.perf_counter()
    card = datasets.prepare_dataset(
        readers.open_corpus([str(corpus)]),
        remote,
        Cut(objective.record_length, ids["eos"], mode, ids.get("pad")),
        datasets.ForModel(family, tok, flags),
        workers=1,
        progress=False,
        shard_bytes=4 << 20,
    )
    shards = card["splits"]["train"]["shards"]
    size = sum(s["bytes"] for s in shards)
    record_tokens = card["splits"]["train"]["examples"] * objective.record_length
    common = {
        "model": model,
        "seq_len": seq_len,
        "record_length": objective.record_length,
        "shards": len(shards),
        "dataset_mb": round(size / 1e6, 2),
        "record_tokens": record_tokens,
    }
    lines = [{"bench": "prepare_to_bucket", **common, "seconds": round(time.perf_counter() - start, 2)}]

    start = time.perf_counter()
    for shard in shards:
        with storage.path(f"{remote}/{shard['file']}").open("rb") as f:
            while f.read(8 << 20):
                pass
    seconds = time.perf_counter() - start
    lines.append(
        {
            "bench": "stream",
            **common,
            "seconds": round(seconds, 3),
            "mb_per_s": round(size / 1e6 / seconds, 1),
            "record_tokens_per_s": round(record_tokens / seconds),
        }
    )

    os.environ["SPMDLM_LOCAL_CACHE"] = str(folder / f"local-{model}")
    for kind in ("cold", "warm"):
        start = time.perf_counter()
        train, _, _ = datasets.open_dataset(remote, tokenizer=tok, record_length=objective.record_length, mode=mode)
        seconds = time.perf_counter() - start
        lines.append(
            {
                "bench": "copy",
                "kind": kind,
                **common,
                "seconds": round(seconds, 3),
                "mb_per_s": round(size / 1e6 / seconds, 1),
                "record_tokens_per_s": round(record_tokens / seconds),
            }
        )

    first = next(iter(objective.example_spec()))
    input_tokens = int(np.prod(objective.example_spec()[first][0]))
    it = pipeline.train_batches(train, objective, seed=0, global_batch=global_batch, num_epochs=100)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    limit = memmap_rate(train, global_batch, seconds=1.0) * global_batch * input_tokens
    lines.append(
        {
            "bench": "read",
            **common,
            "objective": type(objective).__name__,
            "global_batch": global_batch,
            "batches": batches,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(batches * global_batch * input_tokens / seconds),
            "memmap_limit_tokens_per_s": round(limit),
            "load_avg": os.getloadavg(),
        }
    )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=8.0, help="corpus size in MB (default 8)")
    p.add_argument("--models", default="gpt2,t5")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--global_batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--vocab_size", type=int, default=8192)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from bench_prepare import make_corpus

    folder = Path(tempfile.mkdtemp(prefix="spmdlm-bench-gcs-"))
    server, url = start_emulator("bench")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        print(
            json.dumps(
                {"bench": "env", "cpus": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(), "emulator": url}
            ),
            flush=True,
        )
        corpus = make_corpus(folder / "corpus.txt", args.mb)
        for model in args.models.split(","):
            for line in bench(
                model, corpus, folder, "gs://bench", args.seq_len, args.global_batch, args.batches, args.vocab_size
            ):
                print(json.dumps(line), flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
