"""The data stage: the run's text, read before anything is written (the training and validation documents of the
corpus or of each mixture source, a prepared source's card checked instead, with the source named in every error
about it); then, once the tokenizer is chosen, those documents tokenized into the token cache, or a prepared
dataset opened, as the run's train and validation splits and its step schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from spmdlm import storage
from spmdlm.data import datasets, mixture, pipeline, readers, records, token_cache
from spmdlm.data.batch_ramp import BatchRamp
from spmdlm.data.objectives import Objective
from spmdlm.data.tokenization import special_token_ids
from spmdlm.errors import DataError, UnwritableDataError
from spmdlm.families.base import Family
from spmdlm.run_args.sections import ControlArgs, DataArgs
from spmdlm.train.stages.resolve import is_main

log = logging.getLogger("spmdlm")


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the data stage reads and tokenizes with: the data section, whether the run trains and evaluates
    (`control`), and the tokenizer, family (its special tokens) and objective (the records' length and mode)."""

    data: DataArgs
    control: ControlArgs
    tokenizer: Any
    family: Family
    objective: Objective


@dataclasses.dataclass(frozen=True)
class Data:
    """The data stage's result: the objective that makes examples of the records, the training split (a mixture's:
    MixedSplit; None when the run only evaluates), the held-out split (a mixture's: each source's, by name, in
    `source_validation`, `validation` then None) and the prepared datasets' cards as opened, by directory."""

    objective: Objective
    train: records.PreparedSplit | mixture.MixedSplit | None
    validation: records.PreparedSplit | None
    source_validation: dict[str, records.PreparedSplit] = dataclasses.field(default_factory=dict)
    dataset_cards: dict = dataclasses.field(default_factory=dict)

    @property
    def validation_splits(self) -> dict[str | None, records.PreparedSplit]:
        """What evaluation reads: a mixture's splits by source name, or the one corpus's under None."""
        if self.source_validation:
            return dict(self.source_validation)
        return {None: self.validation} if self.validation is not None else {}


@dataclasses.dataclass(frozen=True)
class SourceDocuments:
    """A mixture source's documents; none for a prepared dataset (tokenized already)."""

    source: mixture.Source
    train: list[str]
    validation: list[str]


def read_corpora(
    data: DataArgs, source: mixture.Source | None = None, *, need_train: bool = True
) -> tuple[list[str], list[str]]:
    """Training and validation documents (of one mixture `source`, else of the run's corpus); without a
    validation file a hash split of the training documents (or the dataset's own validation split). None with
    --dataset_dir: it is tokenized already. `need_train` False (spmdlm.evaluate): a validation file is read alone."""
    if data.dataset_dir:
        return [], []
    train_file, validation_file = (
        (source.train_file, source.validation_file) if source else (data.train_file, data.validation_file)
    )
    flag = source.origin if source else "--train_file"
    if validation_file and not need_train:
        return [], read_validation(data, validation_file, f"{flag} validation_file" if source else "--validation_file")
    held_out, train_files = None, ()
    if train_file or data.dataset_name:
        # the string as given: expand_files splits its commas (--train_file a.txt,b.txt, as --validation_file)
        corpus = readers.open_corpus(
            train_file or (),
            dataset_name=data.dataset_name,
            dataset_config_name=data.dataset_config_name,
            text_column=data.text_column,
            text_documents=data.text_documents,
            text_format=data.text_format,
            flag=flag,
        )
        docs, train_files = corpus.documents("train"), corpus.files
        if data.dataset_name and "validation" in corpus.splits and not validation_file:
            held_out = list(corpus.documents("validation"))
    else:
        log.info("no --train_file: using the embedded corpus (this Python's standard library sources)")
        docs = readers.read_embedded_corpus()
    train, split_off = [], []
    split = data.validation_split_percentage if held_out is None and not validation_file else 0.0
    for doc in docs:
        (split_off if split and readers.in_validation_split(doc, split) else train).append(doc)
    if validation_file:
        held_out = read_validation(
            data, validation_file, f"{flag} validation_file" if source else "--validation_file", train_files
        )
    if not train:
        raise DataError(f"the training corpus{f' of source {source.name}' if source else ''} has no text; check {flag}")
    return train, split_off if held_out is None else held_out


