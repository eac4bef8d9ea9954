"""Tokenizing documents into fixed-length int32 records written as flat token files (docs/data.md): the one
preparation path of the launcher's token cache (spmdlm.data.token_cache) and of dataset directories
(spmdlm.data.datasets), with the record types and the memory-mapped reader.

A token file (TOKENS_SUFFIX) is the records back to back, little-endian int32, nothing else: record i is tokens
[i·L, (i+1)·L) of a file of records of L tokens, so the record boundaries need no index, the file's size is its
record count, and any batch of records is one gather from a memory map (`TokenRecords`).

`tokenize_into` tokenizes documents in chunks, in-process or in N spawned worker processes, and the parent cuts and
writes the records in input order, so the output is the same bytes whatever the worker count. Records are
`record_length` int32 tokens; the objective says which mode it needs (its `preparation` attribute, "stream" by
default):
- "stream": documents joined by the separator (EOS), the stream cut into records (only the last partial one is
  dropped) — CLM, T5, grouped MLM;
- "sentences": the same, with the SENTENCE_END flag bit on the last token of each sentence (BART);
- "lines": one record per document (line), truncated and right-padded with pad_id (MLM --line_by_line);
- "packed_lines": each line framed `bos ids eos` (ids truncated to record_length - 2), the framed lines of each
  chunk packed best-fit decreasing into records, the rest of each record padded with pad_id (MLM --packing).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from spmdlm import storage
from spmdlm.data.readers import in_validation_split
from spmdlm.data.sentences import SENTENCE_END, mark_sentence_ends, sentence_ends

log = logging.getLogger(__name__)

TOKENIZE_BATCH = 512  # documents per tokenizer call: parallel in Rust, bounded memory
CHUNK_CHARS = 1 << 20  # ... and at most about this many characters per call (long documents)
PIECE_CHARS = 1 << 18  # a longer document is tokenized in pieces of about this size (bounded memory; same ids)

MODES = ("stream", "sentences", "lines", "packed_lines")
PADDED_MODES = ("lines", "packed_lines")  # records of whole lines, padded: their padding is counted and logged


@dataclasses.dataclass(frozen=True)
class Cut:
    """How documents become records (see the module docstring)."""

    record_length: int
    separator_id: int
    mode: str = "stream"
    pad_id: int | None = None
    validation_percentage: float = 0.0  # > 0: documents whose hash falls in it go to the "validation" split
    bos_id: int | None = None  # "packed_lines": the id that opens each framed line

    def __post_init__(self):
        if (
            self.mode not in MODES
            or (self.mode in PADDED_MODES and self.pad_id is None)
            or (self.mode == "packed_lines" and self.bos_id is None)
        ):
            raise ValueError(
                f"preparation mode {self.mode!r} (pad_id {self.pad_id}, bos_id {self.bos_id}) is not "
                "one of stream, sentences, lines+pad_id, packed_lines+pad_id+bos_id"
            )
        if self.record_length < (3 if self.mode == "packed_lines" else 1):  # packed: room for bos, a token, eos
            raise ValueError(f"record_length {self.record_length} is too short for {self.mode!r} records")


@dataclasses.dataclass
class SplitStats:
    documents: int = 0
    tokens: int = 0  # tokens in the prepared stream, separators included (lines: after truncation; packed_lines:
    #                  the framed lines, bos and eos included)
    examples: int = 0
    tokens_dropped: int = 0  # the last partial record (stream), the truncated tails (lines, packed_lines)
    pad_tokens: int = 0  # pad_id filling the records (lines, packed_lines)

    def card(self) -> dict:
        return dataclasses.asdict(self)

    def padding_fraction(self, record_length: int) -> float:
        """Pad tokens / record tokens."""
        return self.pad_tokens / max(1, self.examples * record_length)


@dataclasses.dataclass(frozen=True)
class _Encoded:
    ids: np.ndarray  # int32 [tokens]
    offsets: np.ndarray  # int32 [tokens, 2]: character offsets into the document


def _pieces(doc: str) -> list[int]:
    """Start offsets of pieces of about PIECE_CHARS that tokenize as the whole document does: each cut is just
    before a single space that follows a non-space, where every pre-tokenizer we train splits anyway (byte-level
    BPE attaches the space to the next word; Metaspace reads it as the next word's "▁"; a run of spaces, which T5's
    normalizer collapses, is never cut). A document with no such place stays whole."""
    starts, at = [0], PIECE_CHARS
    while at < len(doc):
        cut = doc.find(" ", at)
        while cut > 0 and (doc[cut - 1].isspace() or doc[cut + 1 : cut + 2].isspace()):
            cut = doc.find(" ", cut + 1)
        if cut <= 0:
            break
        starts.append(cut)
        at = cut + PIECE_CHARS
    return starts


def in_pieces(texts: Iterable[str]) -> Iterator[str]:
    """Each text, a long one cut into pieces of about PIECE_CHARS where its tokenization does not change (_pieces):
    what the tokenizer trainer reads, so it holds one piece's pre-tokenization at a time, not a document's."""
    for text in texts:
        starts = _pieces(text)
        if len(starts) == 1:
            yield text
            continue
        for start, end in zip(starts, starts[1:] + [len(text)]):
            yield text[start:end]


def _encode_long(tokenizer, doc: str) -> _Encoded:
    """One long document piece by piece (a 50 MB line tokenized whole held ~10 GB), offsets into the document."""
    starts = _pieces(doc)
    ids, offsets = [], []
    for start, end in zip(starts, starts[1:] + [len(doc)]):  # numpy per piece: Python ints would take ~5x the RAM
        enc = tokenizer.encode(doc[start:end], add_special_tokens=False)
        ids.append(np.asarray(enc.ids, dtype=np.int32))
        offsets.append(np.asarray(enc.offsets, dtype=np.int32).reshape(-1, 2) + start)
    return _Encoded(np.concatenate(ids), np.concatenate(offsets))


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: the items, longest first (ties in input order), each into the open bin it leaves the
    least room in (ties: the bin opened first), or a new bin when none has room. Each bin's items in input order,
    the bins in the order they were opened. Deterministic: a function of the lengths alone."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index) of the open bins, sorted
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(room, (lengths[item], -1))
        if at == len(room):
            bins.append([])
            index, left = len(bins) - 1, capacity
        else:
            left, index = room.pop(at)
        bins[index].append(item)
        if left > lengths[item]:
            bisect.insort(room, (left - lengths[item], index))
    return [sorted(items) for items in bins]


def _packed_lines(encoded: list, cut: Cut) -> tuple[np.ndarray, int, int]:
    """(records, tokens, dropped) of one chunk's lines: each framed bos ids eos (ids truncated to record_length -
    2), packed best-fit decreasing into records of record_length, padded with pad_id."""
    lines, dropped = [], 0
    for enc in encoded:
        ids = np.asarray(enc.ids[: cut.record_length - 2], dtype=np.int32)
        dropped += max(0, len(enc.ids) - (cut.record_length - 2))
        if len(ids):
            lines.append(np.concatenate([[cut.bos_id], ids, [cut.separator_id]]).astype(np.int32))
    bins = best_fit_decreasing([len(line) for line in lines], cut.record_length)
    array = np.full((len(bins), cut.record_length), cut.pad_id, dtype=np.int32)
    for row, items in zip(array, bins):
        packed = np.concatenate([lines[i] for i in items])
        row[: len(packed)] = packed
    return array, sum(len(line) for line in lines), dropped


def _tokenize_chunk(tokenizer, documents: list[str], cut: Cut) -> dict[str, tuple]:
    """{split: (array, documents, tokens, dropped)} of one chunk: for stream modes the token stream (each document
    then the separator), for "lines" and "packed_lines" the (n, record_length) records. Pure: the same for any
    process."""
    short = [i for i, doc in enumerate(documents) if len(doc) <= PIECE_CHARS]
    encoded: list = [None] * len(documents)
    for i, enc in zip(short, tokenizer.encode_batch([documents[i] for i in short], add_special_tokens=False)):
        encoded[i] = enc
    for i in sorted(set(range(len(documents))) - set(short)):
        encoded[i] = _encode_long(tokenizer, documents[i])
    held_out = (
        [in_validation_split(doc, cut.validation_percentage) for doc in documents]
        if cut.validation_percentage > 0
        else [False] * len(documents)
    )
    out = {}
    for split, wanted in (("train", False), ("validation", True)):
        picked = [(doc, enc) for doc, enc, held in zip(documents, encoded, held_out) if held is wanted]
        if not picked:
            continue
        if cut.mode == "packed_lines":
            array, tokens, dropped = _packed_lines([enc for _, enc in picked], cut)
            out[split] = (array, len(picked), tokens, dropped)
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


def _worker_init(tokenizer_json: str, cut: Cut, parent: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the processes are the parallelism
    # `parent` is the preparation's pid, passed in: one killed while this worker still started up is already gone
    threading.Thread(target=_exit_with_parent, args=(parent,), name="spmdlm-parent-watch", daemon=True).start()
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), cut=cut)


def _exit_with_parent(parent: int) -> None:
    """A worker whose preparation was killed (SIGKILL, or a signal that ended it at once) has no one to work for:
    it leaves, and the pool's resource tracker with it, instead of running on forever."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


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


