"""`python -m spmdlm.prepare`: tokenize a corpus once into a dataset directory that training reads (docs/data.md).

    python -m spmdlm.prepare --tokenizer TOKENIZER_DIR --for_model gpt2 --block_size 1024 --out DATASET_DIR \
        [--workers N] [--shard_size 256M] [--validation_percentage 5] [--text_column text] INPUTS...
    python -m spmdlm.prepare ... --dataset_name NAME_OR_PATH [--dataset_config_name C] --out DATASET_DIR

INPUTS are files, globs or directories of txt / json / jsonl / csv / parquet, plain, .gz or .zst. The result:

    DATASET_DIR/dataset.json                  the card: inputs, tokenizer, lengths, counts, shards and hashes
    DATASET_DIR/train-00000.tokens ...        fixed-length int32 records back to back, `records_per_shard` per file
    DATASET_DIR/validation-00000.tokens ...   the documents held out by hash (or the dataset's own split)
    DATASET_DIR/tokenizer/                    the tokenizer (for --tokenizer_name; AutoTokenizer loads it)

The records are those of the launcher's `--train_file` cache, which is a dataset directory of the same format
(`spmdlm.data.token_cache`), the same bytes whatever `--workers`. A second run with unchanged inputs (path, size,
mtime and a hash of samples of each file) and settings does nothing. Everything is written to a temp dir next to
DATASET_DIR and renamed at the end: an interrupted or failed run (a full disk) leaves no dataset that looks
complete. Training: `python -m spmdlm.launch --dataset_dir DATASET_DIR ...` (see
`spmdlm.data.datasets.open_dataset`). This module is the command line (`python -m spmdlm.prepare` runs it); the
dataset directory is written by `spmdlm.data.datasets.prepare_dataset`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys

from spmdlm import storage
from spmdlm.cli import Parser, bounds_of, remember
from spmdlm.data.datasets import DEFAULT_SHARD_BYTES, ForModel, prepare_dataset
from spmdlm.data.readers import add_corpus_arguments, corpus_of
from spmdlm.data.records import Cut
from spmdlm.data.tokenization import load_tokenizer, special_token_ids
from spmdlm.errors import ArgumentError, UserError
from spmdlm.families import families, get_family, load_config, objective_flags
from spmdlm.run_args.choices import check_objective_flags


def parse_size(text: str) -> int:
    """'256M', '1G', '65536', '100K' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 256M, 1G or 65536")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


# -- the objective: record length and mode, as the launcher computes them ---------------------------------------------


def resolve_objective(for_model: str, tokenizer, flags: dict, config_name: str | None = None):
    """(family, objective, applicable flags) for the flags given, exactly as the launcher builds them: the same
    objective flags, the family's check_lengths and build_objective (the record length and preparation mode come from
    it)."""
    family = get_family(for_model)
    given = {k: v for k, v in flags.items() if v is not None and v is not False}
    own = [flag.name for flag in family.flags]
    foreign = [k for k in given if k not in own]
    if foreign:
        raise ArgumentError(
            f"--{foreign[0]} does not apply to {family.name}; its flags: {', '.join('--' + f for f in own)}"
        )
    check_objective_flags(given, family.flags)
    config = load_config(config_name or family.default_preset, family.name)
    family.check_lengths(given, config)
    objective = family.build_objective(given, config, tokenizer)
    applicable = {flag.name: flag.of(given) for flag in family.flags}
    return family, objective, applicable, config


# -- command line ------------------------------------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(
        allow_abbrev=False,
        prog="python -m spmdlm.prepare",
        description="Tokenize a corpus once into sharded fixed-length records (a dataset directory) for "
        "python -m spmdlm.launch --dataset_dir. See docs/data.md.",
    )
    add_corpus_arguments(parser)
    parser.add_argument(
        "--tokenizer",
        "--tokenizer_name",
        dest="tokenizer",
        required=True,
        help="tokenizer.json, an HF tokenizer dir, or a SentencePiece spiece.model",
    )
    parser.add_argument(
        "--for_model",
        required=True,
        choices=sorted(families()),
        help="the model family whose objective the records serve",
    )
    parser.add_argument("--out", required=True, help="the dataset directory to write")
    parser.add_argument(
        "--config_name",
        default=None,
        help="model config for default lengths and checks (default: the family's base preset)",
    )
    group = parser.add_argument_group("objective (the family's flags, as python -m spmdlm.launch takes them)")
    for flag in objective_flags():
        if flag.type is bool:
            group.add_argument(f"--{flag.name}", action="store_true", default=False, help=flag.help)
        else:
            group.add_argument(f"--{flag.name}", type=flag.type, default=None, help=flag.help)
    _add_writing_arguments(parser)
    return parser


def _add_writing_arguments(parser: argparse.ArgumentParser) -> None:
    """What is written and how fast: the validation split, workers, shard size, overwrite, the tokenizer copy."""
    parser.add_argument(
        "--validation_percentage",
        "--validation_split_percentage",
        dest="validation_percentage",
        type=float,
        default=5.0,
        help="percent of documents held out by hash (default 5; 0: none); a dataset's own "
        "validation split is used instead when it has one",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (default: the CPUs available; 1: in this process)",
    )
    parser.add_argument(
        "--shard_size",
        type=parse_size,
        default=DEFAULT_SHARD_BYTES,
        help="bytes of records per shard file, e.g. 256M (default), 1G",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset of other inputs or settings")
    parser.add_argument(
        "--model_max_length",
        type=int,
        default=None,
        help="model_max_length of the tokenizer copy (default: the config's)",
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
    )
    try:
        parser = build_parser()
        # python -m's quick answer (spmdlm/cli/__init__.py), with the objective flags' bounds
        remember(parser, bounds=bounds_of({flag.name: flag.bounds for flag in objective_flags()}))
        args = parser.parse_args(argv)
        if args.workers is not None and args.workers < 1:
            raise ArgumentError(f"--workers {args.workers}: give 1 or more")
        if not 0 <= args.validation_percentage < 100:
            raise ArgumentError(f"--validation_percentage {args.validation_percentage}: give a value in [0, 100)")
        corpus = corpus_of(args)
        tokenizer = load_tokenizer(args.tokenizer)
        flags = {flag.name: getattr(args, flag.name) for flag in objective_flags()}
        family, objective, applicable, config = resolve_objective(args.for_model, tokenizer, flags, args.config_name)
        ids = special_token_ids(tokenizer, family)
        cut = Cut(
            objective.record_length,
            ids["eos"],
            objective.preparation,
            ids.get("pad"),
            args.validation_percentage,
            bos_id=ids.get("bos"),
        )
        card = prepare_dataset(
            corpus,
            args.out,
            cut,
            ForModel(family, tokenizer, applicable, args.model_max_length or config.max_length),
            workers=args.workers,
            shard_bytes=args.shard_size,
            overwrite=args.overwrite,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is not writable: the OS says what and where
        print(f"error: {storage.os_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spmdlm.prepare: interrupted; nothing was written", file=sys.stderr)
        return 130
    train, validation = card["splits"]["train"], card["splits"].get("validation")
    print(
        f"{args.out}: {train['examples']} train examples of {card['record_length']} tokens in "
        f"{len(train['shards'])} shard(s)"
        + (f", {validation['examples']} validation examples" if validation else ", no validation split")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
