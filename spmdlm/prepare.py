"""`python -m spmdlm.prepare`: tokenize a corpus once into a dataset directory that training reads (docs/data.md).

    python -m spmdlm.prepare --tokenizer TOKENIZER_DIR --for_model gpt2 --block_size 1024 --out DATASET_DIR \
        [--workers N] [--shard_size 256M] [--validation_percentage 5] [--text_column text] INPUTS...
    python -m spmdlm.prepare ... --dataset_name NAME_OR_PATH [--dataset_config_name C] --out DATASET_DIR

INPUTS are files, globs or directories of txt / json / jsonl / csv / parquet, plain, .gz or .zst. The result:

    DATASET_DIR/dataset.json                      the card: inputs, tokenizer, lengths, counts, shards and hashes
    DATASET_DIR/train-00000.array_record ...      fixed-length int32 records, `records_per_shard` per file
    DATASET_DIR/validation-00000.array_record ... the documents held out by hash (or the dataset's own split)
    DATASET_DIR/tokenizer/                        the tokenizer (for --tokenizer_name; AutoTokenizer loads it)

The records are those of the launcher's `--train_file` cache (the same code, `spmdlm.data.sources.tokenize_into`),
the same bytes whatever `--workers`. A second run with unchanged inputs (path, size, mtime and a hash of samples of
each file) and settings does nothing. Everything is written to a temp dir next to DATASET_DIR and renamed at the
end: an interrupted or failed run (a full disk) leaves no dataset that looks complete. Training:
`python -m spmdlm.launch --dataset_dir DATASET_DIR ...` (see `spmdlm.data.sources.open_dataset`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from spmdlm import storage
from spmdlm.data import sources
from spmdlm.data.sources import DataError

log = logging.getLogger("spmdlm.prepare")

DEFAULT_SHARD_BYTES = 256 << 20
OBJECTIVE_FLAGS = {  # flag -> argparse type; which apply is each family's `sequence_flags`
    "block_size": int, "max_seq_length": int, "mlm_probability": float, "mean_noise_span_length": float,
    "line_by_line": bool, "pad_to_max_length": bool, "mask_ratio": float, "poisson_lambda": float,
    "permute_sentence_ratio": float,
}


def parse_size(text: str) -> int:
    """'256M', '1G', '65536', '100K' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 256M, 1G or 65536")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


# -- the objective: record length and mode, as the launcher computes them ---------------------------------------------


def resolve_objective(for_model: str, tokenizer, flags: dict, config_name: str | None = None):
    """(family, objective, applicable flags) for the flags given, exactly as the launcher builds them: the same
    RunArgs, the family's check_lengths and build_objective (the record length and preparation mode come from it)."""
    from spmdlm.config import ArgumentError, RunArgs
    from spmdlm.families import get_family, load_config

    family = get_family(for_model)
    given = {k: v for k, v in flags.items() if v is not None and v is not False}
    foreign = [k for k in given if k not in family.sequence_flags]
    if foreign:
        raise ArgumentError(f"--{foreign[0]} does not apply to {family.name}; its flags: "
                            f"{', '.join('--' + f for f in family.sequence_flags)}")
    config = load_config(config_name or family.default_preset, family.name)
    args = RunArgs(model_type=family.name, **given)
    family.check_lengths(args, config)
    objective = family.build_objective(args, config, tokenizer)
    applicable = {k: getattr(args, k) for k in family.sequence_flags}
    return family, objective, applicable, config


# -- preparing a dataset directory -------------------------------------------------------------------------------------


def _key(head: dict) -> str:
    return hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()


CHANGE_NAMES = {"inputs": "inputs", "tokenizer": "tokenizer", "record_length": "record length",
                "mode": "preparation mode", "objective": "objective flags", "for_model": "--for_model",
                "validation": "validation split", "records_per_shard": "--shard_size", "separator_id": "separator id",
                "pad_id": "pad id", "version": "dataset format"}


def _changes(old: dict, head: dict) -> list[str]:
    """What differs between an existing card and this run's settings, in words."""
    return [CHANGE_NAMES.get(k, k) for k in head if old.get(k) != head[k]] or ["settings"]


