"""The tokenizer stage: the run's tokenizer (given, a checkpoint's, one found in the output dir, or one trained here
on the corpus) and the model config with its special token ids, as one frozen `Vocabulary`. python -m
spmdlm.evaluate makes the same record of the model it loaded (`vocabulary_of`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from spmdlm.data import datasets
from spmdlm.data.tokenization import load_tokenizer, special_token_ids, train_tokenizer
from spmdlm.families.base import Family
from spmdlm.train.stages.resolve import Run, check_tokenizer_fits, dataset_dir_of

log = logging.getLogger("spmdlm")


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The run's tokenizer and the model config as every later stage reads it (its special token ids the
    tokenizer's); `trained`: the tokenizer was trained on the corpus (by this run or the one it resumes)."""

    tokenizer: Any
    config: Any
    trained: bool = False


def setup_tokenizer(run: Run, previous: dict, train_docs: list[str]) -> Vocabulary:
    """Given (--tokenizer_name), a checkpoint's (chosen by check_pretrained), one found in the output dir (`previous`:
    the run_config.json of the run that left it), or one trained here on the corpus."""
    args, out, config = run.args, run.out, run.config
    origin = "trained"
    if run.tokenizer is not None:  # --model_name_or_path's own, or the one given with it
        tok, origin = run.tokenizer, "model"
    elif args.model.tokenizer_name:
        tok, origin = load_tokenizer(args.model.tokenizer_name, run.family), "given"
    elif dataset_dir := dataset_dir_of(args):
        tok, origin = load_tokenizer(datasets.tokenizer_dir(dataset_dir)), "given"
    elif (out / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", out)
        tok, origin = load_tokenizer(out), "output_dir"
    else:
        vocab = args.model.vocab_size or config.vocab_size
        log.info("training a %d-token tokenizer on %d documents", vocab, len(train_docs))
        tok = train_tokenizer(run.family, train_docs, vocab)  # saved with run_config.json (write_run_files)
    trained = origin == "trained" or (origin == "output_dir" and bool(previous.get("trained_tokenizer")))
    return vocabulary_of(tok, config, run.family, trained=trained)


def vocabulary_of(tok, config, family: Family, *, trained: bool = False) -> Vocabulary:
    """`tok` checked against the model's vocabulary; the config takes its special token ids."""
    check_tokenizer_fits(tok, config)
    fields = {f.name for f in dataclasses.fields(config)}
    config = config.replace(
        **{
            f"{k}_token_id": v
            for k, v in special_token_ids(tok, family).items()
            if v is not None and f"{k}_token_id" in fields
        }
    )
    return Vocabulary(tok, config, trained)
