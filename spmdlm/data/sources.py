"""Corpus readers (txt, json/jsonl, csv, the embedded stdlib corpus) and the tokenized ArrayRecord cache.

Preparation tokenizes every document once and writes fixed-length records of `record_length` tokens to an
ArrayRecord file under a cache key made from the documents' content, the tokenizer, the record length and the mode.
The objective says which mode it needs (its `preparation` attribute, "stream" by default):
- "stream": documents joined by the separator (EOS), the stream cut into records (only the last partial one is
  dropped) — CLM, T5, grouped MLM;
- "sentences": the same, with the SENTENCE_END flag bit on the last token of each sentence (BART);
- "lines": one record per document (line), truncated and right-padded with pad_id (MLM --line_by_line).
A second run with the same inputs reuses the file without tokenizing.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import hashlib
import json
import logging
import os
import socket
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from spmdlm.data.objectives.denoising import SENTENCE_END
from spmdlm.data.sentences import mark_sentence_ends, sentence_ends

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".text", ".md", ".py"}
JSON_SUFFIXES = {".json", ".jsonl"}
CSV_SUFFIXES = {".csv", ".tsv"}
TOKENIZE_BATCH = 512  # documents per tokenizer call: parallel in Rust, bounded memory


class DataError(ValueError):
    """Input data that cannot be used: missing files, empty corpora, unreadable formats."""


# -- reading documents ---------------------------------------------------------------------------------------------


def expand_files(patterns: str | Iterable[str], flag: str = "--train_file") -> list[Path]:
    """Expand comma-separated paths or globs in a stable order; every pattern must match a file."""
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()]
    files: list[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern.strip())
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"{flag} {pattern}: no such file; check the path (globs like 'data/*.txt' are allowed)")
        files.extend(Path(m) for m in matches)
    return files


def _read_txt(path: Path) -> Iterator[str]:
    # One document per line, as the HF `text` builder the reference scripts used; blank lines carry nothing.
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\n")


def _pick_text(record: dict, path: Path) -> str:
    if "text" in record:
        return str(record["text"])
    if not record:
        raise DataError(f"{path}: a record has no fields; give each record a 'text' field")
    return str(next(iter(record.values())))


def _read_json(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1)
        while head.isspace():
            head = f.read(1)
        f.seek(0)
        first_record = True
        try:
            if head == "[":
                records = json.load(f)
            else:
                records = (json.loads(line) for line in f if line.strip())
            for record in records:
                if first_record and isinstance(record, dict) and record and "text" not in record:
                    log.warning("%s has no 'text' field; using its first field %r", path, next(iter(record)))
                first_record = False
                yield _pick_text(record, path) if isinstance(record, dict) else str(record)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not JSON or JSON lines ({e}); fix the file or convert it to .txt") from None


def _read_csv(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        if reader.fieldnames and "text" not in reader.fieldnames:
            log.warning("%s has no 'text' column; using its first column %r", path, reader.fieldnames[0])
        for row in reader:
            yield _pick_text(row, path)


def read_documents(files: Iterable[Path]) -> Iterator[str]:
    for path in files:
        suffix = path.suffix.lower()
        if suffix in JSON_SUFFIXES:
            yield from _read_json(path)
        elif suffix in CSV_SUFFIXES:
            yield from _read_csv(path)
        elif suffix in TEXT_SUFFIXES or suffix == "":
            yield from _read_txt(path)
        else:
            raise DataError(f"{path}: unknown file type {suffix!r}; use .txt, .json, .jsonl or .csv")


def embedded_corpus_files() -> list[Path]:
    """The running interpreter's standard library sources (no tests, no site-packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def read_embedded_corpus() -> Iterator[str]:
    """Each standard-library module is one document."""
    for path in embedded_corpus_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def in_validation_split(document: str, percentage: float) -> bool:
    """Held-out split by document hash: stable whatever the file order or the number of documents."""
    digest = int.from_bytes(hashlib.blake2b(document.encode("utf-8"), digest_size=8).digest(), "big")
    return (digest % 10_000) < percentage * 100


