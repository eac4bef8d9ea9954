"""`python -m spmdlm.tokenizer`: train a tokenizer on a corpus, streamed (never the whole corpus in memory).

    python -m spmdlm.tokenizer --for_model t5 --vocab_size 32100 --out TOKENIZER_DIR corpus/
    python -m spmdlm.tokenizer --kind bpe --vocab_size 50265 --for_model roberta --out DIR a.txt b.jsonl.gz

Byte-level BPE (every family but T5) or SentencePiece-style Unigram with T5's 100 sentinels, with the family's
special tokens, exactly as the launcher trains one (`spmdlm.data.tokenization.train_tokenizer`). The directory holds
tokenizer.json, tokenizer_config.json and special_tokens_map.json: `transformers.AutoTokenizer.from_pretrained(DIR)`
gives the same ids, and `python -m spmdlm.launch --tokenizer_name DIR` / `python -m spmdlm.prepare --tokenizer DIR`
use it. INPUTS as for spmdlm.prepare: files, globs or directories of txt/json/jsonl/csv/parquet, plain, .gz or .zst,
or --dataset_name.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from spmdlm import storage
from spmdlm.cli import Parser, remember
from spmdlm.data.readers import ReadStats, add_corpus_arguments, corpus_of
from spmdlm.data.records import progress_bar
from spmdlm.data.tokenization import save_tokenizer, train_tokenizer
from spmdlm.errors import ArgumentError, UserError
from spmdlm.families import families, get_family, load_config
from spmdlm.run_args.choices import DEFAULT_MODEL_TYPE

KINDS = ("bpe", "unigram")  # spmdlm.data.tokenization.train_tokenizer's
OUTPUT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def kind_of() -> dict[str, str]:
    """Each family's tokenizer kind, by model type."""
    return {name: family.tokenizer.kind for name, family in families().items()}


def model_of_kind(kind: str) -> str:
    """The family whose special tokens a tokenizer of `kind` gets when no --for_model is given: the default family
    if it uses that kind, else the first that does."""
    kinds = kind_of()
    return (
        DEFAULT_MODEL_TYPE if kinds.get(DEFAULT_MODEL_TYPE) == kind else min(n for n, k in kinds.items() if k == kind)
    )


def build_parser() -> Parser:
    kinds = kind_of()
    by_kind = {kind: ", ".join(sorted(n for n, k in kinds.items() if k == kind)) for kind in KINDS}
    parser = Parser(
        allow_abbrev=False,
        prog="python -m spmdlm.tokenizer",
        description="Train a tokenizer (HF tokenizers) on a corpus for a model family; the output directory loads "
        "with transformers.AutoTokenizer and with --tokenizer_name. See docs/data.md.",
    )
    add_corpus_arguments(parser)
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default=None,
        help=f"bpe: byte-level BPE ({by_kind['bpe']}); unigram: SentencePiece-style "
        f"({by_kind['unigram']}). Default: the model's",
    )
    parser.add_argument(
        "--for_model",
        choices=sorted(kinds),
        default=None,
        help="the family whose special tokens to add (default: "
        + ", ".join(f"{model_of_kind(k)} for {k}" for k in KINDS)
        + ")",
    )
    parser.add_argument(
        "--vocab_size",
        type=int,
        required=True,
        help="the whole vocabulary, specials included (T5: with the 100 sentinels, e.g. 32100)",
    )
    parser.add_argument("--min_frequency", type=int, default=2, help="BPE: least count of a merged pair (default 2)")
    parser.add_argument("--lowercase", action="store_true", help="lowercase the text before tokenizing")
    parser.add_argument("--out", required=True, help="directory to write the tokenizer files to")
    parser.add_argument(
        "--model_max_length",
        type=int,
        default=None,
        help="tokenizer_config.json's model_max_length (default: the family's base preset's)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    return parser


def resolve_family(kind: str | None, for_model: str | None) -> str:
    kinds = kind_of()
    if for_model is None and kind is None:
        raise ArgumentError(f"give --for_model ({', '.join(kinds)}) or --kind ({', '.join(KINDS)})")
    if for_model is None:
        return model_of_kind(kind)
    if kind is not None and kinds[for_model] != kind:
        raise ArgumentError(
            f"--kind {kind} does not fit --for_model {for_model}, which uses {kinds[for_model]}; leave out --kind"
        )
    return for_model


def _write(tok, out: Path, family, model_max_length: int, overwrite: bool) -> None:
    """Write the files into a temp dir beside `out`, then move them in (no half-written tokenizer)."""
    if storage.is_remote(out):  # each object is written whole (no rename in a bucket)
        save_tokenizer(tok, out, family, model_max_length=model_max_length)
        return
    tmp = out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        save_tokenizer(tok, tmp, family, model_max_length=model_max_length)
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        remember(parser)  # python -m's quick answer (spmdlm/cli/__init__.py)
        args = parser.parse_args(argv)
        model = resolve_family(args.kind, args.for_model)
        out = storage.path(args.out, "--out") if storage.is_url(args.out) else Path(args.out).expanduser()
        if (out / "tokenizer.json").exists() and not args.overwrite:
            raise ArgumentError(f"--out {out} already holds a tokenizer.json; pass --overwrite to replace it")
        corpus = corpus_of(args)
        family = get_family(model)
        max_length = args.model_max_length or load_config(family.default_preset, family.name).max_length
        stats = ReadStats()
        total = corpus.total_bytes
        bar = progress_bar(total, "reading", unit="B" if total else "doc")

        def texts():
            for document in corpus.documents("train", stats):
                yield document
                if stats.documents % 256 == 0:
                    bar.update((stats.bytes_read - bar.n) if total else 256)
            bar.update((stats.bytes_read - bar.n) if total else stats.documents % 256)

        with bar:
            tok = train_tokenizer(
                family,
                texts(),
                args.vocab_size,
                min_frequency=args.min_frequency,
                lowercase=args.lowercase,
                show_progress=sys.stderr.isatty(),
            )
        _write(tok, out, family, max_length, args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spmdlm.tokenizer: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(
        f"{out}: {tok.get_vocab_size()}-token {family.tokenizer.kind} tokenizer for {family.name}, trained on "
        f"{stats.documents} documents ({stats.invalid_bytes} invalid UTF-8 bytes replaced, {stats.empty_lines} "
        "empty lines skipped)"
    )
    return 0
