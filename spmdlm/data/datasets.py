"""Dataset directories (docs/data.md): the one on-disk format of tokenized data. `python -m spmdlm.prepare` writes one
from a corpus (`prepare_dataset`), the launcher's token cache one per split of its documents (spmdlm.data.token_cache,
through the same `write_dataset`), and a run opens one with `--dataset_dir` (`open_dataset`).

A dataset directory holds sharded splits of fixed-length records (spmdlm.data.records) and a `dataset.json` card:
the inputs, the tokenizer (a copy of it too), the lengths, the counts, the shards and their hashes. `open_dataset`
refuses a dataset of another tokenizer, record length or mode than the run's.

Writing goes through storage.staging and storage.swap_in: a temporary sibling renamed into place, or in a bucket
uploaded with the card last. A `--dataset_dir gs://...` is copied once to each host's local disk
(storage.local_mirror, verified by size and sha256, reused while it matches) and memory-mapped there. A dataset of an
earlier format version is refused in one line that gives the command to prepare it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from spmdlm import storage
from spmdlm.crashpoints import crash_point
from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.readers import DATASET_CARD, Corpus, ReadStats
from spmdlm.data.records import (
    TOKENS_SUFFIX,
    Cut,
    PreparedSplit,
    RecordShards,
    SplitStats,
    default_workers,
    progress_bar,
    token_file_problem,
    tokenize_into,
)
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.data.tokenization import save_tokenizer
from spmdlm.errors import DataError, UnwritableDataError

log = logging.getLogger(__name__)

CARD_NAME = DATASET_CARD
CARD_FORMAT = "spmdlm-dataset"
CARD_VERSION = 2  # 1: ArrayRecord shards
TOKENIZER_DIR = "tokenizer"  # the dataset's copy of its tokenizer (loadable with --tokenizer_name DATASET/tokenizer)
DEFAULT_SHARD_BYTES = 256 << 20
ID_CHECK_CHUNK = 1 << 24  # tokens per step of the id check (64 MiB)
ID_SCAN_ALL_BYTES = 4 << 30  # datasets up to this size have every token id checked at start (~4 s)
HASH_SPLIT, OWN_SPLIT = "document hash", "the dataset's validation split"  # where a validation split comes from


class DamagedDataset(DataError):
    """A dataset whose shards do not match its card: missing, of another size, hash or record count."""


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
        if folder.exists() and (".tmp-" in folder.name or (folder / TOKENIZER_DIR).exists()):
            what += ": an incomplete dataset (a preparation that did not finish writes its card last)"
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
            f"{CARD_VERSION} (flat token shards, read in batches); prepare it again: {_prepare_again(folder, card)}"
        )
    return card


def tokenizer_dir(dataset_dir: str | os.PathLike) -> Path:
    """The dataset's copy of its tokenizer, once the dataset is known to be whole (a missing or half-written one is
    named as such, not as a missing tokenizer)."""
    read_card(dataset_dir)
    return storage.path(dataset_dir, "--dataset_dir") / TOKENIZER_DIR


def _prepare_again(folder, card: dict) -> str:
    """The command that prepares an earlier version's dataset again, as its card describes it."""
    files = [entry["path"] for entry in (card.get("inputs") or {}).get("files", [])]
    inputs = " ".join(files) if 0 < len(files) <= 3 else "INPUTS"
    flags = " ".join(filter(None, [f"--for_model {card.get('for_model') or 'MODEL'}", _flags_of(card)]))
    return f"python -m spmdlm.prepare --tokenizer {folder / TOKENIZER_DIR} {flags} --out {folder} --overwrite {inputs}"


