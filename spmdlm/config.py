"""Run arguments with the Hugging Face scripts' names, parsed from the command line or one .json/.yaml file.

Every flag has a default that works: `python -m spmdlm.launch` with no data flags trains the default family's tiny
model on the embedded corpus (the Python standard library) with the quick-start settings (QUICKSTART_COMMON below
plus the family's own; `--model_type NAME` for the others).

The parser knows no model family: the objective flags, the family names and their quick starts are handed in as a
`FamilyChoices` (the launcher asks the family registry for them: `spmdlm.launch.parse_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from spmdlm import bounds
from spmdlm.bounds import Bounds
from spmdlm.data.mixture import name_of, sources_of
from spmdlm.data.objectives import Flag
from spmdlm.data.readers import TEXT_DOCUMENTS, TEXT_FORMATS
from spmdlm.errors import ArgumentError, yaml_problem
from spmdlm.models.attention import CHOICES as ATTENTION_CHOICES
from spmdlm.models.stack import PER_LAYER
from spmdlm.run_args import (  # noqa: F401 - re-exported: callers find the run's flags here
    DECAYING_SCHEDULES,
    DEFAULT_MODEL_TYPE,
    LR_SCHEDULERS,
    OPTIMIZER_FLAGS,
    OPTIMIZERS,
    REMAT_CHOICES,
    SECRET_FLAGS,
    SEED_MAX,
    WSD_DECAY_RATIO,
    RunArgs,
)


def check_eval_tasks(args) -> None:
    """--eval_tasks' companions (the family, lm-eval and the task names are checked in spmdlm/train/setup.py)."""
    given = [
        f"--{name}"
        for name in ("eval_tasks_steps", "eval_tasks_dir", "eval_tasks_limit")
        if getattr(args, name) is not None
    ]
    if given and not args.eval_tasks:
        raise ArgumentError(f"{', '.join(given)} apply to --eval_tasks; give the tasks to run")


def parse_scan_unroll(value: str) -> int | None:
    """--scan_unroll's value: None for auto, else the layers per scan iteration (0 = fully unrolled), or
    models.stack.PER_LAYER for per_layer (one parameter array per layer, unrolled)."""
    if value == "auto":
        return None
    if value == "per_layer":
        return PER_LAYER
    try:
        layers = int(value)
    except (TypeError, ValueError):
        layers = -1
    if layers < 0:
        raise ArgumentError(
            f"--scan_unroll must be auto, 0 (fully unrolled), per_layer or a positive number, got {value!r}"
        )
    return layers


# Every numeric flag's valid values (spmdlm/bounds.py: finite, within these bounds), checked in one place
# (`check_numbers`) before anything is read or written; tests/test_config.py checks that no numeric flag is missing.
SPIKE_WINDOW_MAX = 100_000  # its two float32 windows are scanned at every step: 2**31 steps took 16 GiB
_AT_LEAST_1, _OFF_OR_MORE = Bounds(1), Bounds(0, hint="0 = off")
FLAG_BOUNDS: Mapping[str, Bounds] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "preprocessing_num_workers",
            "max_train_samples",
            "max_eval_samples",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "global_batch_size",
            "logging_steps",
            "eval_steps",
            "save_steps",
            "save_total_limit",
            "keep_every_n_steps",
            "max_consecutive_skips",
            "sample_every",
            "decay_steps",
            "num_processes",
            "num_slices",
            "eval_tasks_steps",
            "eval_tasks_limit",
        ),
        _AT_LEAST_1,
    ),
    **dict.fromkeys(("save_every_minutes", "weight_decay"), _OFF_OR_MORE),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), Bounds(0, 1, below=True)),
    "validation_split_percentage": Bounds(0, 100, below=True, hint="a percentage of the training documents"),
    "num_train_epochs": Bounds(0, hint="fractions allowed; or give --max_steps"),
    "max_steps": Bounds(-1, bounds.MAX_STEPS, hint="-1 = from --num_train_epochs"),
    "skip_step_on_spike": Bounds(0, hint="0 = off, else a number of standard deviations, e.g. 6"),
    "spike_window": Bounds(
        2, SPIKE_WINDOW_MAX, hint="a number of steps, e.g. 100: the window is scanned at every step"
    ),
    "seed": Bounds(0, SEED_MAX, hint="Grain's shuffle takes an unsigned 32-bit seed"),
    "learning_rate": Bounds(0, hint="a negative rate climbs the loss"),
    "adam_epsilon": Bounds(
        0, above=True, hint="e.g. 1e-8: it keeps the update finite where a gradient's second moment is 0"
    ),
    "max_grad_norm": Bounds(0, hint="0 = no clipping"),
    "warmup_steps": Bounds(0),
    "min_lr_ratio": Bounds(0, 1, hint="a fraction of --learning_rate"),
    "decay_ratio": Bounds(0, 1, above=True, hint="a fraction of the steps"),
    "z_loss": Bounds(0, hint="0 = off, e.g. 1e-4 as T5X: a negative one rewards a large log-partition"),
    "loss_chunk_size": Bounds(0, hint="0 = all positions at once"),
    "process_id": Bounds(0),
}