TOKENS_SUFFIX = ".tokens"
TOKEN_DTYPE = np.dtype("<i4")


def _writer(path: Path):
    return open(path, "wb")


class RecordShards:
    """Writes (n, record_length) int32 rows into token files `path_of(0)`, `path_of(1)`, ... of at most
    `records_per_shard` records each (None: one file). A split with no records writes no file."""

    def __init__(self, path_of: Callable[[int], Path], records_per_shard: int | None = None):
        self.path_of, self.records_per_shard = path_of, records_per_shard
        self.shards: list[dict] = []  # closed shards: {"path", "records"}
        self._writer, self._path, self._count = None, None, 0

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=TOKEN_DTYPE)
        while len(rows):
            if self._writer is None:
                self._path = self.path_of(len(self.shards))
                self._writer, self._count = _writer(self._path), 0
            room = self.records_per_shard - self._count if self.records_per_shard else len(rows)
            self._writer.write(rows[:room].tobytes())
            self._count += len(rows[:room])
            rows = rows[room:]
            if self._count == self.records_per_shard:
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
            shard.update(bytes=shard["path"].stat().st_size, sha256=storage.file_sha256(shard["path"]))
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
        if self.cut.mode in PADDED_MODES:
            self.sink.write(array)
            self.stats.examples += len(array)
            self.stats.pad_tokens += array.size - tokens  # tokens: the non-pad ones of these records
            return
        stream = np.concatenate([self.carry, array]) if len(self.carry) else array
        whole = len(stream) // self.cut.record_length
        self.sink.write(stream[: whole * self.cut.record_length].reshape(whole, self.cut.record_length))
        self.stats.examples += whole
        self.carry = stream[whole * self.cut.record_length :].copy()

    def finish(self) -> SplitStats:
        self.stats.tokens_dropped += len(self.carry)
        return self.stats


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def tokenize_into(
    documents: Iterable[str],
    tokenizer,
    sinks: dict[str, RecordShards],
    cut: Cut,
    *,
    workers: int = 1,
    on_chunk: Callable[[int, int], None] | None = None,
    name: str | None = None,
) -> dict[str, SplitStats]:
    """Tokenize `documents` into records written to `sinks["train"]` (and `sinks["validation"]` when
    cut.validation_percentage > 0). The one preparation path of the token cache and of `spmdlm.prepare`. `name`:
    what the log calls a single sink's records when they are not training records (e.g. "validation").

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
    stats = {split: cutter.finish() for split, cutter in cutters.items()}
    if cut.mode in PADDED_MODES:
        log.info(
            "%s records of %d tokens: %s (pad tokens / record tokens)",
            cut.mode,
            cut.record_length,
            ", ".join(
                f"{name or split} {s.examples} with {s.padding_fraction(cut.record_length):.1%} padding"
                for split, s in stats.items()
            ),
        )
    return stats


def _tokenize_in_workers(documents, tokenizer, cut: Cut, workers: int, consume) -> None:
    # spawn, not fork: the parent may be a JAX process with running threads; the workers import no JAX.
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(tokenizer.to_str(), cut, os.getpid()),
    )
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


# -- the records on disk ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
    """Fixed-length records in one or more token files, read in order as one sequence."""

    paths: tuple[Path, ...]  # the token files (shards), in order; a single Path is accepted
    num_records: int
    num_tokens: int
    record_length: int
    fingerprint: str = ""  # what the records were made from: the token cache's key, a dataset card's key
    documents: int | None = None  # the documents the records hold (a dataset card's count; None: not known)

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else self.paths
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))

    @property
    def path(self) -> Path:
        """The file of a one-file split (the token cache's)."""
        if len(self.paths) != 1:
            raise ValueError(f"this split has {len(self.paths)} shard files; use .paths")
        return self.paths[0]


class TokenRecords:
    """The records of a prepared split (all its shards, in order; the first `num_records` of them) as a Grain
    random-access source: `source[i]` is record i, `source.read(indices)` a batch of them, gathered from memory maps
    of the files (the page cache, no copy per record)."""

    def __init__(self, split: PreparedSplit):
        # Plain ndarray views of the maps: indexing an np.memmap itself costs more than the gather.
        self._shards = [
            np.asarray(np.memmap(p, dtype=TOKEN_DTYPE, mode="r")).reshape(-1, split.record_length) for p in split.paths
        ]
        self._starts = np.cumsum([0] + [len(shard) for shard in self._shards])
        self._len = split.num_records  # checked against the files when opened; --max_train_samples keeps a prefix
        self.record_length = split.record_length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read(np.array([index]))[0]

    def read(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), record_length) int32: the records at `indices`, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and not (0 <= indices.min() and indices.max() < self._len):
            raise IndexError(f"record indices {indices.min()}..{indices.max()} outside [0, {self._len})")
        if len(self._shards) == 1:
            return self._shards[0][indices]
        out = np.empty((len(indices), self.record_length), dtype=TOKEN_DTYPE)
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        for shard in np.unique(shard_of):
            rows = shard_of == shard
            out[rows] = self._shards[shard][indices[rows] - self._starts[shard]]
        return out


def record_source(split: PreparedSplit) -> TokenRecords:
    """A random-access Grain source over the records of a prepared split."""
    return TokenRecords(split)


def token_file_problem(path: Path, size: int, records: int, record_length: int) -> str | None:
    """What is wrong with a token file of `size` bytes that should hold `records` records (None: nothing)."""
    held = size / (record_length * TOKEN_DTYPE.itemsize)
    return None if held == records else f"{path.name} holds {held:g} records, {records} expected"


def progress_bar(total: int | None, desc: str, unit: str = "doc", disable: bool | None = None):
    """A tqdm bar of `total` `unit`s (None: unknown)."""
    from tqdm import tqdm

    # disable=None: shown on a terminal only (a log file gets the summary lines instead); stderr, as tqdm does.
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, disable=disable, leave=False)