def _shards_present(folder: Path, card: dict) -> bool:
    """Cheap check that a card's shards are all there at their recorded sizes."""
    for entry in (card.get("splits") or {}).values():
        for shard in (entry or {}).get("shards", []):
            path = folder / shard["file"]
            if not path.is_file() or storage.size(path) != shard["bytes"]:
                return False
    return True


def _remove_stale_temps(out: Path, host: str) -> None:
    import glob

    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-{glob.escape(host)}-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and not sources._pid_alive(int(pid)):
            log.info("removing %s, left by an interrupted preparation", path)
            shutil.rmtree(path, ignore_errors=True)


def prepare_dataset(corpus: sources.Corpus, tokenizer, out: str | os.PathLike, *, for_model: str, objective: dict,
                    record_length: int, mode: str, separator_id: int, pad_id: int | None,
                    validation_percentage: float = 5.0, workers: int | None = None,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, model_max_length: int = 1024,
                    progress: bool | None = None) -> dict:
    """Prepare `corpus` into the dataset directory `out` and return its card; a no-op when `out` already holds the
    dataset of these inputs and settings. Refuses (DataError) a non-empty `out` holding anything else, and a dataset
    of other inputs or settings unless `overwrite`. `workers` (default: the CPUs) changes speed, not the bytes."""
    from spmdlm.data.tokenizer import save_tokenizer

    out = storage.path(out, "--out") if storage.is_url(out) else Path(out).expanduser()
    workers = workers or sources.default_workers()
    inside = [p for p in corpus.files if p.resolve().is_relative_to(out.resolve())]
    if inside:  # a directory input that holds --out: not our own output
        corpus = dataclasses.replace(corpus, files=tuple(p for p in corpus.files if p not in inside))
        if not corpus.files:
            raise DataError(f"the inputs hold only files of --out {out}; give the corpus")
    if validation_percentage <= 0:
        validation = {"from": "none"}
    elif corpus.dataset_name and "validation" in corpus.splits:
        validation = {"from": "the dataset's validation split"}
    else:
        validation = {"from": "document hash", "percentage": validation_percentage}
    head = {
        "format": sources.CARD_FORMAT,
        "version": sources.CARD_VERSION,
        "inputs": corpus.manifest(),
        "tokenizer": {"sha256": sources.tokenizer_hash(tokenizer), "vocab_size": tokenizer.get_vocab_size(),
                      "dir": sources.TOKENIZER_DIR},
        "for_model": for_model,
        "objective": objective,
        "record_length": record_length,
        "mode": mode,
        "dtype": "int32",
        "separator_id": separator_id,
        "pad_id": pad_id,
        "validation": validation,
        "records_per_shard": max(1, shard_bytes // (4 * record_length)),
    }
    key = _key(head)

    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / sources.CARD_NAME).is_file():
            raise DataError(f"--out {out} is not empty and holds no prepared dataset; choose a new or empty --out")
        try:
            old = json.loads((out / sources.CARD_NAME).read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("key") == key and _shards_present(out, old):
            log.info("%s is up to date (same inputs and settings): nothing to do", out)
            return old
        if old.get("key") == key:
            log.warning("%s has missing or damaged shards; preparing it again", out)
        elif not overwrite:
            raise DataError(f"--out {out} holds a dataset prepared with other {', '.join(_changes(old, head))}; "
                            "pass --overwrite to replace it or choose another --out")

    host = socket.gethostname()
    tmp = out.with_name(f".{out.name}.tmp-{host}-{os.getpid()}")
    try:
        if storage.is_remote(out):  # prepared on local disk, then uploaded (the card last)
            import tempfile

            tmp = Path(tempfile.mkdtemp(prefix="spmdlm-prepare-")) / out.name
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(out, host)
            if tmp.exists():
                shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise DataError(f"cannot write in {out.parent}: {e.strerror or e}; choose a writable --out") from None
    try:
        card = {**head, "key": key, **_write_dataset(corpus, tokenizer, tmp, head, workers=workers,
                                                      validation_percentage=validation_percentage,
                                                      progress=progress)}
        save_tokenizer(tokenizer, tmp / sources.TOKENIZER_DIR, for_model, model_max_length=model_max_length)
        (tmp / sources.CARD_NAME).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
        _upload_in(tmp, out) if storage.is_remote(out) else _swap_in(tmp, out)
    finally:
        if storage.is_remote(out):
            shutil.rmtree(tmp.parent, ignore_errors=True)
        elif tmp.exists():  # failed before the swap
            shutil.rmtree(tmp, ignore_errors=True)
    return card


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished temp dir to `out`; an old dataset there is moved aside first, then removed."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _upload_in(tmp: Path, out) -> None:
    """A bucket has no rename: the old card goes first (a reader never sees a card over other shards), then the old
    files, then the new ones, the card last: `out` holds a dataset whenever it has a card."""
    storage.remove(out / sources.CARD_NAME)
    storage.remove(out)
    for file in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != sources.CARD_NAME):
        storage.upload(file, out / file.relative_to(tmp).as_posix())
    storage.upload(tmp / sources.CARD_NAME, out / sources.CARD_NAME)