def check_numbers(args: RunArgs) -> None:
    """The one rule of every numeric flag (spmdlm/bounds.py); the objectives' flags: check_objective_flags."""
    for field in dataclasses.fields(RunArgs):
        bounds.check(field.name, getattr(args, field.name), FLAG_BOUNDS.get(field.name))


@dataclasses.dataclass(frozen=True)
class FamilyChoices:
    """What the parser needs to know of the model families, handed in by the launcher."""

    objective_flags: tuple[Flag, ...]  # every family's objective flags (one declaration per name)
    family_flags: Mapping[str, tuple[str, ...]]  # model type -> the names of the objective flags that apply
    quickstarts: Mapping[str, Mapping[str, Any]]  # model type -> the embedded quick start's own flags
    presets: tuple[str, ...]  # --config_name presets
    default_presets: Mapping[str, str] = dataclasses.field(default_factory=dict)  # model type -> its default preset


# The embedded quick start: sized to finish on a 2-core CPU in a few minutes. Used for every flag the user did not
# give when training on the embedded corpus; each family adds its own (model size, lengths, optimizer) on top.
QUICKSTART_COMMON = dict(
    per_device_eval_batch_size=8,
    warmup_steps=30,
    logging_steps=20,
    eval_steps=100,
    save_steps=100,
    max_eval_samples=256,
    lr_scheduler_type="cosine",
)


def quickstart(choices: FamilyChoices, model_type: str) -> dict[str, Any]:
    family = choices.quickstarts.get(model_type)
    return dict(QUICKSTART_COMMON, **family) if family is not None else {}


_BOOL_TRUE, _BOOL_FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}


def _to_bool(text: str) -> bool:
    if text.lower() in _BOOL_TRUE:
        return True
    if text.lower() in _BOOL_FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line that names the problem instead of the full usage block.
        raise ArgumentError(f"{message} (python -m spmdlm.launch --help lists the flags)")


# --help groups: each starts at the named field and runs to the next group's.
HELP_GROUPS = (
    ("model", "model_type"),
    ("data", "train_file"),
    ("run control", "output_dir"),
    ("optimisation", "learning_rate"),
    ("mesh and hosts", "mesh"),
    ("output", "export_hf"),
    ("accepted for compatibility with the HF scripts", "use_fast_tokenizer"),
)


def _description(choices: FamilyChoices) -> str:
    fill = lambda text, indent="": textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent * 2)
    values = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())
    return "\n\n".join(
        [
            fill(
                "Pretrain RoBERTa (masked LM), GPT-2 (causal LM), T5 v1.1 (span corruption) or BART (denoising) on a "
                "device mesh. Flags follow the Hugging Face Flax scripts; a .json/.yaml file of flags may come first "
                "(flags after it win)."
            ),
            fill(
                "With no --train_file the run trains on the embedded corpus (this Python's standard library) with the "
                "quick-start values, which replace the defaults below for every flag not given: "
                f"{values(QUICKSTART_COMMON)}; and per family (--model_type):"
            )
            + "\n"
            + "\n".join(fill(f"{name}: {values(flags)}", "  ") for name, flags in choices.quickstarts.items()),
            fill("presets (--config_name): " + ", ".join(choices.presets)),
        ]
    )


