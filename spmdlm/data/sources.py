"""Corpus readers, the one preparation path (documents -> fixed-length token records in ArrayRecord files), the
launcher's token cache and prepared dataset directories (docs/data.md).

Readers: txt (one document per line), json/jsonl/csv/tsv (a text field), parquet (pyarrow), each plain or
compressed (.gz, .zst), and Hugging Face `datasets` (local `save_to_disk` dirs, parquet dirs, Hub names).

Preparation (`tokenize_into`) tokenizes documents in chunks, in-process or in N spawned worker processes, and the
parent cuts and writes the records in input order, so the output is the same bytes whatever the worker count.
Records are `record_length` int32 tokens; the objective says which mode it needs (its `preparation` attribute,
"stream" by default):
- "stream": documents joined by the separator (EOS), the stream cut into records (only the last partial one is
  dropped) — CLM, T5, grouped MLM;
- "sentences": the same, with the SENTENCE_END flag bit on the last token of each sentence (BART);
- "lines": one record per document (line), truncated and right-padded with pad_id (MLM --line_by_line).

Two users of that path:
- `prepare_split`, the launcher's `--train_file` cache: one file per split under a key made from the documents'
  content, the tokenizer, the record length and the mode; a second run reuses the file once its size, sha256 and
  record count match the metadata; a damaged cache is rebuilt.
- `spmdlm.prepare` (python -m spmdlm.prepare): a dataset directory of sharded splits and a `dataset.json` card,
  opened for training with `open_dataset`, which refuses a dataset of another tokenizer, record length or mode.

Buckets (gs://, spmdlm/storage.py): input files are read through gcsfs as they are (streamed); a token cache
(`--cache_dir gs://...`) or a prepared dataset (`--dataset_dir gs://...`) is copied once to each host's local disk
(storage.local_mirror, verified by size and sha256, reused while it matches) and read there by Grain's ArrayRecord
reader, which reads local files only.
"""

from __future__ import annotations

import codecs
import collections
import csv
import dataclasses
import glob
import gzip
import hashlib
import io
import itertools
import json
import logging
import os
import re
import socket
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from spmdlm import storage
from spmdlm.data.objectives.denoising import SENTENCE_END
from spmdlm.data.sentences import mark_sentence_ends, sentence_ends

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".text", ".md", ".py"}
JSON_SUFFIXES = {".json", ".jsonl"}
CSV_SUFFIXES = {".csv", ".tsv"}
PARQUET_SUFFIXES = {".parquet"}
COMPRESSION_SUFFIXES = {".gz", ".zst"}
TOKENIZE_BATCH = 512  # documents per tokenizer call: parallel in Rust, bounded memory
CHUNK_CHARS = 1 << 20  # ... and at most about this many characters per call (long documents)
DATASETS_HINT = "pip install 'spmdlm[datasets]'"


class DataError(ValueError):
    """Input data that cannot be used: missing files, empty corpora, unreadable formats."""


@dataclasses.dataclass
class ReadStats:
    """What reading skipped or repaired, for the dataset card and the summary line."""

    files: int = 0
    documents: int = 0
    invalid_bytes: int = 0  # bytes that were not UTF-8, replaced by U+FFFD
    empty_lines: int = 0  # blank lines, and records whose text is empty or only whitespace
    empty_files: int = 0  # files that held no document
    bytes_done: int = 0  # input bytes of the files read to the end (for progress)
    _current: object = dataclasses.field(default=None, repr=False)  # the raw file being read

    @property
    def bytes_read(self) -> int:
        """Input bytes read so far (compressed bytes for compressed files)."""
        current = self._current
        try:
            return self.bytes_done + (current.tell() if current is not None and not current.closed else 0)
        except (OSError, ValueError):
            return self.bytes_done

    def card(self) -> dict:
        return {"files": self.files, "documents": self.documents, "invalid_utf8_bytes_replaced": self.invalid_bytes,
                "empty_lines_skipped": self.empty_lines, "empty_files_skipped": self.empty_files}


# -- finding input files ---------------------------------------------------------------------------------------------