def _write_dataset(corpus: sources.Corpus, tokenizer, folder: Path, head: dict, *, workers: int,
                   validation_percentage: float, progress: bool | None) -> dict:
    """Tokenize the corpus into shard files in `folder`; -> the card's "read" and "splits"."""
    from_hash = head["validation"]["from"] == "document hash"
    cut = sources.Cut(head["record_length"], head["separator_id"], head["mode"], head["pad_id"],
                      validation_percentage if from_hash else 0.0)
    sinks = {split: sources.RecordShards(lambda i, split=split: folder / f"{split}-{i:05d}.array_record",
                                         head["records_per_shard"])
             for split in ("train", "validation")}
    stats = sources.ReadStats()
    started = time.perf_counter()
    total = corpus.total_bytes
    bar = sources._progress_bar(total, "preparing", unit="B" if total else "doc",
                                disable=None if progress is None else not progress)
    tokens_seen = [0]

    def on_chunk(documents: int, tokens: int) -> None:
        tokens_seen[0] += tokens
        bar.update((stats.bytes_read - bar.n) if total else documents)
        bar.set_postfix_str(f"{tokens_seen[0] / max(1e-9, time.perf_counter() - started) / 1e6:.2f}M tok/s",
                            refresh=False)

    with bar:
        split_stats = sources.tokenize_into(corpus.documents("train", stats), tokenizer,
                                            sinks if from_hash else {"train": sinks["train"]}, cut,
                                            workers=workers, on_chunk=on_chunk)
        if head["validation"]["from"] == "the dataset's validation split":
            split_stats["validation"] = sources.tokenize_into(
                corpus.documents("validation", stats), tokenizer, {"train": sinks["validation"]}, cut,
                workers=workers, on_chunk=on_chunk)["train"]
    elapsed = time.perf_counter() - started
    shards = {split: sink.close() for split, sink in sinks.items()}
    train = split_stats["train"]
    if train.examples == 0:
        raise DataError(f"the training corpus has {train.tokens} tokens in {train.documents} documents, fewer than "
                        f"one example of {cut.record_length} tokens; give more text or lower the length")
    splits = {"train": None, "validation": None}
    for split, counts in split_stats.items():
        if counts.examples == 0:
            log.warning("the %s split (%d documents, %d tokens) is smaller than one example of %d tokens: none "
                        "written; raise --validation_percentage", split, counts.documents, counts.tokens,
                        cut.record_length)
            continue
        splits[split] = {**counts.card(), "shards": [{"file": s["path"].name, "records": s["records"],
                                                     "bytes": s["bytes"], "sha256": s["sha256"]}
                                                    for s in shards[split]]}
    total_tokens = sum(c.tokens for c in split_stats.values())
    log.info("tokenized %d documents (%d tokens) in %.1fs: %.0f tokens/s with %d worker%s", stats.documents,
             total_tokens, elapsed, total_tokens / max(elapsed, 1e-9), workers, "s" * (workers > 1))
    return {"read": stats.card(), "splits": splits}


