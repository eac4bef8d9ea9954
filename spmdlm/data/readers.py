"""Reading documents (docs/data.md): inputs -> the corpus's non-empty texts, one document each.

Files: text (one document per line, per blank-line-separated paragraph or per file: --text_documents),
json/jsonl/csv/tsv (a text field), parquet (pyarrow), each plain or compressed (.gz, .zst, .xz, .bz2; decoded by
spmdlm.data.compression). The format is the suffix's (.json/.jsonl, .csv/.tsv, .parquet), or --text_format's; any other
file is text, whatever its name, and one whose bytes are not text is refused. Also Hugging Face `datasets` (local
`save_to_disk` dirs, parquet dirs,
Hub names); `ReadStats` counts what was skipped or repaired. Also the embedded corpus (this Python's standard
library sources) and the held-out split by document hash.

Buckets (gs://, spmdlm/storage.py): input files are read through gcsfs as they are (streamed).
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import hashlib
import itertools
import json
import logging
import os
import stat
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from spmdlm import storage
from spmdlm.data.compression import DATASETS_HINT, formats, text_lines
from spmdlm.errors import DataError

log = logging.getLogger(__name__)

DATASET_CARD = "dataset.json"  # the card of a dataset prepared by python -m spmdlm.prepare (spmdlm/data/datasets.py)
SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
TEXT_FORMATS = ("text", "json", "csv", "parquet")  # --text_format
TEXT_FORMAT_HELP = (
    "the format of every input file, whatever its name: text, json (JSON lines or an array), csv "
    "(.tsv files tab-separated), parquet. Default: from the suffix (.json/.jsonl, .csv/.tsv, "
    ".parquet), any other file being text (checked: binary files are refused)"
)


def file_format(path: Path, text_format: str | None = None) -> str:
    """One of TEXT_FORMATS: `text_format` when given, else the suffix's (before any compression suffix), else text."""
    return text_format or SUFFIX_FORMATS.get(formats(path)[0], "text")


@dataclasses.dataclass
class ReadStats:
    """What reading skipped or repaired, for the dataset card and the summary line."""

    files: int = 0
    documents: int = 0
    invalid_bytes: int = 0  # bytes that were not UTF-8, replaced by U+FFFD
    empty_lines: int = 0  # blank lines, and records whose text is empty or only whitespace
    empty_files: int = 0  # files that held no document
    bytes_done: int = 0  # input bytes of the files read to the end (for progress)
    reading: object = dataclasses.field(default=None, repr=False)  # the raw file being read (compression.py)

    @property
    def bytes_read(self) -> int:
        """Input bytes read so far (compressed bytes for compressed files)."""
        current = self.reading
        try:
            return self.bytes_done + (current.tell() if current is not None and not current.closed else 0)
        except (OSError, ValueError):
            return self.bytes_done

    def card(self) -> dict:
        return {
            "files": self.files,
            "documents": self.documents,
            "invalid_utf8_bytes_replaced": self.invalid_bytes,
            "empty_lines_skipped": self.empty_lines,
            "empty_files_skipped": self.empty_files,
        }


# -- finding input files ---------------------------------------------------------------------------------------------


def _readable(path: Path) -> bool:
    """A file a directory input contributes: any that is not hidden (its bytes are checked when it is read)."""
    return not path.name.startswith(".")