def read_validation(data: DataArgs, validation_file: str, flag: str, train_files=()) -> list[str]:
    """The documents of held-out files (`flag` names them in errors); a warning if they are training files too.
    Held-out files with no text at all are refused: nothing could be evaluated on them."""
    validation_files = readers.expand_files(validation_file, flag)
    warn_if_training_files(validation_files, train_files)
    stats = readers.ReadStats()
    documents = list(
        readers.read_documents(
            validation_files,
            text_column=data.text_column,
            stats=stats,
            text_documents=data.text_documents,
            text_format=data.text_format,
            warn_empty=False,
        )
    )
    if not documents:
        raise DataError(f"{flag} {validation_file} is empty (no text, or only blank lines); give held-out text")
    if stats.empty_files:
        log.warning("%s: %d of its %d files hold no text; skipped", flag, stats.empty_files, stats.files)
    return documents


def read_sources(
    data: DataArgs, sources: tuple[mixture.Source, ...], *, need_train: bool = True
) -> list[SourceDocuments]:
    """Each mixture source's documents, read before anything is written (a prepared source's card is checked)."""
    corpora, tokenizers = [], {}
    for source in sources:
        if source.dataset_dir:
            with naming(source):
                card = datasets.read_card(source.dataset_dir)
            check_one_tokenizer(source, card, tokenizers)
            corpora.append(SourceDocuments(source, [], []))
        else:
            with naming(source):
                corpora.append(SourceDocuments(source, *read_corpora(data, source, need_train=need_train)))
    return corpora


@contextlib.contextmanager
def naming(source: mixture.Source):
    """A mixture source's data error names the source (its flag or --data_mixture entry)."""
    try:
        yield
    except DataError as e:
        raise DataError(str(e) if source.origin in str(e) else f"{source.origin}: {e}") from None


def check_one_tokenizer(source: mixture.Source, card: dict, seen: dict[str, mixture.Source]) -> None:
    """A mixture's prepared sources share one tokenizer (the run's): one of another than the first's is refused,
    with the fix that works for both (prepare it again with the first's tokenizer). `seen`: sha256 -> source."""
    sha = card["tokenizer"]["sha256"]
    first_sha, first = next(iter(seen.items()), (sha, source))
    seen.setdefault(sha, source)
    if sha != first_sha:
        raise DataError(
            f"{source.origin}: {source.dataset_dir} was tokenized with another tokenizer than source "
            f"{first.name}'s {first.dataset_dir}; a mixture's sources share one tokenizer: prepare it "
            f"again with --tokenizer {storage.path(first.dataset_dir) / datasets.TOKENIZER_DIR}"
        )


def warn_if_training_files(validation_files, train_files) -> None:
    """A --validation_file that is also a training file makes the evaluation measure training data: said once."""
    same = [str(f) for f in validation_files if any(readers.same_file(f, t) for t in train_files)]
    if same:
        log.warning(
            "--validation_file %s %s also in --train_file: the evaluation measures training data, not "
            "held-out text; give held-out files (or leave --validation_file out to hold out "
            "--validation_split_percentage of the documents)",
            ", ".join(same),
            "is" if len(same) == 1 else "are",
        )


def read_documents(data: DataArgs, sources: tuple[mixture.Source, ...]):
    """The documents of the run's corpus (train, validation), or each mixture source's SourceDocuments."""
    return read_sources(data, sources) if sources else read_corpora(data)


def training_texts(documents, sources: tuple[mixture.Source, ...]) -> list[str]:
    """What a tokenizer trained here learns from: the training documents (of every mixture source)."""
    return [doc for corpus in documents for doc in corpus.train] if sources else documents[0]


def prepare_data(reading: Reading, documents, sources: tuple[mixture.Source, ...] = ()) -> Data:
    """The run's splits from `documents` (read_documents; a mixture's with its `sources`), tokenized or opened as
    `reading` says."""
    if sources:
        return prepare_mixture_data(reading, documents, sources)
    if reading.data.dataset_dir:  # prepared by python -m spmdlm.prepare: checked against the tokenizer and lengths
        train, validation, card = open_prepared(reading, reading.data.dataset_dir)
        return finish_data(reading, train, validation, cards={reading.data.dataset_dir: card})
    train_docs, val_docs = documents
    train = tokenize(reading, train_docs, "train") if reading.control.training else None
    return finish_data(reading, train, tokenize_validation(reading, val_docs, bool(reading.data.validation_file)))


def prepare_mixture_data(reading: Reading, corpora: list[SourceDocuments], sources) -> Data:
    """Each source tokenized (or opened) on its own: its own cache entry or dataset, shared by every mixture."""
    train, validation, cards = [], {}, {}
    for corpus in corpora:
        source = corpus.source
        with naming(source):
            if source.dataset_dir:
                source_train, held_out, cards[source.dataset_dir] = open_prepared(reading, source.dataset_dir)
            else:
                source_train = tokenize(reading, corpus.train, "train") if reading.control.training else None
                given = bool(source.validation_file)
                held_out = tokenize_validation(reading, corpus.validation, given, source.name)
        train.append(cap_train_samples(reading.data, source_train))
        if held_out is not None:
            validation[source.name] = held_out
    mixed = mixture.MixedSplit(sources, tuple(train)) if reading.control.training else None
    return finish_data(reading, mixed, None, validation, cards)