# -- command line ------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m spmdlm.prepare",
        description="Tokenize a corpus once into sharded fixed-length records (a dataset directory) for "
                    "python -m spmdlm.launch --dataset_dir. See docs/data.md.")
    parser.add_argument("inputs", nargs="*", metavar="INPUTS",
                        help="files, globs or directories: txt/json/jsonl/csv/parquet, plain, .gz or .zst")
    parser.add_argument("--tokenizer", "--tokenizer_name", dest="tokenizer", required=True,
                        help="tokenizer.json, an HF tokenizer dir, or a SentencePiece spiece.model")
    parser.add_argument("--for_model", required=True, choices=["gpt2", "roberta", "t5", "bart"],
                        help="the model family whose objective the records serve")
    parser.add_argument("--out", required=True, help="the dataset directory to write")
    parser.add_argument("--config_name", default=None,
                        help="model config for default lengths and checks (default: the family's base preset)")
    group = parser.add_argument_group("objective (the family's flags, as python -m spmdlm.launch takes them)")
    for flag, kind in OBJECTIVE_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--{flag}", action="store_true", default=False)
        else:
            group.add_argument(f"--{flag}", type=kind, default=None)
    parser.add_argument("--dataset_name", default=None,
                        help="a datasets dataset: a save_to_disk dir, parquet file/dir, or Hub name (needs "
                             "pip install 'spmdlm[datasets]')")
    parser.add_argument("--dataset_config_name", default=None, help="the dataset's configuration")
    parser.add_argument("--text_column", default=None, help="json/jsonl/csv/parquet/datasets: the text field "
                                                            "(default: text)")
    parser.add_argument("--validation_percentage", "--validation_split_percentage", dest="validation_percentage",
                        type=float, default=5.0,
                        help="percent of documents held out by hash (default 5; 0: none); a dataset's own "
                             "validation split is used instead when it has one")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizer processes (default: the CPUs available; 1: in this process)")
    parser.add_argument("--shard_size", type=parse_size, default=DEFAULT_SHARD_BYTES,
                        help="bytes of records per shard file, e.g. 256M (default), 1G")
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset of other inputs or settings")
    parser.add_argument("--model_max_length", type=int, default=None,
                        help="model_max_length of the tokenizer copy (default: the config's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from spmdlm.config import ArgumentError
    from spmdlm.data.tokenizer import TokenizerError, load_tokenizer, special_token_ids
    from spmdlm.models.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    try:
        if args.workers is not None and args.workers < 1:
            raise ArgumentError(f"--workers {args.workers}: give 1 or more")
        if not 0 <= args.validation_percentage < 100:
            raise ArgumentError(f"--validation_percentage {args.validation_percentage}: give a value in [0, 100)")
        corpus = sources.open_corpus(args.inputs, dataset_name=args.dataset_name,
                                     dataset_config_name=args.dataset_config_name, text_column=args.text_column)
        tokenizer = load_tokenizer(args.tokenizer)
        flags = {flag: getattr(args, flag) for flag in OBJECTIVE_FLAGS}
        family, objective, applicable, config = resolve_objective(args.for_model, tokenizer, flags, args.config_name)
        ids = special_token_ids(tokenizer, family)
        card = prepare_dataset(
            corpus, tokenizer, args.out, for_model=family.name, objective=applicable,
            record_length=objective.record_length, mode=getattr(objective, "preparation", "stream"),
            separator_id=ids["eos"], pad_id=ids.get("pad"), validation_percentage=args.validation_percentage,
            workers=args.workers, shard_bytes=args.shard_size, overwrite=args.overwrite,
            model_max_length=args.model_max_length or config.max_length)
    except (DataError, TokenizerError, ArgumentError, ConfigError, storage.StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is not writable: the OS says what and where
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spmdlm.prepare: interrupted; nothing was written", file=sys.stderr)
        return 130
    train, validation = card["splits"]["train"], card["splits"].get("validation")
    print(f"{args.out}: {train['examples']} train examples of {card['record_length']} tokens in "
          f"{len(train['shards'])} shard(s)" + (f", {validation['examples']} validation examples" if validation
                                                else ", no validation split"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
