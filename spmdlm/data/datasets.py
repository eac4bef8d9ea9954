"""Prepared dataset directories (docs/data.md): writing one from a corpus (`prepare_dataset`, what
`python -m spmdlm.prepare` runs) and opening one for training (`open_dataset`, `--dataset_dir`).

A dataset directory holds sharded splits of fixed-length records (spmdlm.data.records) and a `dataset.json` card:
the inputs, the tokenizer (a copy of it too), the lengths, the counts, the shards and their hashes. `open_dataset`
refuses a dataset of another tokenizer, record length or mode than the run's.

Buckets (gs://, spmdlm/storage.py): a dataset is prepared on local disk and uploaded (the card last); a
`--dataset_dir gs://...` is copied once to each host's local disk (storage.local_mirror, verified by size and
sha256, reused while it matches) and memory-mapped there.

Version 2 writes the shards as flat token files (spmdlm.data.records); a version-1 dataset (one ArrayRecord entry
per record, read one record at a time) is refused in one line that says how to prepare it again.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from spmdlm import storage
from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.readers import DATASET_CARD, Corpus, ReadStats
from spmdlm.data.records import (
    TOKENS_SUFFIX,
    Cut,
    PreparedSplit,
    RecordShards,
    default_workers,
    file_sha256,
    no_space,
    progress_bar,
    remove_stale_temps,
    token_file_problem,
    tokenize_into,
)
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.data.tokenization import save_tokenizer
from spmdlm.errors import DataError

log = logging.getLogger(__name__)

CARD_NAME = DATASET_CARD
CARD_FORMAT = "spmdlm-dataset"
CARD_VERSION = 2  # 1: ArrayRecord shards
TOKENIZER_DIR = "tokenizer"  # the dataset's copy of its tokenizer (loadable with --tokenizer_name DATASET/tokenizer)
DEFAULT_SHARD_BYTES = 256 << 20
ID_CHECK_CHUNK = 1 << 24  # tokens per step of the id check (64 MiB)
ID_SCAN_ALL_BYTES = 4 << 30  # datasets up to this size have every token id checked at start (~4 s)


# -- opening a dataset (training) --------------------------------------------------------------------------------------


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's serialization: what a dataset is tied to."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def read_card(dataset_dir: str | os.PathLike) -> dict:
    """The dataset.json of a prepared dataset; DataError (one line) when there is none or it is not ours."""
    folder = storage.path(dataset_dir, "--dataset_dir")
    path = folder / CARD_NAME
    if not path.is_file():
        what = "no such directory" if not folder.exists() else f"no {CARD_NAME} in it"
        raise DataError(f"--dataset_dir {folder}: {what}; prepare one with python -m spmdlm.prepare")
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"--dataset_dir {folder}: {CARD_NAME} is unreadable ({e}); prepare the dataset again") from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        raise DataError(f"--dataset_dir {folder}: {CARD_NAME} is not an spmdlm dataset card")
    if card.get("version") != CARD_VERSION:
        raise DataError(
            f"--dataset_dir {folder}: dataset format version {card.get('version')}, this spmdlm reads "
            f"{CARD_VERSION} (flat token shards, read in batches); prepare it again with this version: "
            "python -m spmdlm.prepare ... --overwrite"
        )
    return card


def _open_split(folder: Path, card: dict, split: str, verify: bool) -> PreparedSplit | None:
    entry = card["splits"].get(split)
    if not entry:
        return None
    paths = [folder / shard["file"] for shard in entry["shards"]]
    for path, shard in zip(paths, entry["shards"]):
        if not path.is_file():
            raise DataError(f"--dataset_dir {folder}: shard {shard['file']} is missing; prepare the dataset again")
        if (size := storage.size(path)) != shard["bytes"]:
            raise DataError(
                f"--dataset_dir {folder}: shard {shard['file']} has {size} bytes, {shard['bytes']} "
                "expected; prepare the dataset again"
            )
    if storage.is_remote(folder):  # Grain reads local files: a verified copy on this host's disk
        paths = [_local_shard(folder, path, shard) for path, shard in zip(paths, entry["shards"])]
    for path, shard in zip(paths, entry["shards"]):
        if verify and file_sha256(path) != shard["sha256"]:
            raise DataError(
                f"--dataset_dir {folder}: shard {shard['file']} does not match its sha256; prepare the dataset again"
            )
    for path, shard in zip(paths, entry["shards"]):
        if problem := token_file_problem(path, shard["bytes"], shard["records"], card["record_length"]):
            raise DataError(f"--dataset_dir {folder}: {problem}; prepare the dataset again")
    if (records := sum(shard["records"] for shard in entry["shards"])) != entry["examples"]:
        raise DataError(
            f"--dataset_dir {folder}: the {split} shards hold {records} records, {entry['examples']} "
            "expected; prepare the dataset again"
        )
    return PreparedSplit(tuple(paths), entry["examples"], entry["tokens"], card["record_length"], card.get("key", ""))


def _local_shard(folder, remote, shard: dict) -> Path:
    """This host's copy of a bucket's shard (storage.local_mirror), downloaded unless a copy of the card's size and
    sha256 is there already (its sha256 is kept beside it); a copy that does not match the card is refused."""
    local = storage.local_mirror(folder) / shard["file"]
    checked = local.with_name(local.name + ".sha256")
    if (
        local.is_file()
        and local.stat().st_size == shard["bytes"]
        and checked.is_file()
        and checked.read_text() == shard["sha256"]
    ):
        return local
    if storage.download(remote, local, desc=f"copying {shard['file']}") != shard["sha256"]:
        local.unlink(missing_ok=True)
        raise DataError(
            f"--dataset_dir {folder}: shard {shard['file']} does not match its sha256; prepare the dataset again"
        )
    checked.write_text(shard["sha256"])
    return local


def _prepared_for(folder, card: dict) -> str:
    """What a dataset was prepared for, in words: its family and the objective flags it was given (not those off,
    nor the default --document_attention, which every card has)."""
    return f"--dataset_dir {folder} was prepared for {card.get('for_model')} {_flags_of(card)}".rstrip()


def _flags_of(card: dict) -> str:
    """The launcher flags a dataset was prepared with ('--line_by_line --packing --max_seq_length 128'): those given,
    not those off, nor the default --document_attention, which every card has."""
    unsaid = lambda k, v: v in (None, False) or (k == DOCUMENT_ATTENTION.name and v == DOCUMENT_ATTENTION.default)
    return " ".join(
        f"--{k}" if v is True else f"--{k} {v}" for k, v in (card.get("objective") or {}).items() if not unsaid(k, v)
    )


def open_dataset(
    dataset_dir: str | os.PathLike, *, tokenizer, record_length: int, mode: str, verify: bool = False
) -> tuple[PreparedSplit, PreparedSplit | None, dict]:
    """(train, validation or None, card) of a dataset written by `python -m spmdlm.prepare`.

    Refuses (DataError, one line) a dataset prepared with another tokenizer (sha256 of tokenizer.to_str()), record
    length or preparation mode than the run's, and one whose shards are missing or of the wrong size or record
    count; `verify` also checks every shard's sha256 (reads everything). Every host may call it: it only reads (a
    dataset in a bucket is copied to each host's local disk, verified).
    """
    folder = storage.path(dataset_dir, "--dataset_dir")
    card = read_card(folder)
    if card["mode"] != mode:  # first: another mode has another length too (packed_lines), and says why
        raise DataError(
            f"{_prepared_for(folder, card)} ({card['mode']!r} records) but this run's objective needs "
            f"{mode!r} records: pass {_flags_of(card) or 'no objective flags'} as it was prepared "
            f"(--model_type {card.get('for_model')}), or prepare the data again for this objective"
        )
    if card["record_length"] != record_length:
        raise DataError(
            f"{_prepared_for(folder, card)} (records of {card['record_length']} tokens) but this run "
            f"needs records of {record_length} tokens: pass the same length flags or prepare the data "
            "again"
        )
    if card["tokenizer"]["sha256"] != tokenizer_hash(tokenizer):
        raise DataError(
            f"--dataset_dir {folder} was tokenized with another tokenizer than this run's (sha256 "
            f"{card['tokenizer']['sha256'][:12]}, this run's {tokenizer_hash(tokenizer)[:12]}): pass "
            f"--tokenizer_name {folder / TOKENIZER_DIR} or prepare the data again"
        )
    train = _open_split(folder, card, "train", verify)
    if train is None:
        raise DataError(f"--dataset_dir {folder} has no training split; prepare the dataset again")
    validation = _open_split(folder, card, "validation", verify)
    for split in filter(None, (train, validation)):
        _check_ids(folder, split, card["mode"], tokenizer.get_vocab_size())
    return train, validation, card


def _check_ids(folder, split: PreparedSplit, mode: str, vocab_size: int) -> None:
    """Every token id of the split's shards lies in [0, vocab_size): an id outside (a damaged or foreign shard) would
    read as NaN from the embedding and end the run as a divergence. One pass over the memory maps (~1 GB/s) up to
    ID_SCAN_ALL_BYTES; a larger dataset, which every start of every host would otherwise read whole, has the first and
    last chunk of each shard scanned (a foreign tokenizer's ids, a damaged tail)."""
    id_bits = SENTENCE_END - 1 if mode == "sentences" else -1  # BART's records flag each sentence's last token
    shards = [np.memmap(path, dtype=np.int32, mode="r") for path in split.paths]
    whole = sum(tokens.nbytes for tokens in shards) <= ID_SCAN_ALL_BYTES
    for path, tokens in zip(split.paths, shards):
        starts = range(0, len(tokens), ID_CHECK_CHUNK)
        for start in starts if whole else sorted({0, starts[-1]} if len(starts) else ()):
            ids = tokens[start : start + ID_CHECK_CHUNK] & id_bits
            if ids.size and not (0 <= ids.min() and ids.max() < vocab_size):
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise DataError(
                    f"--dataset_dir {folder}: shard {path.name} holds token id {bad}, outside the "
                    f"tokenizer's {vocab_size} ids (a damaged shard); prepare the dataset again"
                )


# -- preparing a dataset (python -m spmdlm.prepare) ------------------------------------------------------------------


def _key(head: dict) -> str:
    return hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()


CHANGE_NAMES = {
    "inputs": "inputs",
    "tokenizer": "tokenizer",
    "record_length": "record length",
    "mode": "preparation mode",
    "objective": "objective flags",
    "for_model": "--for_model",
    "validation": "validation split",
    "records_per_shard": "--shard_size",
    "separator_id": "separator id",
    "pad_id": "pad id",
    "bos_id": "bos id",
    "version": "dataset format",
}


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


def prepare_dataset(
    corpus: Corpus,
    tokenizer,
    out: str | os.PathLike,
    *,
    family,
    objective: dict,
    record_length: int,
    mode: str,
    separator_id: int,
    pad_id: int | None,
    bos_id: int | None = None,
    validation_percentage: float = 5.0,
    workers: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    model_max_length: int = 1024,
    progress: bool | None = None,
) -> dict:
    """Prepare `corpus` into the dataset directory `out` and return its card; a no-op when `out` already holds the
    dataset of these inputs and settings. Refuses (DataError) a non-empty `out` holding anything else, and a dataset
    of other inputs or settings unless `overwrite`. `workers` (default: the CPUs) changes speed, not the bytes.
    `family`: the model family the records serve (its name goes in the card, its tokenizer spec into the copy of the
    tokenizer)."""
    out = storage.path(out, "--out") if storage.is_url(out) else Path(out).expanduser()
    workers = workers or default_workers()
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
        "format": CARD_FORMAT,
        "version": CARD_VERSION,
        "inputs": corpus.manifest(),
        "tokenizer": {
            "sha256": tokenizer_hash(tokenizer),
            "vocab_size": tokenizer.get_vocab_size(),
            "dir": TOKENIZER_DIR,
        },
        "for_model": family.name,
        "objective": objective,
        "record_length": record_length,
        "mode": mode,
        "dtype": "int32",
        "separator_id": separator_id,
        "pad_id": pad_id,
        **({"bos_id": bos_id} if mode == "packed_lines" else {}),  # only where records hold it: other keys unchanged
        "validation": validation,
        "records_per_shard": max(1, shard_bytes // (4 * record_length)),
    }
    key = _key(head)

    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a directory")
    seen = None  # the card this run found in `out` and may replace (None: no dataset there)
    if out.is_dir() and any(out.iterdir()):
        if not (out / CARD_NAME).is_file():
            raise DataError(f"--out {out} is not empty and holds no prepared dataset; choose a new or empty --out")
        try:
            seen = (out / CARD_NAME).read_text()
            old = json.loads(seen)
        except (OSError, ValueError):
            old = {}
        if old.get("key") == key and _shards_present(out, old):
            log.info("%s is up to date (same inputs and settings): nothing to do", out)
            return old
        if old.get("key") == key:
            log.warning("%s has missing or damaged shards; preparing it again", out)
        elif not overwrite:
            raise DataError(
                f"--out {out} holds a dataset prepared with other {', '.join(_changes(old, head))}; "
                "pass --overwrite to replace it or choose another --out"
            )

    host = socket.gethostname()
    tmp = out.with_name(f".{out.name}.tmp-{host}-{os.getpid()}")
    try:
        if storage.is_remote(out):  # prepared on local disk, then uploaded (the card last)
            tmp = Path(tempfile.mkdtemp(prefix="spmdlm-prepare-")) / out.name
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(out.parent, f".{glob.escape(out.name)}", host)
            if tmp.exists():
                shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise DataError(f"cannot write in {out.parent}: {e.strerror or e}; choose a writable --out") from None
    try:
        card = {
            **head,
            "key": key,
            **_write_dataset(
                corpus,
                tokenizer,
                tmp,
                head,
                workers=workers,
                validation_percentage=validation_percentage,
                progress=progress,
            ),
        }
        save_tokenizer(tokenizer, tmp / TOKENIZER_DIR, family, model_max_length=model_max_length)
        (tmp / CARD_NAME).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
        if storage.is_remote(out):
            _upload_in(tmp, out)
        else:
            card = _swap_in(tmp, out, seen, card)
    except OSError as e:
        if not no_space(e):
            raise
        raise DataError(
            f"cannot write the dataset {out}: no space left on device in {out.parent}; free some "
            "space or choose another --out"
        ) from None
    finally:
        if storage.is_remote(out):
            shutil.rmtree(tmp.parent, ignore_errors=True)
        elif tmp.exists():  # failed before the swap
            shutil.rmtree(tmp, ignore_errors=True)
    return card


def _describe(card: dict) -> str:
    return (
        f"for {card.get('for_model')}, records of {card.get('record_length')} tokens, key {str(card.get('key'))[:12]}"
    )


def _raced(out: Path, ours: dict) -> DataError:
    """The refusal when another preparation put its dataset in `out` while this one was writing."""
    try:
        theirs = json.loads((out / CARD_NAME).read_text())
    except (OSError, ValueError):
        theirs = {}
    return DataError(
        f"--out {out} got another dataset ({_describe(theirs)}) from a preparation that ran at the same "
        f"time; this one ({_describe(ours)}) was not written over it: choose another --out, or run "
        "again with --overwrite to replace it"
    )


def _swap_in(tmp: Path, out: Path, seen: str | None, card: dict) -> dict:
    """Rename the finished temp dir to `out` -> the card of the dataset `out` then holds. `seen` is the card text
    this run found there when it started (None: no dataset): that dataset is moved aside first, then removed. A
    dataset another run put there since is kept and refused (DataError), unless it is this very dataset. The
    renames are atomic: of two preparations racing for one `out`, one wins."""
    old = None
    if seen is not None:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        try:
            os.rename(out, old)
        except FileNotFoundError:  # removed meanwhile
            old = None
        else:
            try:
                now = (old / CARD_NAME).read_text()
            except OSError:
                now = None
            if now != seen:  # not the dataset this run decided to replace: put it back
                os.rename(old, out)
                return _same_or_refuse(tmp, out, card)
    try:
        os.rename(tmp, out)  # fails when `out` is not empty (another run's dataset is there)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # the old one was to go; the other run's replaced it
        return _same_or_refuse(tmp, out, card)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return card


def _same_or_refuse(tmp: Path, out: Path, card: dict) -> dict:
    """`out` got a dataset from another run meanwhile: fine when it is the same one (same key, shards there),
    else refused. Ours (in `tmp`) is removed by the caller."""
    try:
        theirs = json.loads((out / CARD_NAME).read_text())
    except (OSError, ValueError):
        theirs = {}
    if theirs.get("key") == card["key"] and _shards_present(out, theirs):
        log.info("%s was prepared meanwhile by another run with the same inputs and settings; keeping it", out)
        return theirs
    raise _raced(out, card)


def _upload_in(tmp: Path, out) -> None:
    """A bucket has no rename: the old card goes first (a reader never sees a card over other shards), then the old
    files, then the new ones, the card last: `out` holds a dataset whenever it has a card."""
    storage.remove(out / CARD_NAME)
    storage.remove(out)
    for file in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != CARD_NAME):
        storage.upload(file, out / file.relative_to(tmp).as_posix())
    storage.upload(tmp / CARD_NAME, out / CARD_NAME)