def build_parser(choices: FamilyChoices) -> argparse.ArgumentParser:
    parser = _Parser(
        allow_abbrev=False,  # a mistyped flag is an error, never silently another flag
        prog="python -m spmdlm.launch",
        usage="%(prog)s [ARGS_FILE.json|.yaml] [--flag VALUE ...]",
        description=_description(choices),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hints = typing.get_type_hints(RunArgs)
    starts = dict((field, title) for title, field in HELP_GROUPS)
    flags = [
        (f.name, _base_type(hints[f.name]), f.default, f.metadata["help"])
        for f in dataclasses.fields(RunArgs)
        if f.name != "objective"
    ]
    objective_at = next(i for i, flag in enumerate(flags) if flag[0] == "output_dir")
    flags[objective_at:objective_at] = [(f.name, f.type, f.default, f.help) for f in choices.objective_flags]
    objective_group = choices.objective_flags[0].name
    starts[objective_group] = "objective"
    applies = "; ".join(f"{name}: {', '.join('--' + f for f in names)}" for name, names in choices.family_flags.items())
    group = parser
    for name, tp, default, help_text in flags:
        if name in starts:
            about = textwrap.fill(f"Each family's own flags ({applies}).", 100) if name == objective_group else None
            group = parser.add_argument_group(starts[name], about)
        _add_flag(group, name, tp, default, help_text)
    return parser


def _add_flag(group, name: str, tp: type, default, help_text: str) -> None:
    if "default" not in help_text and "compatibility" not in help_text and default is not None:
        help_text += f" (default: {default})"
    if tp is bool:
        # Both `--flag` and `--flag true/false` like HfArgumentParser; `--no_flag` turns it off.
        group.add_argument(
            f"--{name}", type=_to_bool, nargs="?", const=True, default=argparse.SUPPRESS, help=help_text, metavar="BOOL"
        )
        group.add_argument(
            f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    else:
        group.add_argument(f"--{name}", type=tp, default=argparse.SUPPRESS, help=help_text, metavar=tp.__name__.upper())


def _read_args_file(path: Path, known: set[str]) -> list[str]:
    """A .json/.yaml mapping of flag names to values, as command-line flags (so values get the flags' types)."""
    if not path.is_file():
        raise ArgumentError(f"argument file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ArgumentError(
            f"argument file {path} is not UTF-8 text ({e.reason} at byte {e.start}); give a "
            ".json or .yaml file of flags"
        ) from None
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ArgumentError(
            f"argument file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"argument file {path} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(values, dict):
        raise ArgumentError(f"argument file {path} must hold a mapping of flag names to values")
    unknown = sorted(set(values) - known)
    if unknown:
        raise ArgumentError(f"argument file {path}: unknown keys {', '.join(unknown)}")
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items() if v is not None]


def masked(argv: list[str]) -> list[str]:
    """A command line with the values of SECRET_FLAGS (`--hub_token X`, `--hub_token=X`) replaced by ***."""
    secret = {f"--{name}" for name in SECRET_FLAGS}
    out = []
    for i, word in enumerate(argv):
        name, equals, _ = word.partition("=")
        out.append(
            f"{name}=***"
            if equals and name in secret
            else "***"
            if i > 0 and argv[i - 1] in secret and not word.startswith("--")
            else word
        )
    return out


def mask_command_line() -> None:
    """Mask the secrets in this process's own command line, which trackers record (W&B's run files): once parsed,
    nothing here needs them from there."""
    sys.argv[1:] = masked(sys.argv[1:])
    if hasattr(sys, "orig_argv"):
        sys.orig_argv[1:] = masked(sys.orig_argv[1:])


def parse_args(argv: list[str] | None, choices: FamilyChoices) -> tuple[RunArgs, set[str]]:
    """-> (args, names given explicitly). A first argument ending in .json/.yaml is a file of flags; flags after
    it override its values."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fields = {f.name for f in dataclasses.fields(RunArgs)} - {"objective"}
    objective_flags = {flag.name: flag for flag in choices.objective_flags}
    if argv and not argv[0].startswith("-") and Path(argv[0]).suffix in (".json", ".yaml", ".yml"):
        argv = _read_args_file(Path(argv[0]), fields | set(objective_flags)) + argv[1:]
    given = vars(build_parser(choices).parse_args(argv))
    objective = {name: given.get(name, flag.default) for name, flag in objective_flags.items()}
    args = RunArgs(**{k: v for k, v in given.items() if k in fields}, objective=objective)
    if args.uses_embedded_corpus:
        defaults = quickstart(choices, args.model_type or DEFAULT_MODEL_TYPE)
        # --optim and --adafactor are one choice: either given replaces the quick start's (T5's adafactor)
        taken = set(given) | (OPTIMIZER_FLAGS if OPTIMIZER_FLAGS & set(given) else set())
        args = args.replace(**{k: v for k, v in defaults.items() if k not in taken})
    args = validate(args, choices)
    if args.output_dir is None:
        args = args.replace(output_dir=default_output_dir(args, choices.default_presets))
    return args, set(given)


def default_output_dir(args: RunArgs, default_presets: Mapping[str, str]) -> str:
    """runs/MODEL-DATA: a run named after its model (preset, config file or checkpoint) and its data, so runs of
    other models or data do not meet in one dir (the embedded quick starts: runs/gpt2-tiny-stdlib and so on)."""
    model_type = args.model_type or DEFAULT_MODEL_TYPE
    model = args.config_name or args.model_name_or_path or default_presets.get(model_type, model_type)
    return f"runs/{name_of(model)}-{_data_name(args)}"


def _data_name(args: RunArgs) -> str:
    """The data's part of a default output dir: the sources' names (at most three), or stdlib for the embedded
    corpus."""
    if args.train_file:
        sources = sources_of(args.train_file, None)
        names = [s.name for s in sources] or [name_of(part) for part in args.train_file.split(",") if part.strip()]
    else:
        named = args.data_mixture or args.dataset_dir or args.dataset_name
        names = [name_of(named)] if named else ["stdlib"]
    names = list(dict.fromkeys(names))
    return "+".join(names[:3] + ([f"{len(names) - 3}more"] if len(names) > 3 else []))


def validate(args: RunArgs, choices: FamilyChoices) -> RunArgs:
    check_numbers(args)
    check_objective_flags(args.objective, choices.objective_flags)
    if sum(x is not None for x in (args.train_file, args.dataset_dir, args.dataset_name, args.data_mixture)) > 1:
        raise ArgumentError("give one of --train_file, --data_mixture, --dataset_dir and --dataset_name")
    if args.text_documents not in TEXT_DOCUMENTS:
        raise ArgumentError(f"--text_documents {args.text_documents!r}: use one of {', '.join(TEXT_DOCUMENTS)}")
    if args.text_format not in (None, *TEXT_FORMATS):
        raise ArgumentError(f"--text_format {args.text_format!r}: use one of {', '.join(TEXT_FORMATS)}")
    sources = sources_of(args.train_file, args.data_mixture)
    if sources and args.validation_file:
        raise ArgumentError(
            "--validation_file does not apply to a mixture: give each source's validation_file in "
            "--data_mixture (or let each be split by --validation_split_percentage)"
        )
    if args.dataset_config_name and not args.dataset_name:
        raise ArgumentError("--dataset_config_name needs --dataset_name")
    if args.model_type is not None and args.model_type not in choices.quickstarts:
        raise ArgumentError(
            f"--model_type {args.model_type!r} is not a model family; use one of {', '.join(choices.quickstarts)}"
        )
    if args.dtype not in ("float32", "bfloat16"):
        raise ArgumentError(f"--dtype {args.dtype!r} is not supported; use float32 or bfloat16")
    if args.attention not in ATTENTION_CHOICES:
        raise ArgumentError(f"--attention {args.attention!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    if args.eval_steps is None:
        args = args.replace(eval_steps=args.logging_steps)
    if args.sample_every is None:
        args = args.replace(sample_every=args.eval_steps)
    check_eval_tasks(args)
    parse_scan_unroll(args.scan_unroll)
    if args.remat not in REMAT_CHOICES:
        raise ArgumentError(f"--remat must be one of {', '.join(REMAT_CHOICES)}, got {args.remat!r}")
    if args.gradient_checkpointing:
        args = args.replace(remat="full")
    args = check_optimizer(args)
    check_schedule(args)
    check_around_the_run(args)
    if (
        args.evaluating
        and not args.training
        and not args.validation_file
        and not args.validation_split_percentage
        and args.dataset_dir is None
        and args.dataset_name is None
        and not sources
    ):
        raise ArgumentError(
            "nothing to evaluate: --do_eval without training needs held-out documents; give "
            "--validation_file or a --validation_split_percentage above 0"
        )
    if args.num_train_epochs <= 0 and args.max_steps <= 0:
        raise ArgumentError("--num_train_epochs must be positive (or set --max_steps)")
    return args


def check_optimizer(args: RunArgs) -> RunArgs:
    """--optim resolved (--adafactor is its old spelling) and its betas checked."""
    if args.optim is None:
        args = args.replace(optim="adafactor" if args.adafactor else "adamw")
    elif args.optim not in OPTIMIZERS:
        raise ArgumentError(f"--optim {args.optim!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
    elif args.adafactor and args.optim != "adafactor":
        raise ArgumentError(f"--adafactor means --optim adafactor, not --optim {args.optim}; give one of them")
    if args.optim == "schedule_free_adamw" and args.adam_beta1 == 0:
        raise ArgumentError(
            "--optim schedule_free_adamw needs --adam_beta1 above 0 (its weight between the iterate and its average)"
        )
    # run_config.json's `adafactor` stays what it always meant: resuming compares it (train/outputs.py)
    return args.replace(adafactor=args.optim == "adafactor")


def check_schedule(args: RunArgs) -> None:
    """--lr_scheduler_type, and the flags only some schedules take."""
    if args.lr_scheduler_type not in LR_SCHEDULERS:
        raise ArgumentError(
            f"--lr_scheduler_type {args.lr_scheduler_type!r} is not supported; use one of {', '.join(LR_SCHEDULERS)}"
        )
    if args.min_lr_ratio and args.lr_scheduler_type not in DECAYING_SCHEDULES:
        raise ArgumentError(
            f"--min_lr_ratio applies to the decaying schedules ({', '.join(DECAYING_SCHEDULES)}), "
            f"not --lr_scheduler_type {args.lr_scheduler_type}; leave it out"
        )
    for name in ("decay_steps", "decay_ratio"):
        if getattr(args, name) is not None and args.lr_scheduler_type != "wsd":
            raise ArgumentError(
                f"--{name} applies to --lr_scheduler_type wsd only; leave it out or give --lr_scheduler_type wsd"
            )
    if args.decay_steps is not None and args.decay_ratio is not None:
        raise ArgumentError("give one of --decay_steps and --decay_ratio")
    if args.decay_steps and 0 < args.max_steps < args.warmup_steps + args.decay_steps:
        raise ArgumentError(
            f"--warmup_steps {args.warmup_steps} and --decay_steps {args.decay_steps} exceed "
            f"--max_steps {args.max_steps}; give fewer decay steps (or --decay_ratio)"
        )


def check_objective_flags(values: Mapping[str, Any], flags: tuple[Flag, ...]) -> None:
    """Each given objective flag's own rule: a numeric one's bounds (as every numeric flag's), another's check."""
    for flag in flags:
        value = values.get(flag.name, flag.default)
        bounds.check(flag.name, value, flag.bounds)
        if value is not None and not flag.check(value):
            raise ArgumentError(f"--{flag.name} {flag.rule}, got {value}")


REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")
HUB_STRATEGIES = ("end", "every_save", "checkpoint")


def report_targets(args: RunArgs) -> tuple[str, ...]:
    """The trackers of --report_to (none: only metrics.jsonl)."""
    return tuple(t for t in (part.strip() for part in args.report_to.split(",")) if t and t != "none")


def check_around_the_run(args: RunArgs) -> None:
    """Trackers, the Hub, loss spikes and checkpoint cadence."""
    unknown = [t for t in (part.strip() for part in args.report_to.split(",")) if t not in REPORT_TO]
    if unknown:
        raise ArgumentError(
            f"--report_to {args.report_to!r}: {', '.join(unknown)} is not one of {', '.join(REPORT_TO)}"
        )
    if args.hub_strategy not in HUB_STRATEGIES:
        raise ArgumentError(f"--hub_strategy {args.hub_strategy!r}: use one of {', '.join(HUB_STRATEGIES)}")
    if args.push_to_hub and not args.export_hf and args.hub_strategy == "end":
        raise ArgumentError(
            "--push_to_hub uploads the export, and --export_hf false writes none: drop "
            "--export_hf false, or upload checkpoints with --hub_strategy checkpoint"
        )
