"""Corpus readers (txt, json/jsonl, csv, the embedded stdlib corpus) and the tokenized ArrayRecord cache.

Preparation tokenizes every document once and writes fixed-length records of `record_length` tokens to an
ArrayRecord file under a cache key made from the documents' content, the tokenizer, the record length and the mode.
The objective says which mode it needs (its `preparation` attribute, "stream" by default):
- "stream": documents joined by the separator (EOS), the stream cut into records (only the last partial one is
  dropped) — CLM, T5, grouped MLM;
- "sentences": the same, with the SENTENCE_END flag bit on the last token of each sentence (BART);
- "lines": one record per document (line), truncated and right-padded with pad_id (MLM --line_by_line).
A second run with the same inputs reuses the file without tokenizing, once its size, sha256 and record count match
the metadata; a damaged cache is rebuilt.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import glob
import hashlib
import itertools
import json
import logging
import os
import re
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
        if "://" in pattern:
            raise DataError(f"{flag} {pattern}: URLs are not read; mount the bucket (e.g. gcsfuse) or copy the data "
                            "to a local disk and pass that path")
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"{flag} {pattern}: no such file; check the path (globs like 'data/*.txt' are allowed)")
        files.extend(Path(m) for m in matches)
    return files


BINARY_PROBE = 8192  # bytes looked at to tell text from binary
MAX_INVALID_SHARE = 0.3  # a text file with more undecodable bytes than this in the probe is taken for binary
# A BOM says the encoding; the UTF-32 ones come first, as the UTF-32 LE BOM begins with the UTF-16 LE one.
BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
    (codecs.BOM_UTF8, "utf-8-sig"),
]
# Bytes that are not UTF-8, as the "surrogateescape" error handler decodes them: one per byte, so they can be counted.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _encoding(path: Path) -> str:
    """The file's encoding from its BOM, else UTF-8; a file that looks binary is refused."""
    with open(path, "rb") as f:
        head = f.read(BINARY_PROBE)
    encoding = next((encoding for bom, encoding in BOMS if head.startswith(bom)), "utf-8")
    if encoding in ("utf-16", "utf-32"):
        return encoding  # UTF-16/32 text is full of NUL bytes: no binary check
    if b"\0" in head:
        raise DataError(f"{path} looks binary (NUL bytes in its first {len(head)} bytes); "
                        "give text files (.txt, .json, .jsonl, .csv)")
    invalid = len(_ESCAPED_BYTE.findall(head.decode("utf-8", errors="surrogateescape")))
    if invalid > MAX_INVALID_SHARE * len(head):
        raise DataError(f"{path} looks binary ({invalid} of its first {len(head)} bytes are not UTF-8); "
                        "give text files (.txt, .json, .jsonl, .csv)")
    return encoding


def _text_lines(path: Path, newline: str | None = None) -> Iterator[str]:
    """The lines of a text file; bytes that are not UTF-8 become U+FFFD, with one warning per file."""
    encoding = _encoding(path)
    # UTF-8 files are read with escapes so the bad bytes can be counted; UTF-16/32 ones are rare enough to replace.
    errors = "replace" if encoding in ("utf-16", "utf-32") else "surrogateescape"
    invalid = 0
    with open(path, encoding=encoding, errors=errors, newline=newline) as f:
        for line in f:
            line, count = _ESCAPED_BYTE.subn("\ufffd", line)
            invalid += count
            yield line
    if invalid:
        log.warning("%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD (convert the file to UTF-8, "
                    "e.g. iconv -f latin1 -t utf-8)", path, invalid)


def _read_txt(path: Path) -> Iterator[str]:
    # One document per line, as the HF `text` builder the reference scripts used; blank lines carry nothing.
    for line in _text_lines(path):
        if line.strip():
            yield line.rstrip("\n")


def _pick_text(record, where: str, text_column: str | None) -> str:
    """The text of one JSON/CSV record: its `text_column` field ("text" by default); a bare value is the text."""
    if not isinstance(record, dict):
        value = record
    else:
        column = text_column or "text"
        if column not in record:
            fields = ", ".join(str(k) for k in list(record)[:10]) + (", ..." if len(record) > 10 else "")
            raise DataError(f"{where} has no {column!r} field; pass --text_column NAME, NAME one of its fields: "
                            f"{fields or 'none'}")
        value = record[column]
    return "" if value is None else str(value)


def _texts(located: Iterable[tuple[str, object]], text_column: str | None) -> Iterator[str]:
    """The non-empty texts of (where, record) pairs, `where` being the file:line an error names."""
    for where, record in located:
        text = _pick_text(record, where, text_column)
        if text.strip():
            yield text


def _read_json(path: Path, text_column: str | None) -> Iterator[str]:
    lines = enumerate(_text_lines(path), start=1)
    for number, line in lines:
        if line.strip():
            break
    else:
        return
    if line.lstrip().startswith("["):  # one JSON array of records
        try:
            records = json.loads(line + "".join(rest for _, rest in lines))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not JSON ({e}); fix the file or convert it to .txt") from None
        yield from _texts(((f"{path} record {i}", r) for i, r in enumerate(records)), text_column)
    else:
        yield from _texts(_json_lines(path, itertools.chain([(number, line)], lines)), text_column)


