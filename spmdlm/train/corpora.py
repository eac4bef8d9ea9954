"""The run's text, read before anything is written: the training and validation documents of the corpus or of each
mixture source (a prepared source's card checked instead), with the source named in every error about it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from spmdlm import storage
from spmdlm.data import datasets, mixture, readers
from spmdlm.errors import DataError
from spmdlm.run_args import RunArgs

log = logging.getLogger("spmdlm")


@dataclasses.dataclass
class SourceDocuments:
    """A mixture source's documents; none for a prepared dataset (tokenized already)."""

    source: mixture.Source
    train: list[str]
    validation: list[str]


def read_corpora(
    args: RunArgs, source: mixture.Source | None = None, *, need_train: bool = True
) -> tuple[list[str], list[str]]:
    """Training and validation documents (of one mixture `source`, else of the run's corpus); without a
    validation file a hash split of the training documents (or the dataset's own validation split). None with
    --dataset_dir: it is tokenized already. `need_train` False (spmdlm.evaluate): a validation file is read alone."""
    if args.data.dataset_dir:
        return [], []
    train_file, validation_file = (
        (source.train_file, source.validation_file) if source else (args.data.train_file, args.data.validation_file)
    )
    flag = source.origin if source else "--train_file"
    if validation_file and not need_train:
        return [], read_validation(args, validation_file, f"{flag} validation_file" if source else "--validation_file")
    held_out, train_files = None, ()
    if train_file or args.data.dataset_name:
        # the string as given: expand_files splits its commas (--train_file a.txt,b.txt, as --validation_file)
        corpus = readers.open_corpus(
            train_file or (),
            dataset_name=args.data.dataset_name,
            dataset_config_name=args.data.dataset_config_name,
            text_column=args.data.text_column,
            text_documents=args.data.text_documents,
            text_format=args.data.text_format,
            flag=flag,
        )
        docs, train_files = corpus.documents("train"), corpus.files
        if args.data.dataset_name and "validation" in corpus.splits and not validation_file:
            held_out = list(corpus.documents("validation"))
    else:
        log.info("no --train_file: using the embedded corpus (this Python's standard library sources)")
        docs = readers.read_embedded_corpus()
    train, split_off = [], []
    split = args.data.validation_split_percentage if held_out is None and not validation_file else 0.0
    for doc in docs:
        (split_off if split and readers.in_validation_split(doc, split) else train).append(doc)
    if validation_file:
        held_out = read_validation(
            args, validation_file, f"{flag} validation_file" if source else "--validation_file", train_files
        )
    if not train:
        raise DataError(f"the training corpus{f' of source {source.name}' if source else ''} has no text; check {flag}")
    return train, split_off if held_out is None else held_out


def read_validation(args: RunArgs, validation_file: str, flag: str, train_files=()) -> list[str]:
    """The documents of held-out files (`flag` names them in errors); a warning if they are training files too."""
    validation_files = readers.expand_files(validation_file, flag)
    warn_if_training_files(validation_files, train_files)
    return list(
        readers.read_documents(
            validation_files,
            text_column=args.data.text_column,
            text_documents=args.data.text_documents,
            text_format=args.data.text_format,
        )
    )


def read_sources(
    args: RunArgs, sources: tuple[mixture.Source, ...], *, need_train: bool = True
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
                corpora.append(SourceDocuments(source, *read_corpora(args, source, need_train=need_train)))
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