def _directory_files(folder: Path) -> list[Path]:
    if storage.is_remote(folder):  # every object under the prefix; hidden names (at any level) skipped
        inside = lambda p: str(p)[len(str(folder)) :].strip("/").split("/")
        return [
            p
            for p in storage.files_under(folder)
            if _readable(p) and not any(part.startswith(".") for part in inside(p))
        ]
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            if not _readable(path):
                continue
            if not path.is_file():  # a FIFO, socket or device: reading it would block or never end
                log.warning("skipping %s: %s, not a regular file", path, _kind(path))
                continue
            found.append(path)
    return found


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(path: Path) -> str:
    """What a local path that exists but is neither a regular file nor a directory is."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "unreadable"
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def _special(path: Path) -> bool:
    """A local path that exists and is neither a regular file nor a directory (a FIFO, socket, device)."""
    return not storage.is_remote(path) and os.path.exists(path) and not path.is_file() and not path.is_dir()


def same_file(a: Path, b: Path) -> bool:
    """Two inputs naming one file (a local file through any path or link; a bucket object by its URL)."""
    if storage.is_remote(a) or storage.is_remote(b):
        return str(a) == str(b)
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def expand_files(patterns: str | Iterable[str], flag: str = "--train_file") -> list[Path]:
    """Expand comma-separated paths, globs or directories in a stable order; every one must give a file.

    A directory gives the files under it (recursively, hidden ones skipped, sorted by path).
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
            elif (match / DATASET_CARD).is_file():  # its shards are tokens, not text
                raise DataError(
                    f"{flag} {match}: is a dataset prepared by python -m spmdlm.prepare, not text; give "
                    "it as --dataset_dir (in a mixture: as a source's dataset_dir in --data_mixture)"
                )
            elif match.is_dir():
                found.extend(_directory_files(match))
            elif storage.symlink_loop(match):
                raise DataError(f"{flag} {match}: is a symlink loop (it leads back to itself); point it at a file")
            elif _special(match):  # a FIFO has no size and cannot seek (the manifest samples files) or be re-read
                raise DataError(
                    f"{flag} {match}: is not a regular file ({_kind(match)}); give a file (write the "
                    "stream to a file first)"
                )
        if not found:
            missing.append(pattern)
        files.extend(found)
    if len(missing) == 1 and glob.has_magic(missing[0]):  # a pattern, not a path: it named no file
        raise DataError(f"{flag}: the glob {missing[0]} matches no file; check its folder and pattern")
    if len(missing) == 1:
        raise DataError(f"{flag} {missing[0]}: no such file; check the path (globs like 'data/*.txt' are allowed)")
    if missing:
        raise DataError(
            f"{flag}: no such files: {', '.join(missing)}; check the paths (globs like 'data/*.txt' are allowed)"
        )
    return files


# -- reading documents ---------------------------------------------------------------------------------------------


TEXT_DOCUMENTS = ("line", "blank_line", "file")  # --text_documents: where a text file's documents end
TEXT_DOCUMENTS_HELP = (
    "text files only (json/csv/parquet records are documents already): where a document ends. "
    "line = each non-empty line (the HF scripts'; default); blank_line = paragraphs separated by "
    "blank lines, newlines inside kept; file = each file is one document"
)


def _read_txt(path: Path, stats: ReadStats, text_documents: str = "line") -> Iterator[str]:
    """`line`: one document per line, as the HF `text` builder the reference scripts used (blank lines carry
    nothing); `blank_line`: paragraphs separated by blank lines, their inner newlines kept; `file`: the whole file.
    A document's trailing newline is where it ends (its EOS), so it is not part of it."""
    lines = text_lines(path, stats=stats)
    if text_documents == "file":
        text = "".join(lines).rstrip("\n")
        if text.strip():
            yield text
        return
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
            if text_documents == "line":
                yield "".join(paragraph).rstrip("\n")
                paragraph = []
        elif paragraph:
            yield "".join(paragraph).rstrip("\n")
            paragraph = []
        else:
            stats.empty_lines += 1
    if paragraph:
        yield "".join(paragraph).rstrip("\n")