def _formats(path: Path) -> tuple[str, str | None]:
    """(format suffix, compression suffix or None): 'a.jsonl.gz' -> ('.jsonl', '.gz'), 'a.gz' -> ('', '.gz')."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES else None
    return (suffixes[-1] if suffixes else ""), compression


def _readable(path: Path) -> bool:
    """A file a directory input contributes: a known format, plain or compressed, not hidden."""
    fmt, _ = _formats(path)
    return not path.name.startswith(".") and fmt in TEXT_SUFFIXES | JSON_SUFFIXES | CSV_SUFFIXES | PARQUET_SUFFIXES


def _directory_files(folder: Path) -> list[Path]:
    if storage.is_remote(folder):  # every object under the prefix; hidden names (at any level) skipped
        inside = lambda p: str(p)[len(str(folder)):].strip("/").split("/")
        return [p for p in storage.files_under(folder)
                if _readable(p) and not any(part.startswith(".") for part in inside(p))]
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root) / name for name in sorted(names) if _readable(Path(root) / name))
    return found


def expand_files(patterns: str | Iterable[str], flag: str = "--train_file") -> list[Path]:
    """Expand comma-separated paths, globs or directories in a stable order; every one must give a file.

    A directory gives the files of known formats under it (recursively, hidden ones skipped, sorted by path).
    All missing inputs are listed in one error.
    """
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()]
    files: list[Path] = []
    missing: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern).strip())
        if storage.is_url(pattern):
            storage.path(pattern, flag)  # gs:// only, in a bucket that exists
        if glob.has_magic(pattern):
            matches = storage.glob(pattern) if storage.is_url(pattern) else sorted(glob.glob(pattern, recursive=True))
        else:
            matches = [pattern]
        found: list[Path] = []
        for match in (storage.path(m, flag) for m in matches):
            if match.is_file():
                found.append(match)
            elif match.is_dir():
                found.extend(_directory_files(match))
        if not found:
            missing.append(pattern)
        files.extend(found)
    if len(missing) == 1:
        raise DataError(f"{flag} {missing[0]}: no such file; check the path (globs like 'data/*.txt' are allowed)")
    if missing:
        raise DataError(f"{flag}: no such files: {', '.join(missing)}; check the paths (globs like 'data/*.txt' "
                        "are allowed)")
    return files


expand_inputs = expand_files


# -- reading documents ---------------------------------------------------------------------------------------------

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


def _open_binary(path: Path):
    """(raw file, readable binary stream): .gz through gzip, .zst through zstandard, else the file itself."""
    _, compression = _formats(path)
    if compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs zstandard: pip install zstandard (or "
                            f"{DATASETS_HINT})") from None
    raw = path.open("rb")  # a local file, or a gs:// object read through gcsfs
    if compression == ".gz":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == ".zst":
        return raw, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw, raw


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _bad_compressed(path: Path, e: BaseException) -> DataError:
    return DataError(f"{path}: cannot decompress ({str(e).partition(chr(10))[0] or type(e).__name__}); "
                     "the file is truncated or not what its suffix says")


def _encoding(path: Path) -> str:
    """The file's encoding from its BOM, else UTF-8; a file that looks binary is refused."""
    raw, f = _open_binary(path)
    try:
        with raw, f:
            head = f.read(BINARY_PROBE)
    except _decompression_errors() as e:
        raise _bad_compressed(path, e) from None
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


def _text_lines(path: Path, newline: str | None = None, stats: ReadStats | None = None) -> Iterator[str]:
    """The lines of a text file; bytes that are not UTF-8 become U+FFFD, with one warning per file."""
    encoding = _encoding(path)
    # UTF-8 files are read with escapes so the bad bytes can be counted; UTF-16/32 ones are rare enough to replace.
    errors = "replace" if encoding in ("utf-16", "utf-32") else "surrogateescape"
    invalid = 0
    raw, binary = _open_binary(path)
    if stats is not None:
        stats._current = raw
    try:
        with raw, binary, io.TextIOWrapper(binary, encoding=encoding, errors=errors, newline=newline) as f:
            for line in f:
                line, count = _ESCAPED_BYTE.subn("\ufffd", line)
                invalid += count
                yield line
    except _decompression_errors() as e:
        raise _bad_compressed(path, e) from None
    finally:
        if stats is not None:
            stats._current = None
            stats.invalid_bytes += invalid
    if invalid:
        log.warning("%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD (convert the file to UTF-8, "
                    "e.g. iconv -f latin1 -t utf-8)", path, invalid)


def _read_txt(path: Path, stats: ReadStats) -> Iterator[str]:
    # One document per line, as the HF `text` builder the reference scripts used; blank lines carry nothing.
    for line in _text_lines(path, stats=stats):
        if line.strip():
            yield line.rstrip("\n")
        else:
            stats.empty_lines += 1


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


def _texts(located: Iterable[tuple[str, object]], text_column: str | None, stats: ReadStats) -> Iterator[str]:
    """The non-empty texts of (where, record) pairs, `where` being the file:line an error names."""
    for where, record in located:
        text = _pick_text(record, where, text_column)
        if text.strip():
            yield text
        else:
            stats.empty_lines += 1