def open_split(folder, card: dict, split: str, verify: bool) -> PreparedSplit | None:
    """The split `split` of the dataset in `folder` (None: the card has none), its shards checked against the card:
    present, of their size and record count, with `verify` also their sha256 (reads everything); a bucket's are read
    from a verified copy on this host's disk. DamagedDataset (the problem only) when one does not match."""
    entry = card["splits"].get(split)
    if not entry:
        return None
    outside = [shard["file"] for shard in entry["shards"] if not storage.inside(shard["file"])]
    if outside:
        raise DamagedDataset(f"its card names shard {outside[0]!r}, outside the dataset folder")
    paths = [folder / shard["file"] for shard in entry["shards"]]
    for path, shard in zip(paths, entry["shards"]):
        if not path.is_file():
            raise DamagedDataset(f"shard {shard['file']} is missing")
        if (size := storage.size(path)) != shard["bytes"]:
            raise DamagedDataset(f"shard {shard['file']} has {size} bytes, {shard['bytes']} expected")
    if storage.is_remote(folder):  # Grain reads local files: a verified copy on this host's disk
        paths = [_local_shard(folder, path, shard) for path, shard in zip(paths, entry["shards"])]
    for path, shard in zip(paths, entry["shards"]):
        if verify and storage.file_sha256(path) != shard["sha256"]:
            raise DamagedDataset(f"shard {shard['file']} does not match its sha256")
        if problem := token_file_problem(path, shard["bytes"], shard["records"], card["record_length"]):
            raise DamagedDataset(problem)
    if (records := sum(shard["records"] for shard in entry["shards"])) != entry["examples"]:
        raise DamagedDataset(f"the {split} shards hold {records} records, {entry['examples']} expected")
    return PreparedSplit(
        tuple(paths),
        entry["examples"],
        entry["tokens"],
        card["record_length"],
        card.get("key", ""),
        entry.get("documents"),
    )


def _local_shard(folder, remote, shard: dict) -> Path:
    """This host's copy of a bucket's shard (storage.local_mirror), downloaded unless a copy of the card's size and
    sha256 is there already (its sha256 is kept beside it); a copy that does not match the card is refused."""
    local = storage.local_mirror(folder) / shard["file"]
    if local.is_file() and local.stat().st_size == shard["bytes"] and _mirrored_sha256(local) == shard["sha256"]:
        return local
    if storage.download(remote, local, desc=f"copying {shard['file']}") != shard["sha256"]:
        local.unlink(missing_ok=True)
        raise DamagedDataset(f"shard {shard['file']} does not match its sha256")
    _sha256_note(local).write_text(shard["sha256"])
    return local


def _sha256_note(local: Path) -> Path:
    return local.with_name(local.name + ".sha256")


def _mirrored_sha256(local: Path) -> str | None:
    note = _sha256_note(local)
    return note.read_text() if note.is_file() else None


def keep_as_mirror(folder: Path, card: dict) -> None:
    """Mark the shards of a local dataset just uploaded from `folder`, its bucket's local mirror, as verified copies
    (what `open_split` on the bucket checks before downloading)."""
    for entry in filter(None, card["splits"].values()):
        for shard in entry["shards"]:
            _sha256_note(folder / shard["file"]).write_text(shard["sha256"])


def _prepared_for(folder, card: dict) -> str:
    """What a dataset was prepared for, in words: its family and the objective flags it was given."""
    if not card.get("for_model"):
        return f"--dataset_dir {folder} is a launcher run's token cache"
    return f"--dataset_dir {folder} was prepared for {card.get('for_model')} {_flags_of(card)}".rstrip()


def _flags_of(card: dict) -> str:
    """The launcher flags a dataset was prepared with ('--line_by_line --packing --max_seq_length 128'): those given,
    not those off, nor the default --document_attention, which every card has."""
    unsaid = lambda k, v: v in (None, False) or (k == DOCUMENT_ATTENTION.name and v == DOCUMENT_ATTENTION.default)
    return " ".join(
        f"--{k}" if v is True else f"--{k} {v}" for k, v in (card.get("objective") or {}).items() if not unsaid(k, v)
    )


