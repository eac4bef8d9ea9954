"""The launcher's token cache (`--train_file`, `--cache_dir`; docs/data.md): each split's documents tokenized once
into a dataset directory (spmdlm.data.datasets: the writer, card, verification and reader of `python -m
spmdlm.prepare`'s datasets) at CACHE_DIR/KEY, the key made from the documents' content, the tokenizer, the record
length and the preparation mode. A second run reuses it once its shards match its card (size, sha256, record count);
a damaged cache, or a folder in an earlier version's layout, is rebuilt. The folder of a run's training records is a
dataset another run can be given as `--dataset_dir` (it holds a copy of the tokenizer, and the same key).

Buckets (gs://, spmdlm/storage.py): a `--cache_dir gs://...` keeps the dataset in the bucket; each host reads a
verified copy on its local disk (storage.local_mirror), and one built here is uploaded from there, its card last.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

from spmdlm import storage
from spmdlm.data import datasets
from spmdlm.data.records import Cut, PreparedSplit, progress_bar, tokenize_into
from spmdlm.errors import DataError, UnwritableDataError

log = logging.getLogger(__name__)


def prepare_split(
    documents: Iterable[str],
    tokenizer,
    cut: Cut,
    *,
    cache_dir,
    name: str,
    overwrite_cache: bool = False,
    workers: int = 1,
    progress: bool | None = None,
) -> PreparedSplit:
    """The split `name` ("train", "validation") of `documents` tokenized into the fixed-length records `cut` says
    (one split: no validation_percentage): the cached dataset of the same content, or one written now. `workers` > 1
    tokenizes in that many processes (same records); `progress` shows a progress bar (None: on a terminal only)."""
    if cut.validation_percentage:
        raise ValueError("the token cache holds one split per call: hold out the validation documents before")
    documents = list(documents)
    if not documents:
        raise DataError(f"the {name} corpus is empty; give a file with text in it")
    key = _cache_key(documents, tokenizer, cut) + ("" if name == "train" else f"-{name}")
    folder = storage.path(cache_dir, "--cache_dir") / key
    split = None if overwrite_cache else _cached(folder, name)
    if split is None:
        split = _build(folder, key, documents, tokenizer, cut, name=name, workers=workers, progress=progress)
    return split


def _cache_key(documents: list[str], tokenizer, cut: Cut) -> str:
    """The documents' content, the tokenizer, the record length and the mode (with packed_lines, its framing id too;
    the other modes' keys are those of earlier versions, so a resumed run finds its records' fingerprint)."""
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


def _cached(folder, name: str) -> PreparedSplit | None:
    """The cached split when `folder` holds it whole (every shard as its card says, sha256 included); else None,
    with a warning when the folder holds something else (a damaged cache, an earlier version's layout)."""
    if not folder.exists():
        return None
    if not (folder / datasets.CARD_NAME).is_file():
        log.warning(
            "the tokenized %s cache %s is in an earlier version's layout or incomplete; rebuilding it", name, folder
        )
        return None
    try:
        split = datasets.open_split(folder, datasets.read_card(folder), name, verify=True)
    except DataError as e:
        log.warning("the tokenized %s cache %s is damaged (%s); rebuilding it", name, folder, e)
        return None
    if split is None:
        log.warning("the tokenized %s cache %s has no %s split; rebuilding it", name, folder, name)
        return None
    log.info(
        "reusing the tokenized %s cache %s (%d records, %d tokens)", name, folder, split.num_records, split.num_tokens
    )
    return split


def _build(folder, key: str, documents: list[str], tokenizer, cut: Cut, *, name: str, workers, progress):
    """Tokenize the documents into the dataset directory `folder` (a bucket's: into its local mirror, then
    uploaded) -> its split `name`."""
    local = storage.local_mirror(folder) if storage.is_remote(folder) else folder
    head = datasets.card_head(
        {"documents": len(documents), "from": "the launcher's token cache"},
        tokenizer,
        cut,
        validation={"from": "none"},
        records_per_shard=datasets.records_per_shard(datasets.DEFAULT_SHARD_BYTES, cut.record_length),
    )
    card = datasets.write_dataset(
        local,
        {**head, "key": key},
        lambda tmp: _tokenize(documents, tokenizer, cut, tmp, head["records_per_shard"], name, workers, progress),
        tokenizer_copy=lambda tmp: _save_tokenizer(tokenizer, tmp),
        unwritable=lambda why: UnwritableDataError(
            f"cannot write the token cache in {local}: {why}; free some space or pass a writable --cache_dir"
        ),
        point="token_cache.before_swap",
    )
    if local != folder:
        storage.swap_in(local, folder, last=datasets.CARD_NAME)
        datasets.keep_as_mirror(local, card)
        log.info("uploaded the tokenized %s cache to %s", name, folder)
    split = datasets.open_split(local, card, name, verify=False)
    log.info(
        "tokenized %d %s documents into %d records of %d tokens (%s)",
        len(documents),
        name,
        split.num_records,
        cut.record_length,
        folder,
    )
    return split


def _save_tokenizer(tokenizer, folder) -> None:
    """The cache's copy of its tokenizer: tokenizer.json alone (the cache knows no model family; it loads the same)."""
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))


def _tokenize(documents, tokenizer, cut: Cut, folder, per_shard: int, name: str, workers, progress) -> dict:
    """The documents' records as the shards of split `name` in `folder` -> the card's "read" and "splits"."""
    sink = datasets.shard_sinks(folder, per_shard, splits=(name,))[name]
    bar = progress_bar(len(documents), f"tokenizing {name}", disable=None if progress is None else not progress)
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
    if stats.examples == 0:
        raise DataError(
            f"the {name} corpus has {stats.tokens} tokens, fewer than one example of {cut.record_length}; "
            "give more text or lower --block_size/--max_seq_length"
        )
    entry = datasets.split_entry(stats, sink.close())
    return {"read": {"documents": len(documents)}, "splits": {"train": None, "validation": None, name: entry}}