def _read_json(path: Path, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    lines = enumerate(_text_lines(path, stats=stats), start=1)
    for number, line in lines:
        if line.strip():
            break
        stats.empty_lines += 1
    else:
        return
    if line.lstrip().startswith("["):  # one JSON array of records
        try:
            records = json.loads(line + "".join(rest for _, rest in lines))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not JSON ({e}); fix the file or convert it to .txt") from None
        yield from _texts(((f"{path} record {i}", r) for i, r in enumerate(records)), text_column, stats)
    else:
        yield from _texts(_json_lines(path, itertools.chain([(number, line)], lines), stats), text_column, stats)


def _json_lines(path: Path, lines: Iterable[tuple[int, str]], stats: ReadStats) -> Iterator[tuple[str, object]]:
    for number, line in lines:
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not JSON lines ({e}); fix the line or convert the file to .txt") \
                    from None
            yield f"{path}:{number}", record
        else:
            stats.empty_lines += 1


def _read_csv(path: Path, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    fmt, _ = _formats(path)
    reader = csv.DictReader(_text_lines(path, newline="", stats=stats), delimiter="\t" if fmt == ".tsv" else ",")
    # line_num is the source line where the row ends, the one an editor shows.
    yield from _texts(((f"{path}:{reader.line_num}", row) for row in reader), text_column, stats)


def _read_parquet(path: Path, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: {DATASETS_HINT}") from None
    if _formats(path)[1]:
        raise DataError(f"{path}: compressed parquet is not read (parquet compresses itself); decompress it")
    try:
        parquet = pq.ParquetFile(path.open("rb") if storage.is_remote(path) else path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a parquet file ({str(e).partition(chr(10))[0]})") from None
    column = text_column or "text"
    names = parquet.schema_arrow.names
    if column not in names:
        fields = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise DataError(f"{path} has no {column!r} column; pass --text_column NAME, NAME one of its columns: "
                        f"{fields or 'none'}")
    for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
        for value in batch.column(0).to_pylist():
            text = "" if value is None else str(value)
            if text.strip():
                yield text
            else:
                stats.empty_lines += 1


def read_documents(files: Iterable[Path], *, text_column: str | None = None,
                   stats: ReadStats | None = None) -> Iterator[str]:
    """The non-empty documents of the files: a line of text, or the `text_column` ("text") field of a record.

    `stats`, if given, counts the files, documents, replaced bytes and skipped empty lines and files.
    """
    stats = stats if stats is not None else ReadStats()
    for path in files:
        fmt, _ = _formats(path)
        if fmt in JSON_SUFFIXES:
            documents = _read_json(path, text_column, stats)
        elif fmt in CSV_SUFFIXES:
            documents = _read_csv(path, text_column, stats)
        elif fmt in PARQUET_SUFFIXES:
            documents = _read_parquet(path, text_column, stats)
        elif fmt in TEXT_SUFFIXES or fmt == "":
            documents = _read_txt(path, stats)
        else:
            raise DataError(f"{path}: unknown file type {fmt!r}; use .txt, .json, .jsonl, .csv or .parquet "
                            "(optionally .gz or .zst)")
        stats.files += 1
        count = 0
        for document in documents:
            count += 1
            stats.documents += 1
            yield document
        stats.bytes_done += storage.size(path)
        if not count:
            stats.empty_files += 1
            log.warning("%s holds no text; skipped", path)


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


# -- Hugging Face datasets -----------------------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                       and (path / "dataset_info.json").is_file())


def load_hf_dataset(name: str, config_name: str | None = None) -> dict:
    """{split: dataset} of a `datasets` dataset: a save_to_disk dir (memory-mapped), a parquet file or a dir of data
    files, or a Hub name (streaming). Without the datasets library: a one-line DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"--dataset_name needs the datasets library: {DATASETS_HINT}") from None
    path = Path(name).expanduser()
    if not path.exists() and name.startswith(("/", "./", "../", "~")):
        raise DataError(f"--dataset_name {name}: no such file or directory")
    try:
        if path.is_dir() and _is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.Dataset):
                return {"train": loaded}
        elif path.is_file():
            fmt = _formats(path)[0].lstrip(".")
            builder = {"jsonl": "json", "txt": "text", "tsv": "csv"}.get(fmt, fmt)
            loaded = datasets.load_dataset(builder, data_files={"train": str(path)}, streaming=True)
        else:
            loaded = datasets.load_dataset(str(path) if path.is_dir() else name, config_name, streaming=True)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ConnectionError...)
        first = str(e).strip().partition("\n")[0] or type(e).__name__
        raise DataError(f"--dataset_name {name}: {first}") from None
    return {split: loaded[split] for split in loaded}


def _hf_texts(dataset, name: str, split: str, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    column = text_column or "text"
    names = dataset.column_names
    if names is not None and column not in names:
        raise DataError(f"--dataset_name {name} split {split} has no {column!r} column; pass --text_column NAME, "
                        f"NAME one of its columns: {', '.join(names[:10]) or 'none'}")
    if hasattr(dataset, "iter") and hasattr(dataset, "__len__"):  # map-style (memory-mapped): column batches
        rows = (value for batch in dataset.select_columns([column]).iter(batch_size=1000) for value in batch[column])
    else:
        rows = (record.get(column, KeyError) for record in dataset)
    for value in rows:
        if value is KeyError:
            raise DataError(f"--dataset_name {name} split {split}: a record has no {column!r} field; pass "
                            "--text_column NAME")
        text = "" if value is None else str(value)
        if text.strip():
            stats.documents += 1
            yield text
        else:
            stats.empty_lines += 1


# -- a corpus: files or a dataset --------------------------------------------------------------------------------------

SAMPLE_BYTES = 1 << 16  # the manifest hashes up to this many bytes at the start, middle and end of each file


def _file_entry(path: Path) -> dict:
    size = storage.size(path)
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return {"path": str(path) if storage.is_remote(path) else str(path.resolve()), "bytes": size,
            "mtime_ns": storage.mtime_ns(path), "sample_blake2b": digest.hexdigest()}


@dataclasses.dataclass
class Corpus:
    """Documents from files (txt/json/jsonl/csv/parquet, plain, .gz or .zst) or from a `datasets` dataset."""

    files: tuple[Path, ...] = ()
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    text_column: str | None = None
    _loaded: dict | None = dataclasses.field(default=None, repr=False)

    def _dataset(self) -> dict:
        if self._loaded is None:
            self._loaded = load_hf_dataset(self.dataset_name, self.dataset_config_name)
        return self._loaded

    @property
    def splits(self) -> tuple[str, ...]:
        """The split names: ("train",) for files; the dataset's own for a dataset."""
        return tuple(self._dataset()) if self.dataset_name else ("train",)

    def documents(self, split: str = "train", stats: ReadStats | None = None) -> Iterator[str]:
        stats = stats if stats is not None else ReadStats()
        if not self.dataset_name:
            return read_documents(self.files, text_column=self.text_column, stats=stats)
        loaded = self._dataset()
        if split not in loaded:
            raise DataError(f"--dataset_name {self.dataset_name} has no {split!r} split (it has "
                            f"{', '.join(loaded) or 'none'})")
        return _hf_texts(loaded[split], self.dataset_name, split, self.text_column, stats)

    @property
    def total_bytes(self) -> int | None:
        return sum(storage.size(p) for p in self.files) if self.files else None

    def manifest(self) -> dict:
        """What the inputs are, cheaply: each file's path, size, mtime and a hash of samples of it (a local dataset
        dir lists its files; a Hub dataset is named only)."""
        if not self.dataset_name:
            return {"files": [_file_entry(p) for p in self.files], "text_column": self.text_column}
        path = Path(self.dataset_name).expanduser()
        files = ([path] if path.is_file() else
                 sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir()
                 else [])
        return {"dataset_name": str(path.resolve()) if path.exists() else self.dataset_name,
                "dataset_config_name": self.dataset_config_name, "files": [_file_entry(p) for p in files],
                "text_column": self.text_column}


def open_corpus(inputs: Sequence[str] = (), *, dataset_name: str | None = None,
                dataset_config_name: str | None = None, text_column: str | None = None,
                flag: str = "INPUTS") -> Corpus:
    """The corpus of `inputs` (files, globs, directories) or of `--dataset_name`; missing inputs in one error."""
    if inputs and dataset_name:
        raise DataError("give input files or --dataset_name, not both")
    if dataset_name:
        if "://" in dataset_name:
            raise DataError(f"--dataset_name {dataset_name}: URLs are not read; give a Hub name or a local path")
        return Corpus(dataset_name=dataset_name, dataset_config_name=dataset_config_name, text_column=text_column)
    if dataset_config_name:
        raise DataError("--dataset_config_name needs --dataset_name")
    if not inputs:
        raise DataError(f"no input: give {flag} (files, globs or directories) or --dataset_name")
    return Corpus(files=tuple(expand_files(inputs, flag)), text_column=text_column)


# -- preparation: documents -> fixed-length records ------------------------------------------------------------------

MODES = ("stream", "sentences", "lines")


@dataclasses.dataclass(frozen=True)
class Cut:
    """How documents become records (see the module docstring)."""

    record_length: int
    separator_id: int
    mode: str = "stream"
    pad_id: int | None = None
    validation_percentage: float = 0.0  # > 0: documents whose hash falls in it go to the "validation" split

    def __post_init__(self):
        if self.mode not in MODES or (self.mode == "lines" and self.pad_id is None):
            raise ValueError(f"preparation mode {self.mode!r} (pad_id {self.pad_id}) is not one of stream, "
                             "sentences, lines+pad_id")
        if self.record_length < 1:
            raise ValueError(f"record_length {self.record_length} must be positive")


@dataclasses.dataclass
class SplitStats:
    documents: int = 0
    tokens: int = 0  # tokens in the prepared stream, separators included (lines: after truncation)
    examples: int = 0
    tokens_dropped: int = 0  # the last partial record (stream), the truncated tails (lines)

    def card(self) -> dict:
        return dataclasses.asdict(self)


def _tokenize_chunk(tokenizer, documents: list[str], cut: Cut) -> dict[str, tuple]:
    """{split: (array, documents, tokens, dropped)} of one chunk: for stream modes the token stream (each document
    then the separator), for "lines" the (n, record_length) records. Pure: the same for any process."""
    encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
    held_out = ([in_validation_split(doc, cut.validation_percentage) for doc in documents]
                if cut.validation_percentage > 0 else [False] * len(documents))
    out = {}
    for split, wanted in (("train", False), ("validation", True)):
        picked = [(doc, enc) for doc, enc, held in zip(documents, encoded, held_out) if held is wanted]
        if not picked:
            continue
        if cut.mode == "lines":
            rows, tokens, dropped = [], 0, 0
            for _, enc in picked:
                ids = np.asarray(enc.ids[: cut.record_length], dtype=np.int32)
                dropped += max(0, len(enc.ids) - cut.record_length)
                if len(ids):
                    rows.append(np.pad(ids, (0, cut.record_length - len(ids)), constant_values=cut.pad_id))
                    tokens += len(ids)
            array = np.stack(rows) if rows else np.zeros((0, cut.record_length), dtype=np.int32)
            out[split] = (array, len(picked), tokens, dropped)
            continue
        pieces = []
        separator = np.array([cut.separator_id], dtype=np.int32)
        for doc, enc in picked:
            ids = np.asarray(enc.ids, dtype=np.int32)
            if cut.mode == "sentences":
                flags = mark_sentence_ends(enc.offsets, sentence_ends(doc))
                ids = ids | np.where(flags, SENTENCE_END, 0).astype(np.int32)
            pieces += [ids, separator]
        stream = np.concatenate(pieces)
        out[split] = (stream, len(picked), len(stream), 0)
    return out


_WORKER: dict = {}  # a worker process's tokenizer and cut


def _worker_init(tokenizer_json: str, cut: Cut) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the processes are the parallelism
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), cut=cut)


def _worker_tokenize(documents: list[str]) -> dict[str, tuple]:
    return _tokenize_chunk(_WORKER["tokenizer"], documents, _WORKER["cut"])


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= TOKENIZE_BATCH or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _writer(path: Path):
    from array_record.python.array_record_module import ArrayRecordWriter

    return ArrayRecordWriter(str(path), "group_size:1")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class RecordShards:
    """Writes (n, record_length) int32 rows as ArrayRecord files `path_of(0)`, `path_of(1)`, ... of at most
    `records_per_shard` records each (None: one file). A split with no records writes no file."""

    def __init__(self, path_of: Callable[[int], Path], records_per_shard: int | None = None):
        self.path_of, self.records_per_shard = path_of, records_per_shard
        self.shards: list[dict] = []  # closed shards: {"path", "records"}
        self._writer, self._path, self._count = None, None, 0

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        for row in rows:
            if self._writer is None:
                self._path = self.path_of(len(self.shards))
                self._writer, self._count = _writer(self._path), 0
            self._writer.write(row.tobytes())
            self._count += 1
            if self.records_per_shard and self._count >= self.records_per_shard:
                self._close_shard()

    def _close_shard(self) -> None:
        self._writer.close()
        self.shards.append({"path": self._path, "records": self._count})
        self._writer = None

    def close(self) -> list[dict]:
        """The shards written: path, records, bytes, sha256."""
        if self._writer is not None:
            self._close_shard()
        for shard in self.shards:
            shard.update(bytes=shard["path"].stat().st_size, sha256=_sha256(shard["path"]))
        return self.shards

    def abort(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - already failing; the caller removes the files
                pass
            self._writer = None


class _Cutter:
    """Cuts one split's token stream into records, in arrival order."""

    def __init__(self, cut: Cut, sink: RecordShards):
        self.cut, self.sink, self.stats = cut, sink, SplitStats()
        self.carry = np.zeros(0, dtype=np.int32)

    def add(self, array: np.ndarray, documents: int, tokens: int, dropped: int) -> None:
        self.stats.documents += documents
        self.stats.tokens += tokens
        self.stats.tokens_dropped += dropped
        if self.cut.mode == "lines":
            self.sink.write(array)
            self.stats.examples += len(array)
            return
        stream = np.concatenate([self.carry, array]) if len(self.carry) else array
        whole = len(stream) // self.cut.record_length
        self.sink.write(stream[: whole * self.cut.record_length].reshape(whole, self.cut.record_length))
        self.stats.examples += whole
        self.carry = stream[whole * self.cut.record_length:].copy()

    def finish(self) -> SplitStats:
        self.stats.tokens_dropped += len(self.carry)
        return self.stats


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def tokenize_into(documents: Iterable[str], tokenizer, sinks: dict[str, RecordShards], cut: Cut, *,
                  workers: int = 1, on_chunk: Callable[[int, int], None] | None = None) -> dict[str, SplitStats]:
    """Tokenize `documents` into records written to `sinks["train"]` (and `sinks["validation"]` when
    cut.validation_percentage > 0). The one preparation path of the token cache and of `spmdlm.prepare`.

    workers <= 1 tokenizes in this process; more spawn that many processes (one tokenizer thread each, no JAX),
    each given chunks of documents, while this process reads, cuts and writes the results in input order: the
    records are the same whatever the count. At most 2 chunks per worker are in flight (bounded memory).
    `on_chunk(documents, tokens)` is called after each chunk is written (progress).
    """
    if cut.validation_percentage > 0 and "validation" not in sinks:
        raise ValueError("a validation percentage needs a validation sink")
    cutters = {split: _Cutter(cut, sink) for split, sink in sinks.items()}

    def consume(result: dict[str, tuple]) -> None:
        docs = tokens = 0
        for split, (array, n_docs, n_tokens, dropped) in result.items():
            cutters[split].add(array, n_docs, n_tokens, dropped)
            docs, tokens = docs + n_docs, tokens + n_tokens
        if on_chunk is not None:
            on_chunk(docs, tokens)

    try:
        if workers <= 1:
            for chunk in _chunks(documents):
                consume(_tokenize_chunk(tokenizer, chunk, cut))
        else:
            _tokenize_in_workers(documents, tokenizer, cut, workers, consume)
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    return {split: cutter.finish() for split, cutter in cutters.items()}


def _tokenize_in_workers(documents, tokenizer, cut: Cut, workers: int, consume) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may be a JAX process with running threads; the workers import no JAX.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(tokenizer.to_str(), cut))
    pending: collections.deque = collections.deque()
    try:
        for chunk in _chunks(documents):
            pending.append(pool.submit(_worker_tokenize, chunk))
            while len(pending) >= 2 * workers:
                consume(pending.popleft().result())
        while pending:
            consume(pending.popleft().result())
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


# -- the launcher's token cache ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
    """Fixed-length records in one or more ArrayRecord files, read in order as one sequence."""

    paths: tuple[Path, ...]  # the ArrayRecord files (shards), in order; a single Path is accepted
    num_records: int
    num_tokens: int
    record_length: int

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else self.paths
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))

    @property
    def path(self) -> Path:
        """The file of a one-file split (the token cache's)."""
        if len(self.paths) != 1:
            raise ValueError(f"this split has {len(self.paths)} shard files; use .paths")
        return self.paths[0]