def _pick_text(record, where: str, text_column: str | None) -> str:
    """The text of one JSON/CSV record: its `text_column` field ("text" by default); a bare value is the text."""
    if not isinstance(record, dict):
        value = record
    else:
        column = text_column or "text"
        if column not in record:
            fields = ", ".join(str(k) for k in list(record)[:10]) + (", ..." if len(record) > 10 else "")
            raise DataError(
                f"{where} has no {column!r} field; pass --text_column NAME, NAME one of its fields: {fields or 'none'}"
            )
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
    lines = enumerate(text_lines(path, stats=stats), start=1)
    for number, line in lines:  # noqa: B007 - the first non-empty line is read on after the loop
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
                raise DataError(
                    f"{path}:{number}: not JSON lines ({e}); fix the line or convert the file to .txt"
                ) from None
            yield f"{path}:{number}", record
        else:
            stats.empty_lines += 1


def _read_csv(path: Path, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    fmt, _ = formats(path)  # the delimiter: tab for .tsv, whatever --text_format says
    reader = csv.DictReader(text_lines(path, newline="", stats=stats), delimiter="\t" if fmt == ".tsv" else ",")
    # line_num is the source line where the row ends, the one an editor shows.
    yield from _texts(((f"{path}:{reader.line_num}", row) for row in reader), text_column, stats)


def _read_parquet(path: Path, text_column: str | None, stats: ReadStats) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: {DATASETS_HINT}") from None
    if formats(path)[1]:
        raise DataError(f"{path}: compressed parquet is not read (parquet compresses itself); decompress it")
    try:
        parquet = pq.ParquetFile(path.open("rb") if storage.is_remote(path) else path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a parquet file ({str(e).partition(chr(10))[0]})") from None
    column = text_column or "text"
    names = parquet.schema_arrow.names
    if column not in names:
        fields = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise DataError(
            f"{path} has no {column!r} column; pass --text_column NAME, NAME one of its columns: {fields or 'none'}"
        )
    for batch in parquet.iter_batches(batch_size=1024, columns=[column]):
        for value in batch.column(0).to_pylist():
            text = "" if value is None else str(value)
            if text.strip():
                yield text
            else:
                stats.empty_lines += 1


def _documents_of(path: Path, fmt: str, text_column: str | None, stats: ReadStats, text_documents: str):
    if fmt == "json":
        return _read_json(path, text_column, stats)
    if fmt == "csv":
        return _read_csv(path, text_column, stats)
    if fmt == "parquet":
        return _read_parquet(path, text_column, stats)
    return _read_txt(path, stats, text_documents)


def read_documents(
    files: Iterable[Path],
    *,
    text_column: str | None = None,
    stats: ReadStats | None = None,
    text_documents: str = "line",
    text_format: str | None = None,
    warn_empty: bool = True,
) -> Iterator[str]:
    """The non-empty documents of the files: a text file's lines, paragraphs or whole text (`text_documents`), or
    the `text_column` ("text") field of a record. Each file's format is `file_format`'s.

    `stats`, if given, counts the files, documents, replaced bytes and skipped empty lines and files; `warn_empty`
    False leaves the files that hold no text to the caller (counted in `stats`), e.g. to refuse them as a whole.
    """
    stats = stats if stats is not None else ReadStats()
    for path in files:
        documents = _documents_of(path, file_format(path, text_format), text_column, stats, text_documents)
        stats.files += 1
        count = 0
        for document in documents:
            count += 1
            stats.documents += 1
            yield document
        stats.bytes_done += storage.size(path)
        if not count:
            stats.empty_files += 1
            if warn_empty:
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
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


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
            fmt = formats(path)[0].lstrip(".")
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
        raise DataError(
            f"--dataset_name {name} split {split} has no {column!r} column; pass --text_column NAME, "
            f"NAME one of its columns: {', '.join(names[:10]) or 'none'}"
        )
    if hasattr(dataset, "iter") and hasattr(dataset, "__len__"):  # map-style (memory-mapped): column batches
        rows = (value for batch in dataset.select_columns([column]).iter(batch_size=1000) for value in batch[column])
    else:
        rows = (record.get(column, KeyError) for record in dataset)
    for value in rows:
        if value is KeyError:
            raise DataError(
                f"--dataset_name {name} split {split}: a record has no {column!r} field; pass --text_column NAME"
            )
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
    return {
        "path": str(path) if storage.is_remote(path) else str(path.resolve()),
        "bytes": size,
        "mtime_ns": storage.mtime_ns(path),
        "sample_blake2b": digest.hexdigest(),
    }


@dataclasses.dataclass
class Corpus:
    """Documents from files (text/json/jsonl/csv/parquet, plain or compressed) or from a `datasets` dataset."""

    files: tuple[Path, ...] = ()
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    text_column: str | None = None
    text_documents: str = "line"  # text files only: TEXT_DOCUMENTS
    text_format: str | None = None  # TEXT_FORMATS, or None: each file's suffix says
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
            return read_documents(
                self.files,
                text_column=self.text_column,
                stats=stats,
                text_documents=self.text_documents,
                text_format=self.text_format,
            )
        loaded = self._dataset()
        if split not in loaded:
            raise DataError(
                f"--dataset_name {self.dataset_name} has no {split!r} split (it has {', '.join(loaded) or 'none'})"
            )
        return _hf_texts(loaded[split], self.dataset_name, split, self.text_column, stats)

    @property
    def total_bytes(self) -> int | None:
        return sum(storage.size(p) for p in self.files) if self.files else None

    def manifest(self) -> dict:
        """What the inputs are, cheaply: each file's path, size, mtime and a hash of samples of it (a local dataset
        dir lists its files; a Hub dataset is named only)."""
        if not self.dataset_name:
            # text_format only when given, so the manifests (and cache keys) of earlier corpora stay as they were
            return {
                "files": [_file_entry(p) for p in self.files],
                "text_column": self.text_column,
                "text_documents": self.text_documents,
                **({"text_format": self.text_format} if self.text_format else {}),
            }
        path = Path(self.dataset_name).expanduser()
        files = (
            [path]
            if path.is_file()
            else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if path.is_dir()
            else []
        )
        return {
            "dataset_name": str(path.resolve()) if path.exists() else self.dataset_name,
            "dataset_config_name": self.dataset_config_name,
            "files": [_file_entry(p) for p in files],
            "text_column": self.text_column,
        }


def open_corpus(
    inputs: Sequence[str] = (),
    *,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    text_column: str | None = None,
    text_documents: str = "line",
    text_format: str | None = None,
    flag: str = "INPUTS",
) -> Corpus:
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
    return Corpus(
        files=tuple(expand_files(inputs, flag)),
        text_column=text_column,
        text_documents=text_documents,
        text_format=text_format,
    )


def add_corpus_arguments(parser) -> None:
    """The corpus flags of the commands that read one (spmdlm.prepare, spmdlm.tokenizer): INPUTS or --dataset_name
    (read with `corpus_of`)."""
    parser.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUTS",
        help="files, globs or directories: text (any name), json/jsonl/csv/parquet; plain, .gz, .zst, .xz or .bz2",
    )
    parser.add_argument(
        "--dataset_name",
        default=None,
        help=f"a datasets dataset: a save_to_disk dir, parquet file/dir, or Hub name (needs {DATASETS_HINT})",
    )
    parser.add_argument("--dataset_config_name", default=None, help="the dataset's configuration")
    parser.add_argument(
        "--text_column", default=None, help="json/jsonl/csv/parquet/datasets: the text field (default: text)"
    )
    parser.add_argument("--text_documents", choices=TEXT_DOCUMENTS, default="line", help=TEXT_DOCUMENTS_HELP)
    parser.add_argument("--text_format", choices=TEXT_FORMATS, default=None, help=TEXT_FORMAT_HELP)


def corpus_of(flags) -> Corpus:
    """The corpus that `add_corpus_arguments`' flags name."""
    return open_corpus(
        flags.inputs,
        dataset_name=flags.dataset_name,
        dataset_config_name=flags.dataset_config_name,
        text_column=flags.text_column,
        text_documents=flags.text_documents,
        text_format=flags.text_format,
    )