def _check_fits(folder, card: dict, tokenizer, record_length: int, mode: str) -> None:
    """Refuse a dataset of another preparation mode, record length or tokenizer than the run's."""
    if card["mode"] != mode:  # first: another mode has another length too (packed_lines), and says why
        given = (
            f"{_flags_of(card) or 'no objective flags'} as it was prepared (--model_type {card['for_model']})"
            if card.get("for_model")
            else "the objective flags of the run that made it"
        )
        raise DataError(
            f"{_prepared_for(folder, card)} ({card['mode']!r} records) but this run's objective needs "
            f"{mode!r} records: pass {given}, or prepare the data again for this objective"
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


def open_dataset(
    dataset_dir: str | os.PathLike, *, tokenizer, record_length: int, mode: str, verify: bool = False
) -> tuple[PreparedSplit, PreparedSplit | None, dict]:
    """(train, validation or None, card) of a dataset directory (`python -m spmdlm.prepare`'s, or a launcher's token
    cache folder).

    Refuses (DataError, one line) a dataset prepared with another tokenizer (sha256 of tokenizer.to_str()), record
    length or preparation mode than the run's, and one whose shards are missing or of the wrong size or record
    count; `verify` also checks every shard's sha256 (reads everything). Every host may call it: it only reads (a
    dataset in a bucket is copied to each host's local disk, verified).
    """
    folder = storage.path(dataset_dir, "--dataset_dir")
    card = read_card(folder)
    _check_fits(folder, card, tokenizer, record_length, mode)
    try:
        train = open_split(folder, card, "train", verify)
        validation = open_split(folder, card, "validation", verify)
    except DamagedDataset as e:
        raise DataError(f"--dataset_dir {folder}: {e}; prepare the dataset again") from None
    if train is None:
        raise DataError(f"--dataset_dir {folder} has no training split; prepare the dataset again")
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


# -- writing a dataset directory (python -m spmdlm.prepare, the launcher's token cache) --------------------------------


def card_head(
    inputs: dict, tokenizer, cut: Cut, *, validation: dict, records_per_shard: int, for_model=None, objective=None
) -> dict:
    """A card's settings: what the records are made from and how (its "key" is added by the writer's caller)."""
    return {
        "format": CARD_FORMAT,
        "version": CARD_VERSION,
        "inputs": inputs,
        "tokenizer": {
            "sha256": tokenizer_hash(tokenizer),
            "vocab_size": tokenizer.get_vocab_size(),
            "dir": TOKENIZER_DIR,
        },
        "for_model": for_model,
        "objective": objective,
        "record_length": cut.record_length,
        "mode": cut.mode,
        "dtype": "int32",
        "separator_id": cut.separator_id,
        "pad_id": cut.pad_id,
        **({"bos_id": cut.bos_id} if cut.mode == "packed_lines" else {}),  # only where records hold it: keys kept
        "validation": validation,
        "records_per_shard": records_per_shard,
    }


def records_per_shard(shard_bytes: int, record_length: int) -> int:
    return max(1, shard_bytes // (4 * record_length))


def write_dataset(
    out,
    head: dict,
    fill: Callable[[Path], dict],
    *,
    tokenizer_copy: Callable[[Path], None],
    unwritable: Callable[[str], Exception],
    replaces: Callable[[Path], bool] | None = None,
    point: str = "dataset.before_swap",
) -> dict:
    """Write the dataset directory `out` whole -> the card `out` then holds. `fill(folder)` writes the shard files
    into a staging directory (storage.staging) and returns the card's "read" and "splits"; then come the tokenizer's
    copy (`tokenizer_copy(dir)`) and the card, and the directory is swapped in (storage.swap_in, `replaces` as there;
    a bucket's card uploaded last). A dataset another writer put in `out` meanwhile is kept: taken when it is this very
    dataset (same key, shards there), else refused (DataError). A failure leaves no dataset that looks complete."""
    with storage.staging(out, unwritable) as tmp:
        card = {**head, **fill(tmp)}
        tokenizer_copy(tmp / TOKENIZER_DIR)
        (tmp / CARD_NAME).write_text(json.dumps(card, indent=2, ensure_ascii=False) + "\n")
        crash_point(point, tmp / CARD_NAME)
        if not storage.swap_in(tmp, out, last=CARD_NAME, replaces=replaces):
            card = _same_or_refuse(out, card)
    return card


def shard_sinks(folder: Path, per_shard: int, splits=("train", "validation")) -> dict[str, RecordShards]:
    """A writer of each split's shard files `SPLIT-00000.tokens`, ... in `folder`."""
    return {
        split: RecordShards(lambda i, split=split: folder / f"{split}-{i:05d}{TOKENS_SUFFIX}", per_shard)
        for split in splits
    }


def split_entry(stats: SplitStats, shards: list[dict]) -> dict:
    """A split's entry in the card: its counts and its shards (file, records, bytes, sha256)."""
    return {
        **stats.card(),
        "shards": [
            {"file": s["path"].name, "records": s["records"], "bytes": s["bytes"], "sha256": s["sha256"]}
            for s in shards
        ],
    }


def _card_text(folder: Path) -> str | None:
    try:
        return (folder / CARD_NAME).read_text()
    except OSError:
        return None


def _card_of(folder) -> dict:
    try:
        return json.loads((folder / CARD_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _describe(card: dict) -> str:
    return (
        f"for {card.get('for_model')}, records of {card.get('record_length')} tokens, key {str(card.get('key'))[:12]}"
    )


def _same_or_refuse(out: Path, card: dict) -> dict:
    """`out` got a dataset from another writer meanwhile: fine when it is the same one (same key, shards there),
    else refused."""
    theirs = _card_of(out)
    if theirs.get("key") == card["key"] and _shards_present(out, theirs):
        log.info("%s was prepared meanwhile by another run with the same inputs and settings; keeping it", out)
        return theirs
    raise DataError(
        f"--out {out} got another dataset ({_describe(theirs)}) from a preparation that ran at the same "
        f"time; this one ({_describe(card)}) was not written over it: choose another --out, or run "
        "again with --overwrite to replace it"
    )


def _shards_present(folder: Path, card: dict) -> bool:
    """Cheap check that a card's shards are all there at their recorded sizes."""
    for entry in (card.get("splits") or {}).values():
        for shard in (entry or {}).get("shards", []):
            path = folder / shard["file"]
            if not path.is_file() or storage.size(path) != shard["bytes"]:
                return False
    return True


# -- preparing a dataset from a corpus (python -m spmdlm.prepare) ------------------------------------------------------


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
    return [CHANGE_NAMES.get(k, k) for k in head if k != "key" and old.get(k) != head[k]] or ["settings"]


@dataclasses.dataclass(frozen=True)
class ForModel:
    """The model a dataset's records serve: its family (its name goes in the card, its tokenizer spec into the copy of
    the tokenizer), the tokenizer that cuts the records (copied beside them, with `model_max_length`) and the
    objective flags the records were prepared for (in the card)."""

    family: Any
    tokenizer: Any
    objective: dict
    model_max_length: int = 1024


def prepare_dataset(
    corpus: Corpus,
    out: str | os.PathLike,
    cut: Cut,
    model: ForModel,
    *,
    workers: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool | None = None,
) -> dict:
    """Prepare `corpus` into the dataset directory `out` as `cut` says (its validation_percentage: the documents held
    out by hash, unless the corpus has a validation split of its own; 0: none) for `model`, and return its card; a
    no-op when `out` already holds the dataset of these inputs and settings. Refuses (DataError) a non-empty `out`
    holding anything else, and a dataset of other inputs or settings unless `overwrite`. `workers` (default: the
    CPUs) changes speed, not the bytes."""
    tokenizer, family = model.tokenizer, model.family
    out = storage.path(out, "--out") if storage.is_url(out) else Path(out).expanduser()
    corpus = _without_out(corpus, out)
    validation = _validation_plan(corpus, cut.validation_percentage)
    head = card_head(
        corpus.manifest(),
        tokenizer,
        cut,
        validation=validation,
        records_per_shard=records_per_shard(shard_bytes, cut.record_length),
        for_model=family.name,
        objective=model.objective,
    )
    head["key"] = _key(head)
    found, seen = _found(out, head, overwrite)
    if found is not None:
        return found
    if validation["from"] != HASH_SPLIT:
        cut = dataclasses.replace(cut, validation_percentage=0.0)
    workers = workers or default_workers()
    return write_dataset(
        out,
        head,
        lambda folder: _write_dataset(corpus, tokenizer, folder, head, cut, workers=workers, progress=progress),
        tokenizer_copy=lambda folder: save_tokenizer(
            tokenizer, folder, family, model_max_length=model.model_max_length
        ),
        unwritable=lambda why: UnwritableDataError(
            f"cannot write the dataset {out}: {why} in {out.parent}; free some space or choose another --out"
        ),
        replaces=lambda old: _card_text(old) == seen,
    )


def _without_out(corpus: Corpus, out) -> Corpus:
    """The corpus without the files inside `out` (a directory input that holds --out: not our own output)."""
    inside = [p for p in corpus.files if p.resolve().is_relative_to(Path(out).resolve())]
    if not inside:
        return corpus
    corpus = dataclasses.replace(corpus, files=tuple(p for p in corpus.files if p not in inside))
    if not corpus.files:
        raise DataError(f"the inputs hold only files of --out {out}; give the corpus")
    return corpus


def _validation_plan(corpus: Corpus, percentage: float) -> dict:
    if percentage <= 0:
        return {"from": "none"}
    if corpus.dataset_name and "validation" in corpus.splits:
        return {"from": OWN_SPLIT}
    return {"from": HASH_SPLIT, "percentage": percentage}


def _found(out, head: dict, overwrite: bool) -> tuple[dict | None, str | None]:
    """(the card of `out` when it already holds this dataset whole, else None; the card text found there, None when
    there is no dataset): what `out` holds is refused unless it is empty, this dataset, or a dataset to overwrite."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return None, None
    if not (out / CARD_NAME).is_file():
        raise DataError(f"--out {out} is not empty and holds no prepared dataset; choose a new or empty --out")
    seen = _card_text(out)
    old = _card_of(out)
    if old.get("key") == head["key"] and _shards_present(out, old):
        log.info("%s is up to date (same inputs and settings): nothing to do", out)
        return old, seen
    if old.get("key") == head["key"]:
        log.warning("%s has missing or damaged shards; preparing it again", out)
    elif not overwrite:
        raise DataError(
            f"--out {out} holds a dataset prepared with other {', '.join(_changes(old, head))}; "
            "pass --overwrite to replace it or choose another --out"
        )
    return None, seen


def _write_dataset(corpus: Corpus, tokenizer, folder: Path, head: dict, cut: Cut, *, workers: int, progress) -> dict:
    """Tokenize the corpus into shard files in `folder`; -> the card's "read" and "splits"."""
    sinks = shard_sinks(folder, head["records_per_shard"])
    stats = ReadStats()
    started = time.perf_counter()
    with _progress(corpus, stats, progress) as on_chunk:
        tokenize = lambda split, into, name=None: tokenize_into(
            corpus.documents(split, stats), tokenizer, into, cut, workers=workers, on_chunk=on_chunk, name=name
        )
        split_stats = tokenize("train", sinks if cut.validation_percentage > 0 else {"train": sinks["train"]})
        if head["validation"]["from"] == OWN_SPLIT:
            split_stats["validation"] = tokenize("validation", {"train": sinks["validation"]}, "validation")["train"]
    elapsed = time.perf_counter() - started
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
    return {"read": stats.card(), "splits": _splits(split_stats, sinks, cut.record_length)}


@contextlib.contextmanager
def _progress(corpus: Corpus, stats: ReadStats, progress: bool | None):
    """A progress bar of the corpus's bytes (or documents), with the tokenizing speed; yields its on_chunk."""
    total = corpus.total_bytes
    bar = progress_bar(
        total, "preparing", unit="B" if total else "doc", disable=None if progress is None else not progress
    )
    started, tokens_seen = time.perf_counter(), [0]

    def on_chunk(documents: int, tokens: int) -> None:
        tokens_seen[0] += tokens
        bar.update((stats.bytes_read - bar.n) if total else documents)
        bar.set_postfix_str(
            f"{tokens_seen[0] / max(1e-9, time.perf_counter() - started) / 1e6:.2f}M tok/s", refresh=False
        )

    with bar:
        yield on_chunk


def _splits(split_stats: dict[str, SplitStats], sinks: dict[str, RecordShards], record_length: int) -> dict:
    """The card's "splits" (None: a split with no record); a training split with no record is refused."""
    shards = {split: sink.close() for split, sink in sinks.items()}
    train = split_stats["train"]
    if train.examples == 0:
        raise DataError(
            f"the training corpus has {train.tokens} tokens in {train.documents} documents, fewer than "
            f"one example of {record_length} tokens; give more text or lower the length"
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
                record_length,
            )
            continue
        splits[split] = split_entry(counts, shards[split])
    return splits