def open_prepared(reading: Reading, dataset_dir: str):
    """(train, validation, card) of a dataset prepared by python -m spmdlm.prepare, checked against this run's
    tokenizer and lengths; each split only when the run trains or evaluates. The card is what the model card
    describes, even if the dataset is prepared anew."""
    objective = reading.objective
    train, validation, card = datasets.open_dataset(
        dataset_dir, tokenizer=reading.tokenizer, record_length=objective.record_length, mode=objective.preparation
    )
    control = reading.control
    return train if control.training else None, validation if control.evaluating else None, card


def tokenize(reading: Reading, docs, name: str) -> records.PreparedSplit:
    """Documents into the token cache (keyed by their content): process 0 writes it, the others then read it."""
    data, tok = reading.data, reading.tokenizer
    ids = special_token_ids(tok, reading.family)
    cache = storage.path(data.cache_dir or Path.home() / ".cache" / "spmdlm", "--cache_dir")
    objective = reading.objective
    cut = records.Cut(objective.record_length, ids["eos"], objective.preparation, ids.get("pad"), bos_id=ids.get("bos"))
    common = dict(cache_dir=cache, workers=data.preprocessing_num_workers or 1)
    split = (
        token_cache.prepare_split(docs, tok, cut, name=name, overwrite_cache=data.overwrite_cache, **common)
        if is_main()
        else None
    )
    if jax.process_count() > 1:  # the others wait for process 0's file, then read the same cache
        multihost_utils.sync_global_devices(f"prepared {name}")
        if not is_main():
            split = token_cache.prepare_split(docs, tok, cut, name=name, overwrite_cache=False, **common)
    return split


def tokenize_validation(reading: Reading, docs, given: bool, source: str | None = None):
    """The held-out documents tokenized, or None: not evaluating, none held out, or a hash split too small for one
    example (a warning; a given validation file that small is an error)."""
    data = reading.data
    if not reading.control.evaluating:
        return None
    of = f" of source {source}" if source else ""
    if not docs:  # e.g. one document (--text_documents file) falls on the training side of the hash split
        if data.validation_split_percentage and not given:
            log.warning(
                "no evaluation%s: the held-out %.1f%% of the documents is none of them (the split is per "
                "document); give a validation file, or more documents",
                of,
                data.validation_split_percentage,
            )
        return None
    try:
        return tokenize(reading, docs, "validation")
    except DataError as e:
        if given or isinstance(e, UnwritableDataError):  # a full disk is no reason to run without evaluation
            raise
        fix = "give it a validation_file" if source else "pass --validation_file"
        log.warning(
            "no evaluation%s: the held-out %.1f%% of the documents is too small (%s); raise "
            "--validation_split_percentage or %s",
            of,
            data.validation_split_percentage,
            e,
            fix,
        )
        return None


def cap_train_samples(data: DataArgs, train):
    """--max_train_samples: the first records of a split (of each source's, in a mixture)."""
    if train is not None and data.max_train_samples:
        return dataclasses.replace(train, num_records=min(train.num_records, data.max_train_samples))
    return train


def finish_data(reading: Reading, train, validation, source_validation=None, cards=None) -> Data:
    train = train if isinstance(train, mixture.MixedSplit) else cap_train_samples(reading.data, train)
    return Data(reading.objective, train, validation, source_validation or {}, cards or {})


def training_schedule(
    data: Data, control: ControlArgs, global_batch: int | BatchRamp, monitor_every: int = 0
) -> pipeline.Schedule | None:
    """The run's steps and epochs over its training split (None: the run only evaluates). A --monitor_every beyond a
    length from epochs is one warning (beyond --max_steps it is refused with the flags: run_args.check_monitors)."""
    if data.train is None:
        return None
    schedule = pipeline.make_schedule(data.train.num_records, global_batch, control.num_train_epochs, control.max_steps)
    if schedule.total_steps < monitor_every and is_main():
        log.warning(
            f"--monitor_every {monitor_every} is beyond the run's last step ({schedule.total_steps}, from "
            f"--num_train_epochs {control.num_train_epochs:g}): no monitor will be logged; give --monitor_every "
            f"{schedule.total_steps} or less"
        )
    return schedule