def _write_dataset(
    corpus: Corpus,
    tokenizer,
    folder: Path,
    head: dict,
    *,
    workers: int,
    validation_percentage: float,
    progress: bool | None,
) -> dict:
    """Tokenize the corpus into shard files in `folder`; -> the card's "read" and "splits"."""
    from_hash = head["validation"]["from"] == "document hash"
    cut = Cut(
        head["record_length"],
        head["separator_id"],
        head["mode"],
        head["pad_id"],
        validation_percentage if from_hash else 0.0,
        bos_id=head.get("bos_id"),
    )
    sinks = {
        split: RecordShards(
            lambda i, split=split: folder / f"{split}-{i:05d}{TOKENS_SUFFIX}", head["records_per_shard"]
        )
        for split in ("train", "validation")
    }
    stats = ReadStats()
    started = time.perf_counter()
    total = corpus.total_bytes
    bar = progress_bar(
        total, "preparing", unit="B" if total else "doc", disable=None if progress is None else not progress
    )
    tokens_seen = [0]

    def on_chunk(documents: int, tokens: int) -> None:
        tokens_seen[0] += tokens
        bar.update((stats.bytes_read - bar.n) if total else documents)
        bar.set_postfix_str(
            f"{tokens_seen[0] / max(1e-9, time.perf_counter() - started) / 1e6:.2f}M tok/s", refresh=False
        )

    with bar:
        split_stats = tokenize_into(
            corpus.documents("train", stats),
            tokenizer,
            sinks if from_hash else {"train": sinks["train"]},
            cut,
            workers=workers,
            on_chunk=on_chunk,
        )
        if head["validation"]["from"] == "the dataset's validation split":
            split_stats["validation"] = tokenize_into(
                corpus.documents("validation", stats),
                tokenizer,
                {"train": sinks["validation"]},
                cut,
                workers=workers,
                on_chunk=on_chunk,
                name="validation",
            )["train"]
    elapsed = time.perf_counter() - started
    shards = {split: sink.close() for split, sink in sinks.items()}
    train = split_stats["train"]
    if train.examples == 0:
        raise DataError(
            f"the training corpus has {train.tokens} tokens in {train.documents} documents, fewer than "
            f"one example of {cut.record_length} tokens; give more text or lower the length"
        )
    splits = {"train": None, "validation": None}
    for split, counts in split_stats.items():
        if counts.examples == 0:
            log.warning(
                "the %s split (%d documents, %d tokens) is smaller than one example of %d tokens: none "
                "written; raise --validation_percentage",
                split,
                counts.documents,
                counts.tokens,
                cut.record_length,
            )
            continue
        splits[split] = {
            **counts.card(),
            "shards": [
                {"file": s["path"].name, "records": s["records"], "bytes": s["bytes"], "sha256": s["sha256"]}
                for s in shards[split]
            ],
        }
    total_tokens = sum(c.tokens for c in split_stats.values())
    log.info(
        "tokenized %d documents (%d tokens) in %.1fs: %.0f tokens/s with %d worker%s",
        stats.documents,
        total_tokens,
        elapsed,
        total_tokens / max(elapsed, 1e-9),
        workers,
        "s" * (workers > 1),
    )
    return {"read": stats.card(), "splits": splits}