class _DamagedCache(Exception):
    """A cached split whose metadata or data file does not check out; the message says what."""


CACHE_META_KEYS = ("num_records", "num_tokens", "bytes", "sha256")


def _count_records(paths: Sequence[Path]) -> int:
    """Records in ArrayRecord files; RuntimeError/OSError when one does not open."""
    import grain

    return len(grain.sources.ArrayRecordDataSource([str(p) for p in paths]))


def _verified_meta(data_path: Path, meta_path: Path) -> dict:
    """The metadata of a cached split once its data file matches it (size, hash, record count)."""
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
        num_records = _count_records([data_path])
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


def _progress_bar(total: int | None, desc: str, unit: str = "doc", disable: bool | None = None):
    from tqdm import tqdm

    # disable=None: shown on a terminal only (a log file gets the summary lines instead); stderr, as tqdm does.
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, disable=disable,
                leave=False)


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
    workers: int = 1,
    progress: bool | None = None,
) -> PreparedSplit:
    """Tokenize `documents` into fixed-length records, or reuse the cached file for the same content.

    `workers` > 1 tokenizes in that many processes (same records); `progress` shows a progress bar (None: on a
    terminal only). A gs:// `cache_dir` keeps the cache in the bucket and a copy on this host's disk.
    """
    if storage.is_remote(cache_dir):
        return _prepare_split_in_bucket(documents, tokenizer, record_length=record_length,
                                        separator_id=separator_id, cache_dir=cache_dir, name=name,
                                        overwrite_cache=overwrite_cache, mode=mode, pad_id=pad_id, workers=workers,
                                        progress=progress)
    cut = Cut(record_length, separator_id, mode, pad_id)
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    folder = Path(cache_dir) / _cache_key(documents, tokenizer, cut)
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
    sink = RecordShards(lambda index: tmp)
    bar = _progress_bar(len(documents), f"tokenizing {name}", disable=None if progress is None else not progress)
    try:
        with bar:
            stats = tokenize_into(documents, tokenizer, {"train": sink}, cut, workers=workers,
                                  on_chunk=lambda docs, tokens: bar.update(docs))["train"]
        sink.close()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if stats.examples == 0:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"the {name} corpus has {stats.tokens} tokens, fewer than one example of {record_length}; "
            "give more text or lower --block_size/--max_seq_length"
        )
    meta = {"num_records": stats.examples, "num_tokens": stats.tokens, "record_length": record_length,
            "documents": len(documents), "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
    # Each file by an atomic rename, the metadata last: a cache is never seen half-written.
    os.replace(tmp, data_path)
    meta_tmp = meta_path.with_name(meta_path.name + tmp_suffix)
    meta_tmp.write_text(json.dumps(meta))
    os.replace(meta_tmp, meta_path)
    log.info("tokenized %d %s documents into %d records of %d tokens (%s)", len(documents), name, stats.examples,
             record_length, folder)
    return PreparedSplit(data_path, stats.examples, stats.tokens, record_length)


def _cache_key(documents: list[str], tokenizer, cut: Cut) -> str:
    """The cache folder's name: the documents' content, the tokenizer, the record length and the mode."""
    content = hashlib.sha256()
    for doc in documents:
        content.update(hashlib.sha256(doc.encode("utf-8")).digest())
    return hashlib.sha256(
        b"|".join([content.digest(), tokenizer.to_str().encode(), str(cut.record_length).encode(),
                   str(cut.separator_id).encode(), f"{cut.mode}:{cut.pad_id}".encode()])
    ).hexdigest()[:24]


def _prepare_split_in_bucket(documents, tokenizer, *, cache_dir, name: str, overwrite_cache: bool, **settings):
    """The token cache in a bucket: a verified copy of it on this host's disk (downloaded when missing or stale),
    or, when the bucket has none, one built here and uploaded (the data file first, the metadata last: a reader
    never sees a cache half-written)."""
    cut = Cut(settings["record_length"], settings["separator_id"], settings["mode"], settings["pad_id"])
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    key = _cache_key(documents, tokenizer, cut)
    remote, local = cache_dir / key, storage.local_mirror(cache_dir) / key
    data_name, meta_name = f"{name}.array_record", f"{name}.json"
    fetched = False
    if not overwrite_cache and (remote / meta_name).is_file():
        remote_meta = (remote / meta_name).read_text()
        local_meta = local / meta_name
        fetched = local_meta.is_file() and local_meta.read_text() == remote_meta
        if not fetched:
            log.info("copying the tokenized %s cache %s to %s", name, remote, local)
            storage.download(remote / data_name, local / data_name, desc=f"copying {name} cache")
            local.mkdir(parents=True, exist_ok=True)
            storage.write_atomic(local_meta, remote_meta)
            fetched = True
    split = prepare_split(documents, tokenizer, cache_dir=local.parent, name=name, overwrite_cache=overwrite_cache,
                          **settings)
    if not fetched or (local / meta_name).read_text() != (remote / meta_name).read_text():  # built (or rebuilt) here
        storage.upload(local / data_name, remote / data_name)
        storage.upload(local / meta_name, remote / meta_name)
        log.info("uploaded the tokenized %s cache to %s", name, remote)
    return split


def record_source(split: PreparedSplit):
    """A random-access Grain source over the records of a prepared split: all its shards, in order."""
    import grain

    return grain.sources.ArrayRecordDataSource([str(p) for p in split.paths])


def decode_record(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32)


# -- prepared dataset directories (python -m spmdlm.prepare) ---------------------------------------------------------

CARD_NAME = "dataset.json"
CARD_FORMAT = "spmdlm-dataset"
CARD_VERSION = 1
TOKENIZER_DIR = "tokenizer"  # the dataset's copy of its tokenizer (loadable with --tokenizer_name DATASET/tokenizer)


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
        raise DataError(f"--dataset_dir {folder}: {CARD_NAME} is unreadable ({e}); prepare the dataset again") \
            from None
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        raise DataError(f"--dataset_dir {folder}: {CARD_NAME} is not an spmdlm dataset card")
    if card.get("version") != CARD_VERSION:
        raise DataError(f"--dataset_dir {folder}: dataset format version {card.get('version')}, this spmdlm reads "
                        f"{CARD_VERSION}; prepare it again with this version")
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
            raise DataError(f"--dataset_dir {folder}: shard {shard['file']} has {size} bytes, {shard['bytes']} "
                            "expected; prepare the dataset again")
    if storage.is_remote(folder):  # Grain reads local files: a verified copy on this host's disk
        paths = [_local_shard(folder, path, shard) for path, shard in zip(paths, entry["shards"])]
    for path, shard in zip(paths, entry["shards"]):
        if verify and _sha256(path) != shard["sha256"]:
            raise DataError(f"--dataset_dir {folder}: shard {shard['file']} does not match its sha256; prepare "
                            "the dataset again")
    try:
        records = _count_records(paths)
    except (RuntimeError, OSError) as e:
        raise DataError(f"--dataset_dir {folder}: a {split} shard does not open "
                        f"({str(e).partition(chr(10))[0] or type(e).__name__}); prepare the dataset again") from None
    if records != entry["examples"]:
        raise DataError(f"--dataset_dir {folder}: the {split} shards hold {records} records, {entry['examples']} "
                        "expected; prepare the dataset again")
    return PreparedSplit(tuple(paths), entry["examples"], entry["tokens"], card["record_length"])


def _local_shard(folder, remote, shard: dict) -> Path:
    """This host's copy of a bucket's shard (storage.local_mirror), downloaded unless a copy of the card's size and
    sha256 is there already (its sha256 is kept beside it); a copy that does not match the card is refused."""
    local = storage.local_mirror(folder) / shard["file"]
    checked = local.with_name(local.name + ".sha256")
    if local.is_file() and local.stat().st_size == shard["bytes"] and checked.is_file() \
            and checked.read_text() == shard["sha256"]:
        return local
    if storage.download(remote, local, desc=f"copying {shard['file']}") != shard["sha256"]:
        local.unlink(missing_ok=True)
        raise DataError(f"--dataset_dir {folder}: shard {shard['file']} does not match its sha256; prepare the "
                        "dataset again")
    checked.write_text(shard["sha256"])
    return local


def open_dataset(dataset_dir: str | os.PathLike, *, tokenizer, record_length: int, mode: str,
                 verify: bool = False) -> tuple[PreparedSplit, PreparedSplit | None, dict]:
    """(train, validation or None, card) of a dataset written by `python -m spmdlm.prepare`.

    Refuses (DataError, one line) a dataset prepared with another tokenizer (sha256 of tokenizer.to_str()), record
    length or preparation mode than the run's, and one whose shards are missing or of the wrong size or record
    count; `verify` also checks every shard's sha256 (reads everything). Every host may call it: it only reads (a
    dataset in a bucket is copied to each host's local disk, verified).
    """
    folder = storage.path(dataset_dir, "--dataset_dir")
    card = read_card(folder)
    flags = " ".join(f"--{k} {v}" for k, v in (card.get("objective") or {}).items() if v not in (None, False))
    prepared = f"--dataset_dir {folder} was prepared for {card.get('for_model')} {flags}".rstrip()
    if card["record_length"] != record_length:
        raise DataError(f"{prepared} (records of {card['record_length']} tokens) but this run needs records of "
                        f"{record_length} tokens: pass the same length flags or prepare the data again")
    if card["mode"] != mode:
        raise DataError(f"{prepared} ({card['mode']!r} records) but this run's objective needs {mode!r} records: "
                        "prepare the data again for this objective")
    if card["tokenizer"]["sha256"] != tokenizer_hash(tokenizer):
        raise DataError(f"--dataset_dir {folder} was tokenized with another tokenizer than this run's (sha256 "
                        f"{card['tokenizer']['sha256'][:12]}, this run's {tokenizer_hash(tokenizer)[:12]}): pass "
                        f"--tokenizer_name {folder / TOKENIZER_DIR} or prepare the data again")
    train = _open_split(folder, card, "train", verify)
    if train is None:
        raise DataError(f"--dataset_dir {folder} has no training split; prepare the dataset again")
    return train, _open_split(folder, card, "validation", verify), card
