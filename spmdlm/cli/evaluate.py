"""`python -m spmdlm.evaluate`: one evaluation for any model spmdlm can load (a run's checkpoint, an export, a
transformers directory of the four families) on held-out text, with its objective's own preprocessing, on any mesh.

    python -m spmdlm.evaluate --model_name_or_path runs/gpt2-tiny --validation_file heldout.txt [--step 500]
        [--mesh data=4] [--seed 42] [--max_eval_samples 1000] [--output_file results.json]
    python -m spmdlm.evaluate --model_name_or_path runs/gpt2-tiny --tasks my_mc,my_ppl --tasks_dir tasks/

--tasks runs LM-harness tasks (lm-eval; local task YAMLs with --tasks_dir) on the same model through our own JAX
adapter (spmdlm/generation/harness.py; docs/harness.md), with or without held-out text.

Everything but the model is the launcher's flags and code (spmdlm/train/stages/vocabulary.py and corpora.py: the
tokenizer's record and the data; spmdlm/engine/evaluation.py: the eval step and evaluation, built from what was
loaded, no run): --validation_file, --dataset_dir or
--data_mixture (each source's held-out text), the objective flags (as given, else the defaults, whatever the model),
--seed (the masks and spans: two models with one tokenizer see the same ones), --per_device_eval_batch_size.
Prints the results as JSON (and writes them to --output_file). docs/evaluation.md says what each figure counts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from spmdlm import storage
from spmdlm.cli import Parser, remember
from spmdlm.cli.launch import family_choices, setup_devices, setup_logging
from spmdlm.cli.launch import parse_args as parse_run_args
from spmdlm.engine.evaluation import byte_lengths, evaluate, held_out_of, loss_of, make_stepper
from spmdlm.errors import ArgumentError, DataError, UserError
from spmdlm.families import families
from spmdlm.families.base import Family, Generation
from spmdlm.generation.harness import harness_lm, run_tasks, task_manager
from spmdlm.load import LoadedModel, load_model
from spmdlm.mesh import batch_axis_size, make_mesh
from spmdlm.run_args import RunArgs
from spmdlm.train.reporting.metrics_log import strict_json
from spmdlm.train.safety.watchdog import Watchdog, host_label
from spmdlm.train.stages.corpora import Data, Reading, prepare_data, read_corpora, read_sources
from spmdlm.train.stages.resolve import check_flags_apply
from spmdlm.train.stages.vocabulary import Vocabulary, vocabulary_of

log = logging.getLogger("spmdlm")

# The launcher's flags the evaluator reads (and every objective flag); another given is refused, not ignored.
FLAGS = frozenset(
    {
        "model_name_or_path",
        "model_type",
        "tokenizer_name",
        "cache_dir",
        "train_file",
        "data_mixture",
        "dataset_dir",
        "dataset_name",
        "dataset_config_name",
        "preprocessing_num_workers",
        "text_column",
        "text_documents",
        "validation_file",
        "validation_split_percentage",
        "max_eval_samples",
        "overwrite_cache",
        "per_device_eval_batch_size",
        "seed",
        "mesh",
        "coordinator_address",
        "num_processes",
        "process_id",
        "hang_timeout_minutes",
    }
)
GENERATING = (Generation.DECODER_ONLY, Generation.ENCODER_DECODER)  # the families --tasks runs on
RUN_FLAGS = ("--do_train", "false", "--do_eval", "true")  # what the launcher's parser gets after the given flags
NOTE = (
    "bits_per_byte divides the summed loss by the UTF-8 bytes of the text the scored tokens stand for: it is "
    "comparable between models with different tokenizers on the same text and preprocessing; loss, perplexity "
    "and accuracy are per token of this model's tokenizer and are not"
)


def parser() -> Parser:
    p = Parser(
        prog="python -m spmdlm.evaluate",
        allow_abbrev=False,
        description="Evaluate a run's checkpoint, an export or a transformers directory on held-out text. Besides "
        "these flags it takes the launcher's data, objective, batch and mesh flags (python -m "
        "spmdlm.launch --help); --model_name_or_path names the model.",
    )
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint at this step (default: the newest good)")
    p.add_argument("--output_file", default=None, help="also write the results here (JSON); never over a file")
    p.add_argument(
        "--tasks",
        default=None,
        help="LM-harness tasks (lm-eval task names, or the `task:` of local YAMLs in --tasks_dir), comma-separated; "
        + ", ".join(name for name, f in families().items() if f.generation in GENERATING)
        + " (pip install 'spmdlm[eval]')",
    )
    p.add_argument("--tasks_dir", default=None, help="a directory of local task YAMLs for --tasks")
    p.add_argument("--tasks_limit", type=int, default=None, help="at most N examples of each task")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples per task (default: the task's)")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, RunArgs]:
    own_parser = parser()
    remember(own_parser, run_flags=list(RUN_FLAGS))  # python -m's quick answer (spmdlm/cli/__init__.py)
    own, rest = own_parser.parse_known_args(argv)
    choices = family_choices()
    args, given = parse_run_args([*rest, *RUN_FLAGS], choices)
    unused = sorted(given - FLAGS - {"do_train", "do_eval"} - {flag.name for flag in choices.objective_flags})
    if unused:
        raise ArgumentError(
            f"--{unused[0]} does not apply to python -m spmdlm.evaluate (a float32 evaluation); it "
            f"takes --step, --output_file and the launcher's {', '.join('--' + f for f in sorted(FLAGS))} "
            "and objective flags"
        )
    if not args.model.model_name_or_path:
        raise ArgumentError(
            "give --model_name_or_path: a run's --output_dir, one of its checkpoints/<step>, an "
            "export or a transformers directory"
        )
    if not (own.tasks or held_out_given(args)):
        raise ArgumentError("nothing to evaluate on: give --validation_file, --dataset_dir, --data_mixture or --tasks")
    if (own.tasks_dir or own.tasks_limit is not None or own.num_fewshot is not None) and not own.tasks:
        raise ArgumentError("--tasks_dir, --tasks_limit and --num_fewshot apply to --tasks; give the tasks to run")
    if own.tasks_dir and not storage.path(own.tasks_dir, "--tasks_dir").is_dir():
        raise ArgumentError(f"--tasks_dir {own.tasks_dir}: no such directory; give the folder of your task YAMLs")
    if own.output_file and storage.path(own.output_file, "--output_file").exists():
        raise ArgumentError(
            f"--output_file {own.output_file} exists; give a new path (results are never written over a file)"
        )
    check_output_folder(own.output_file)
    return own, args


def check_output_folder(output_file: str | None) -> None:
    """--output_file's folder exists before anything is evaluated (the results are not lost at the end)."""
    if not output_file or storage.is_remote(output_file):
        return
    folder = Path(output_file).parent
    if not folder.is_dir():
        raise ArgumentError(
            f"--output_file {output_file}: the folder {folder} does not exist; create it or give another path"
        )


