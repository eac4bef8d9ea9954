"""The launcher's token cache (`--train_file`, `--cache_dir`; docs/data.md): documents tokenized once into one
token file per split (`NAME.tokens`, spmdlm.data.records) under a key made from the documents' content, the
tokenizer, the record length and the mode. A second run reuses the file once its size, sha256 and record count
match the metadata (`NAME.json`); a damaged cache is rebuilt, and so, once, is a cache of the ArrayRecord format
earlier versions wrote (`NAME.array_record`, read one record at a time), whose file is then removed.

Buckets (gs://, spmdlm/storage.py): a `--cache_dir gs://...` cache is copied once to each host's local disk
(storage.local_mirror, reused while its metadata matches the bucket's) and memory-mapped there.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from spmdlm import storage
from spmdlm.data.records import (
    TOKEN_FORMAT,
    TOKENS_SUFFIX,
    Cut,
    PreparedSplit,
    RecordShards,
    file_sha256,
    no_space,
    progress_bar,
    remove_stale_temps,
    token_file_problem,
    tokenize_into,
)
from spmdlm.errors import DataError

log = logging.getLogger(__name__)


class _DamagedCache(Exception):
    """A cached split whose metadata or data file does not check out; the message says what."""


class _OldFormat(_DamagedCache):
    """A cached split in the ArrayRecord format of earlier versions."""


CACHE_META_KEYS = ("num_records", "num_tokens", "bytes", "sha256")
OLD_SUFFIX = ".array_record"  # earlier versions' data file, one ArrayRecord entry per record


def _verified_meta(data_path: Path, meta_path: Path, record_length: int) -> dict:
    """The metadata of a cached split once its data file matches it (format, size, hash, record count)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise _DamagedCache(f"{meta_path.name} is unreadable: {e}") from None
    missing = [key for key in CACHE_META_KEYS if key not in meta] if isinstance(meta, dict) else CACHE_META_KEYS
    if missing:  # older caches did not record the size and hash
        raise _DamagedCache(f"{meta_path.name} lacks {', '.join(missing)}")
    if meta.get("format") != TOKEN_FORMAT:
        raise _OldFormat(f"{meta_path.name} describes {data_path.stem}{OLD_SUFFIX}")
    if not data_path.is_file():
        raise _DamagedCache(f"{data_path.name} is missing")
    if (size := data_path.stat().st_size) != meta["bytes"]:
        raise _DamagedCache(f"{data_path.name} has {size} bytes, {meta['bytes']} expected")
    if file_sha256(data_path) != meta["sha256"]:
        raise _DamagedCache(f"{data_path.name} does not match its sha256")
    if problem := token_file_problem(data_path, size, meta["num_records"], record_length):
        raise _DamagedCache(problem)
    return meta


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
    bos_id: int | None = None,
    workers: int = 1,
    progress: bool | None = None,
) -> PreparedSplit:
    """Tokenize `documents` into fixed-length records, or reuse the cached file for the same content.

    `workers` > 1 tokenizes in that many processes (same records); `progress` shows a progress bar (None: on a
    terminal only). A gs:// `cache_dir` keeps the cache in the bucket and a copy on this host's disk.
    """
    if storage.is_remote(cache_dir):
        return _prepare_split_in_bucket(
            documents,
            tokenizer,
            record_length=record_length,
            separator_id=separator_id,
            cache_dir=cache_dir,
            name=name,
            overwrite_cache=overwrite_cache,
            mode=mode,
            pad_id=pad_id,
            bos_id=bos_id,
            workers=workers,
            progress=progress,
        )
    cut = Cut(record_length, separator_id, mode, pad_id, bos_id=bos_id)
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    folder = Path(cache_dir) / _cache_key(documents, tokenizer, cut)
    data_path, meta_path = folder / f"{name}{TOKENS_SUFFIX}", folder / f"{name}.json"
    if meta_path.exists() and not overwrite_cache:
        try:
            meta = _verified_meta(data_path, meta_path, record_length)
        except _OldFormat:
            log.warning(
                "the tokenized %s cache %s is in the ArrayRecord format of earlier versions; rebuilding it "
                "once as flat tokens (fast batched reads)",
                name,
                folder,
            )
        except _DamagedCache as e:
            log.warning("the tokenized %s cache %s is damaged (%s); rebuilding it", name, folder, e)
        else:
            log.info(
                "reusing the tokenized %s cache %s (%d records, %d tokens)",
                name,
                folder,
                meta["num_records"],
                meta["num_tokens"],
            )
            return PreparedSplit(data_path, meta["num_records"], meta["num_tokens"], record_length, folder.name)

    host = socket.gethostname()
    tmp_suffix = f".tmp-{host}-{os.getpid()}"  # unique on shared filesystems
    tmp = data_path.with_name(data_path.name + tmp_suffix)
    try:  # up front: a failed write later would not say which folder
        folder.mkdir(parents=True, exist_ok=True)
        tmp.touch()
    except OSError as e:
        raise DataError(
            f"cannot write the token cache in {folder}: {e.strerror or e}; pass a writable --cache_dir"
        ) from None
    remove_stale_temps(folder, f"{glob.escape(name)}.*", host)
    sink = RecordShards(lambda index: tmp)
    bar = progress_bar(len(documents), f"tokenizing {name}", disable=None if progress is None else not progress)
    try:
        with bar:
            stats = tokenize_into(
                documents,
                tokenizer,
                {"train": sink},
                cut,
                workers=workers,
                on_chunk=lambda docs, tokens: bar.update(docs),
                name=name,
            )["train"]
        sink.close()
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and no_space(e):
            raise DataError(
                f"cannot write the token cache in {folder}: no space left on device; free some space "
                "or pass another --cache_dir"
            ) from None
        raise
    if stats.examples == 0:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"the {name} corpus has {stats.tokens} tokens, fewer than one example of {record_length}; "
            "give more text or lower --block_size/--max_seq_length"
        )
    meta = {
        "format": TOKEN_FORMAT,
        "num_records": stats.examples,
        "num_tokens": stats.tokens,
        "record_length": record_length,
        "documents": len(documents),
        "pad_tokens": stats.pad_tokens,
        "bytes": tmp.stat().st_size,
        "sha256": file_sha256(tmp),
    }
    # Each file by an atomic rename, the metadata last: a cache is never seen half-written.
    os.replace(tmp, data_path)
    meta_tmp = meta_path.with_name(meta_path.name + tmp_suffix)
    meta_tmp.write_text(json.dumps(meta))
    os.replace(meta_tmp, meta_path)
    (folder / f"{name}{OLD_SUFFIX}").unlink(missing_ok=True)  # an earlier version's file of the same records
    log.info(
        "tokenized %d %s documents into %d records of %d tokens (%s)",
        len(documents),
        name,
        stats.examples,
        record_length,
        folder,
    )
    return PreparedSplit(data_path, stats.examples, stats.tokens, record_length, folder.name)


