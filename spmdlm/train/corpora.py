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

import jax
from jax.experimental import multihost_utils

from spmdlm import storage
from spmdlm.data import datasets, mixture, pipeline, readers, records, token_cache
from spmdlm.data.tokenization import special_token_ids
from spmdlm.errors import DataError, UnwritableDataError
from spmdlm.run_args.sections import DataArgs
from spmdlm.train.setup import Data, RunContext, is_main

log = logging.getLogger("spmdlm")


@dataclasses.dataclass
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
    """The documents of held-out files (`flag` names them in errors); a warning if they are training files too."""
    validation_files = readers.expand_files(validation_file, flag)
    warn_if_training_files(validation_files, train_files)
    return list(
        readers.read_documents(
            validation_files,
            text_column=data.text_column,
            text_documents=data.text_documents,
            text_format=data.text_format,
        )
    )


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


def read_documents(ctx: RunContext):
    """The documents of the run's corpus (train, validation), or each mixture source's SourceDocuments."""
    return read_sources(ctx.args.data, ctx.sources) if ctx.sources else read_corpora(ctx.args.data)


def training_texts(ctx: RunContext, documents) -> list[str]:
    """What a tokenizer trained here learns from: the training documents (of every mixture source)."""
    return [doc for corpus in documents for doc in corpus.train] if ctx.sources else documents[0]


def prepare_data(ctx: RunContext, documents) -> None:
    """The run's splits from `documents` (read_documents) with the run's tokenizer: ctx.objective, ctx.data and
    ctx.schedule."""
    if ctx.sources:
        setup_mixture_data(ctx, documents)
    else:
        setup_data(ctx, *documents)


def setup_data(ctx: RunContext, train_docs, val_docs) -> None:
    args = ctx.args
    ctx.objective = ctx.family.build_objective(args.objective, ctx.config, ctx.tokenizer)
    if args.data.dataset_dir:  # prepared by python -m spmdlm.prepare: checked against this run's tokenizer and lengths
        finish_data(ctx, *open_prepared(ctx, args.data.dataset_dir))
        return
    train = tokenize(ctx, train_docs, "train") if args.control.training else None
    finish_data(ctx, train, tokenize_validation(ctx, val_docs, bool(args.data.validation_file)))


def setup_mixture_data(ctx: RunContext, corpora: list[SourceDocuments]) -> None:
    """Each source tokenized (or opened) on its own: its own cache entry or dataset, shared by every mixture."""
    args = ctx.args
    ctx.objective = ctx.family.build_objective(args.objective, ctx.config, ctx.tokenizer)
    train, validation = [], {}
    for corpus in corpora:
        source = corpus.source
        with naming(source):
            if source.dataset_dir:
                source_train, held_out = open_prepared(ctx, source.dataset_dir)
            else:
                source_train = tokenize(ctx, corpus.train, "train") if args.control.training else None
                held_out = tokenize_validation(ctx, corpus.validation, bool(source.validation_file), source.name)
        train.append(cap_train_samples(args.data, source_train))
        if held_out is not None:
            validation[source.name] = held_out
    mixed = mixture.MixedSplit(ctx.sources, tuple(train)) if args.control.training else None
    finish_data(ctx, mixed, None, validation)


def open_prepared(ctx: RunContext, dataset_dir: str):
    """(train, validation) of a dataset prepared by python -m spmdlm.prepare, checked against this run's tokenizer
    and lengths; each only when the run trains or evaluates."""
    train, validation, card = datasets.open_dataset(
        dataset_dir, tokenizer=ctx.tokenizer, record_length=ctx.objective.record_length, mode=ctx.objective.preparation
    )
    ctx.dataset_cards[dataset_dir] = card  # what the model card describes, even if the dataset is prepared anew
    return train if ctx.args.control.training else None, validation if ctx.args.control.evaluating else None


def tokenize(ctx: RunContext, docs, name: str) -> records.PreparedSplit:
    """Documents into the token cache (keyed by their content): process 0 writes it, the others then read it."""
    args = ctx.args
    ids = special_token_ids(ctx.tokenizer, ctx.family)
    cache = storage.path(args.data.cache_dir or Path.home() / ".cache" / "spmdlm", "--cache_dir")
    common = dict(
        record_length=ctx.objective.record_length,
        separator_id=ids["eos"],
        cache_dir=cache,
        mode=ctx.objective.preparation,
        pad_id=ids.get("pad"),
        bos_id=ids.get("bos"),
        workers=args.data.preprocessing_num_workers or 1,
    )
    split = (
        token_cache.prepare_split(docs, ctx.tokenizer, name=name, overwrite_cache=args.data.overwrite_cache, **common)
        if is_main()
        else None
    )
    if jax.process_count() > 1:  # the others wait for process 0's file, then read the same cache
        multihost_utils.sync_global_devices(f"prepared {name}")
        if not is_main():
            split = token_cache.prepare_split(docs, ctx.tokenizer, name=name, overwrite_cache=False, **common)
    return split


def tokenize_validation(ctx: RunContext, docs, given: bool, source: str | None = None):
    """The held-out documents tokenized, or None: not evaluating, none held out, or a hash split too small for one
    example (a warning; a given validation file that small is an error)."""
    args = ctx.args
    if not args.control.evaluating:
        return None
    of = f" of source {source}" if source else ""
    if not docs:  # e.g. one document (--text_documents file) falls on the training side of the hash split
        if args.data.validation_split_percentage and not given:
            log.warning(
                "no evaluation%s: the held-out %.1f%% of the documents is none of them (the split is per "
                "document); give a validation file, or more documents",
                of,
                args.data.validation_split_percentage,
            )
        return None
    try:
        return tokenize(ctx, docs, "validation")
    except DataError as e:
        if given or isinstance(e, UnwritableDataError):  # a full disk is no reason to run without evaluation
            raise
        fix = "give it a validation_file" if source else "pass --validation_file"
        log.warning(
            "no evaluation%s: the held-out %.1f%% of the documents is too small (%s); raise "
            "--validation_split_percentage or %s",
            of,
            args.data.validation_split_percentage,
            e,
            fix,
        )
        return None


def cap_train_samples(data: DataArgs, train):
    """--max_train_samples: the first records of a split (of each source's, in a mixture)."""
    if train is not None and data.max_train_samples:
        return dataclasses.replace(train, num_records=min(train.num_records, data.max_train_samples))
    return train


def finish_data(ctx: RunContext, train, validation, source_validation=None) -> None:
    args = ctx.args
    train = train if isinstance(train, mixture.MixedSplit) else cap_train_samples(args.data, train)
    ctx.data = Data(train, validation, source_validation or {})
    if train is not None:
        ctx.schedule = pipeline.make_schedule(
            train.num_records, ctx.global_batch, args.control.num_train_epochs, args.control.max_steps
        )