def held_out_given(args: RunArgs) -> bool:
    return args.data.given or bool(args.data.validation_file)


def run(own: argparse.Namespace, args: RunArgs) -> dict[str, Any]:
    tasks = task_manager(own.tasks, [own.tasks_dir] if own.tasks_dir else ()) if own.tasks else None  # before loading
    loaded = load_model(
        args.model.model_name_or_path, make_mesh(args.devices.mesh), step=own.step, tokenizer=args.model.tokenizer_name
    )
    found = held_out(args, loaded, own) if held_out_given(args) else header(args, loaded)
    if tasks is not None:
        lm = harness_lm(
            loaded.family,
            loaded.model,
            loaded.tokenizer,
            loaded.mesh,
            seed=args.control.seed,
            batch_size=args.control.per_device_eval_batch_size * batch_axis_size(loaded.mesh),
        )
        found["tasks"] = run_tasks(
            lm, own.tasks, manager=tasks, limit=own.tasks_limit, num_fewshot=own.num_fewshot, seed=args.control.seed
        )
    return found


def header(args: RunArgs, loaded: LoadedModel) -> dict[str, Any]:
    return {
        "model": args.model.model_name_or_path,
        "kind": loaded.kind,
        "step": loaded.step,
        "model_type": loaded.config.model_type,  # as the model says: xlm-roberta, not the family roberta
        "seed": args.control.seed,
    }