# -- tokenized cache -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
    path: Path  # the ArrayRecord file
    num_records: int
    num_tokens: int
    record_length: int


def _writer(path: Path):
    from array_record.python.array_record_module import ArrayRecordWriter

    return ArrayRecordWriter(str(path), "group_size:1")


def prepare_split(
    documents: Iterable[str],
    tokenizer,
    *,
    record_length: int,
    separator_id: int,
    cache_dir: Path,
    name: str,
    overwrite_cache: bool = False,
    mode: str = "stream",
    pad_id: int | None = None,
) -> PreparedSplit:
    """Tokenize `documents` into fixed-length records, or reuse the cached file for the same content."""
    if mode not in ("stream", "sentences", "lines") or (mode == "lines" and pad_id is None):
        raise ValueError(f"preparation mode {mode!r} (pad_id {pad_id}) is not one of stream, sentences, lines+pad_id")
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    content = hashlib.sha256()
    for doc in documents:
        content.update(hashlib.sha256(doc.encode("utf-8")).digest())
    key = hashlib.sha256(
        b"|".join([content.digest(), tokenizer.to_str().encode(), str(record_length).encode(),
                   str(separator_id).encode(), f"{mode}:{pad_id}".encode()])
    ).hexdigest()[:24]
    folder = Path(cache_dir) / key
    meta_path = folder / f"{name}.json"
    if meta_path.exists() and not overwrite_cache:
        meta = json.loads(meta_path.read_text())
        log.info("reusing the tokenized %s cache %s (%d records, %d tokens)", name, folder, meta["num_records"],
                 meta["num_tokens"])
        return PreparedSplit(folder / f"{name}.array_record", meta["num_records"], meta["num_tokens"], record_length)

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{name}.array_record.tmp-{socket.gethostname()}-{os.getpid()}"  # unique on shared filesystems
    writer = _writer(tmp)
    carry = np.zeros(0, dtype=np.int32)
    num_records = num_tokens = 0
    for start in range(0, len(documents), TOKENIZE_BATCH):
        batch = documents[start:start + TOKENIZE_BATCH]
        encoded = tokenizer.encode_batch(batch, add_special_tokens=False)
        if mode == "lines":
            for enc in encoded:
                ids = np.asarray(enc.ids[:record_length], dtype=np.int32)
                if len(ids):
                    writer.write(np.pad(ids, (0, record_length - len(ids)), constant_values=pad_id).tobytes())
                    num_records += 1
                    num_tokens += len(ids)
            continue
        pieces = [carry]
        for doc, enc in zip(batch, encoded):
            ids = np.asarray(enc.ids, dtype=np.int32)
            if mode == "sentences":
                ids = ids | np.where(mark_sentence_ends(enc.offsets, sentence_ends(doc)), SENTENCE_END, 0).astype(np.int32)
            pieces.append(ids)
            pieces.append(np.array([separator_id], dtype=np.int32))
        stream = np.concatenate(pieces)
        num_tokens += len(stream) - len(carry)
        whole = len(stream) // record_length
        for row in stream[: whole * record_length].reshape(whole, record_length):
            writer.write(row.tobytes())
        num_records += whole
        carry = stream[whole * record_length:]
    writer.close()
    if num_records == 0:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"the {name} corpus has {num_tokens} tokens, fewer than one example of {record_length}; "
            "give more text or lower --block_size/--max_seq_length"
        )
    os.replace(tmp, folder / f"{name}.array_record")
    meta_path.write_text(json.dumps({"num_records": num_records, "num_tokens": num_tokens,
                                     "record_length": record_length, "documents": len(documents)}))
    log.info("tokenized %d %s documents into %d records of %d tokens (%s)", len(documents), name, num_records,
             record_length, folder)
    return PreparedSplit(folder / f"{name}.array_record", num_records, num_tokens, record_length)


def record_source(split: PreparedSplit):
    """A random-access Grain source over the records of a prepared split."""
    import grain

    return grain.sources.ArrayRecordDataSource([str(split.path)])


def decode_record(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32)