def _cache_key(documents: list[str], tokenizer, cut: Cut) -> str:
    """The cache folder's name: the documents' content, the tokenizer, the record length and the mode (with
    packed_lines, its framing id too; the other modes' keys are those of earlier versions)."""
    content = hashlib.sha256()
    for doc in documents:
        content.update(hashlib.sha256(doc.encode("utf-8")).digest())
    return hashlib.sha256(
        b"|".join(
            [
                content.digest(),
                tokenizer.to_str().encode(),
                str(cut.record_length).encode(),
                str(cut.separator_id).encode(),
                f"{cut.mode}:{cut.pad_id}".encode(),
            ]
            + ([str(cut.bos_id).encode()] if cut.mode == "packed_lines" else [])
        )
    ).hexdigest()[:24]


def _prepare_split_in_bucket(documents, tokenizer, *, cache_dir, name: str, overwrite_cache: bool, **settings):
    """The token cache in a bucket: a verified copy of it on this host's disk (downloaded when missing or stale),
    or, when the bucket has none, one built here and uploaded (the data file first, the metadata last: a reader
    never sees a cache half-written)."""
    cut = Cut(
        settings["record_length"],
        settings["separator_id"],
        settings["mode"],
        settings["pad_id"],
        bos_id=settings["bos_id"],
    )
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    key = _cache_key(documents, tokenizer, cut)
    remote, local = cache_dir / key, storage.local_mirror(cache_dir) / key
    data_name, meta_name = f"{name}{TOKENS_SUFFIX}", f"{name}.json"
    fetched = False
    if not overwrite_cache and (remote / meta_name).is_file():
        remote_meta = (remote / meta_name).read_text()
        local_meta = local / meta_name
        fetched = local_meta.is_file() and local_meta.read_text() == remote_meta
        if not fetched and _in_token_format(remote_meta):  # an earlier version's cache is rebuilt here instead
            log.info("copying the tokenized %s cache %s to %s", name, remote, local)
            storage.download(remote / data_name, local / data_name, desc=f"copying {name} cache")
            local.mkdir(parents=True, exist_ok=True)
            storage.write_atomic(local_meta, remote_meta)
            fetched = True
    split = prepare_split(
        documents, tokenizer, cache_dir=local.parent, name=name, overwrite_cache=overwrite_cache, **settings
    )
    if not fetched or (local / meta_name).read_text() != (remote / meta_name).read_text():  # built (or rebuilt) here
        storage.upload(local / data_name, remote / data_name)
        storage.upload(local / meta_name, remote / meta_name)
        storage.remove(remote / f"{name}{OLD_SUFFIX}")
        log.info("uploaded the tokenized %s cache to %s", name, remote)
    return split


def _in_token_format(meta_text: str) -> bool:
    try:
        meta = json.loads(meta_text)
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == TOKEN_FORMAT