def _json_lines(path: Path, lines: Iterable[tuple[int, str]]) -> Iterator[tuple[str, object]]:
    for number, line in lines:
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not JSON lines ({e}); fix the line or convert the file to .txt") \
                    from None
            yield f"{path}:{number}", record


def _read_csv(path: Path, text_column: str | None) -> Iterator[str]:
    reader = csv.DictReader(_text_lines(path, newline=""), delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    # line_num is the source line where the row ends, the one an editor shows.
    yield from _texts(((f"{path}:{reader.line_num}", row) for row in reader), text_column)


def read_documents(files: Iterable[Path], *, text_column: str | None = None) -> Iterator[str]:
    """The non-empty documents of the files: a line of text, or the `text_column` ("text") field of a record."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in JSON_SUFFIXES:
            yield from _read_json(path, text_column)
        elif suffix in CSV_SUFFIXES:
            yield from _read_csv(path, text_column)
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


class _DamagedCache(Exception):
    """A cached split whose metadata or data file does not check out; the message says what."""


CACHE_META_KEYS = ("num_records", "num_tokens", "bytes", "sha256")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verified_meta(data_path: Path, meta_path: Path) -> dict:
    """The metadata of a cached split once its data file matches it (size, hash, record count)."""
    import grain

    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise _DamagedCache(f"{meta_path.name} is unreadable: {e}") from None
    missing = [key for key in CACHE_META_KEYS if key not in meta] if isinstance(meta, dict) else CACHE_META_KEYS
    if missing:  # older caches did not record the size and hash
        raise _DamagedCache(f"{meta_path.name} lacks {', '.join(missing)}")
    if not data_path.is_file():
        raise _DamagedCache(f"{data_path.name} is missing")
    if (size := data_path.stat().st_size) != meta["bytes"]:
        raise _DamagedCache(f"{data_path.name} has {size} bytes, {meta['bytes']} expected")
    if _sha256(data_path) != meta["sha256"]:
        raise _DamagedCache(f"{data_path.name} does not match its sha256")
    try:
        num_records = len(grain.sources.ArrayRecordDataSource([str(data_path)]))
    except (RuntimeError, OSError) as e:  # what the ArrayRecord reader raises on a truncated or corrupt file
        first_line = str(e).partition("\n")[0] or type(e).__name__  # a truncated file raises an empty message
        raise _DamagedCache(f"{data_path.name} does not open: {first_line}") from None
    if num_records != meta["num_records"]:
        raise _DamagedCache(f"{data_path.name} has {num_records} records, {meta['num_records']} expected")
    return meta


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _remove_stale_temps(folder: Path, name: str, host: str) -> None:
    """Remove the temp files of killed preparations of this split on this host; a running one keeps its own."""
    for path in folder.glob(f"{glob.escape(name)}.*.tmp-{glob.escape(host)}-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            log.info("removing %s, left by an interrupted preparation", path)
            path.unlink(missing_ok=True)


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
    data_path, meta_path = folder / f"{name}.array_record", folder / f"{name}.json"
    if meta_path.exists() and not overwrite_cache:
        try:
            meta = _verified_meta(data_path, meta_path)
        except _DamagedCache as e:
            log.warning("the tokenized %s cache %s is damaged (%s); rebuilding it", name, folder, e)
        else:
            log.info("reusing the tokenized %s cache %s (%d records, %d tokens)", name, folder, meta["num_records"],
                     meta["num_tokens"])
            return PreparedSplit(data_path, meta["num_records"], meta["num_tokens"], record_length)

    host = socket.gethostname()
    tmp_suffix = f".tmp-{host}-{os.getpid()}"  # unique on shared filesystems
    tmp = data_path.with_name(data_path.name + tmp_suffix)
    try:  # up front: the ArrayRecord writer's own error would not say which folder
        folder.mkdir(parents=True, exist_ok=True)
        tmp.touch()
    except OSError as e:
        raise DataError(f"cannot write the token cache in {folder}: {e.strerror or e}; pass a writable --cache_dir") \
            from None
    _remove_stale_temps(folder, name, host)
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
    meta = {"num_records": num_records, "num_tokens": num_tokens, "record_length": record_length,
            "documents": len(documents), "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
    # Each file by an atomic rename, the metadata last: a cache is never seen half-written.
    os.replace(tmp, data_path)
    meta_tmp = meta_path.with_name(meta_path.name + tmp_suffix)
    meta_tmp.write_text(json.dumps(meta))
    os.replace(meta_tmp, meta_path)
    log.info("tokenized %d %s documents into %d records of %d tokens (%s)", len(documents), name, num_records,
             record_length, folder)
    return PreparedSplit(data_path, num_records, num_tokens, record_length)


def record_source(split: PreparedSplit):
    """A random-access Grain source over the records of a prepared split."""
    import grain

    return grain.sources.ArrayRecordDataSource([str(split.path)])


def decode_record(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32)