def held_out(args: RunArgs, loaded: LoadedModel, own: argparse.Namespace) -> dict[str, Any]:
    """The objective's loss, perplexity, accuracy and bits per byte on the held-out text. The objective flags are
    the command line's (defaults included) whatever the model's kind: one command line gives every model the same
    preprocessing."""
    family = loaded.family
    args = args.replace(model_type=family.name)
    check_flags_apply(args, family)
    family.check_lengths(args.objective, loaded.config)
    check_tokenizer_covered(loaded)
    vocabulary = vocabulary_of(loaded.tokenizer, loaded.config, family)
    data = held_out_data(args, vocabulary, family)
    graphdef, state = nnx.split(loaded.model)
    counts = byte_lengths(vocabulary.tokenizer, vocabulary.config.vocab_size)
    stepper = make_stepper(graphdef, state, loaded.mesh, family.forward, loss_of(data.objective), counts)
    splits, max_examples = data.validation_splits, args.data.max_eval_samples
    held = held_out_of(splits, data.objective, args.control, loaded.mesh, max_examples)
    with evaluation_watchdog(args, own) as watch:
        metrics = evaluate(stepper, state, held, on_batch=lambda: watch.beat("an evaluation batch"))
    return results(args, loaded, metrics)


def check_tokenizer_covered(loaded: LoadedModel) -> None:
    """A tokenizer with more ids than the model has embedding rows cannot be evaluated with (the launcher's advice,
    a larger --vocab_size, is for training a new model)."""
    size, rows = loaded.tokenizer.get_vocab_size(), loaded.config.vocab_size
    if size > rows:
        raise ArgumentError(
            f"the tokenizer has {size} tokens but the model has {rows} (its vocab_size): ids from {rows} on have no "
            "embedding; evaluate with the model's own tokenizer (leave out --tokenizer_name) or one of at most "
            f"{rows} tokens"
        )


def evaluation_watchdog(args: RunArgs, own: argparse.Namespace) -> Watchdog:
    """The launcher's hang watchdog (--hang_timeout_minutes; docs/operations.md) over the evaluation's batches; its
    stacks go beside --output_file, else to the temporary directory (the evaluator has no output dir)."""
    folder = storage.path(own.output_file).parent if own.output_file else Path(tempfile.gettempdir())
    minutes = args.operations.hang_timeout(jax.process_count())
    return Watchdog(minutes, folder, host_label(jax.process_index()))


def held_out_data(args: RunArgs, vocabulary: Vocabulary, family: Family) -> Data:
    """The held-out text (of each mixture source) tokenized with the model's tokenizer, as the launcher does."""
    objective = family.build_objective(args.objective, vocabulary.config, vocabulary.tokenizer)
    reading = Reading(args.data, args.control, vocabulary.tokenizer, family, objective)
    sources = args.data.sources()
    if sources:
        data = prepare_data(reading, read_sources(args.data, sources, need_train=False), sources)
    else:
        data = prepare_data(reading, read_corpora(args.data, need_train=False))
    if not data.validation_splits:
        raise DataError("no held-out text to evaluate: give --validation_file (or each source's validation_file)")
    return data


def results(args: RunArgs, loaded: LoadedModel, metrics: dict[str, float]) -> dict[str, Any]:
    """The eval metrics without their eval_ prefix, each mixture source's under per_source."""
    overall = {key.removeprefix("eval_"): value for key, value in metrics.items() if key.startswith("eval_")}
    per_source: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith("eval/"):
            _, source, name = key.split("/", 2)
            per_source.setdefault(source, {})[name] = value
    return {
        **header(args, loaded),
        "objective": {flag.name: flag.of(args.objective) for flag in loaded.family.flags},
        "max_eval_samples": args.data.max_eval_samples,
        **overall,
        **({"per_source": per_source} if per_source else {}),
        "note": NOTE,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        own, args = parse(argv)
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the results
            setup_devices(args.devices)
        # the launcher's: orbax's and asyncio's records of a damaged checkpoint it falls back from are not shown
        setup_logging(stream=sys.stderr)
        found = run(own, args)
        text = strict_json(found, indent=2)
        if own.output_file:
            storage.write_atomic(storage.path(own.output_file, "--output_file"), text)
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
