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
from spmdlm.data.readers import TEXT_DOCUMENTS, TEXT_DOCUMENTS_HELP, TEXT_FORMAT_HELP, TEXT_FORMATS
from spmdlm.errors import ArgumentError, yaml_problem
from spmdlm.models.attention import CHOICES as ATTENTION_CHOICES
from spmdlm.models.layers import REMAT_POLICIES

# --remat: what each scanned layer keeps for its backward pass (the policies: models/layers.py REMAT_POLICIES); auto
# chooses one (spmdlm/train/plan.py).
REMAT_CHOICES = ("auto", *REMAT_POLICIES)
DEFAULT_MODEL_TYPE = "gpt2"  # the family of a run that names none (and of the embedded quick start)
SEED_MAX = 2**32 - 1  # --seed: Grain's shuffle and random_map take an unsigned 32-bit seed
# --optim and --lr_scheduler_type (built in spmdlm/train/optim.py; docs/optimizers.md)
OPTIMIZERS = ("adamw", "adafactor", "lion", "muon", "schedule_free_adamw")
LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "inverse_sqrt", "wsd")
DECAYING_SCHEDULES = ("linear", "cosine", "inverse_sqrt", "wsd")  # those --min_lr_ratio applies to
WSD_DECAY_RATIO = 0.1  # wsd without --decay_steps or --decay_ratio: the last 10% of the steps decay
OPTIMIZER_FLAGS = frozenset({"optim", "adafactor"})  # two spellings of one choice
SECRET_FLAGS = ("hub_token", "token")  # never written anywhere: run_config.json, trackers, the command line


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
    """--scan_unroll's value: None for auto, else the layers per scan iteration (0 = fully unrolled)."""
    if value == "auto":
        return None
    try:
        layers = int(value)
    except (TypeError, ValueError):
        layers = -1
    if layers < 0:
        raise ArgumentError(f"--scan_unroll must be auto, 0 (fully unrolled) or a positive number, got {value!r}")
    return layers


def _field(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class RunArgs:
    # -- model ---------------------------------------------------------------------------------------------------
    model_type: str | None = _field(
        None, f"model family, one of those listed above (default: the config's, else {DEFAULT_MODEL_TYPE})"
    )
    config_name: str | None = _field(
        None,
        "a preset (listed above), a JSON file, or an HF config directory "
        "(default: the family's base preset, e.g. gpt2 = 124M)",
    )
    model_name_or_path: str | None = _field(None, "initialise from a transformers checkpoint directory")
    tokenizer_name: str | None = _field(None, "a tokenizer.json file or an HF tokenizer directory; default: train one")
    vocab_size: int | None = _field(None, "vocabulary of a tokenizer trained here (default: the config's)")
    dtype: str = _field(
        "float32",
        "compute dtype: float32 or bfloat16 (parameters and optimizer stay float32); bfloat16 on GPUs and TPUs",
    )
    attention: str = _field(
        "auto",
        "attention's core: auto = the platform's fused kernel where it applies (cudnn on "
        "NVIDIA GPUs with bfloat16, splash on TPUs), else xla; xla = einsums; dot_product = "
        "jax.nn.dot_product_attention's XLA path; cudnn; splash. Resuming with another is fine",
    )
    cache_dir: str | None = _field(None, "where tokenized data is cached (default ~/.cache/spmdlm)")
    # -- data ----------------------------------------------------------------------------------------------------
    train_file: str | None = _field(
        None,
        "text (any name), json/jsonl/csv/parquet files (plain, .gz, .zst, .xz, "
        ".bz2), comma-separated, "
        "globs and directories allowed; parts ending in :WEIGHT are the sources of a "
        "weighted mixture, e.g. 'news/*.jsonl:0.6,wiki/:0.4' (weights normalised)",
    )
    data_mixture: str | None = _field(
        None,
        "a YAML file of a weighted mixture (instead of --train_file): sources: "
        "a list of {name, train_file or dataset_dir, weight, validation_file}; "
        "paths relative to the file (docs/data.md, Mixtures)",
    )
    dataset_dir: str | None = _field(
        None,
        "a dataset prepared by python -m spmdlm.prepare (instead of --train_file; "
        "its tokenizer unless --tokenizer_name)",
    )
    dataset_name: str | None = _field(
        None, "a datasets dataset (extra .[datasets]): a save_to_disk dir, parquet files, or a Hub name (streamed)"
    )
    dataset_config_name: str | None = _field(None, "the configuration of --dataset_name")
    preprocessing_num_workers: int | None = _field(
        None, "processes that tokenize --train_file/--dataset_name (default: 1; the tokenizer is multithreaded)"
    )
    text_column: str | None = _field(None, "json/jsonl/csv: the field holding the text (default: text)")
    text_documents: str = _field("line", TEXT_DOCUMENTS_HELP)
    text_format: str | None = _field(None, TEXT_FORMAT_HELP)
    validation_file: str | None = _field(None, "held-out files; default: a hash split of the training documents")
    validation_split_percentage: float = _field(5.0, "percent of training documents held out when no validation file")
    max_train_samples: int | None = _field(None, "cap on training examples (after chunking)")
    max_eval_samples: int | None = _field(None, "cap on evaluation examples (after chunking)")
    overwrite_cache: bool = _field(False, "re-tokenize even when a cache exists")
    # -- run control ---------------------------------------------------------------------------------------------
    output_dir: str | None = _field(
        None,
        "where checkpoints, logs, metrics and the export go (default: "
        "runs/MODEL-DATA, named after the preset or config and the data, e.g. "
        "runs/roberta-tiny-fortunes)",
    )
    overwrite_output_dir: bool = _field(False, "start afresh in a non-empty output dir instead of refusing")
    allow_data_change: bool = _field(
        False,
        "resume although the training data or the tokenizer changed since the run "
        "started (run_config.json records their fingerprints): the batches from then "
        "on are those of the new data, not an uninterrupted run's",
    )
    allow_mixture_change: bool = _field(
        False,
        "resume although the mixture's sources or weights changed since the "
        "run started: it continues from the same step, the batches from then on "
        "being those the new weights give",
    )
    do_train: bool | None = _field(None, "train (default: on unless only --do_eval is given)")
    do_eval: bool | None = _field(None, "evaluate (default: on unless only --do_train is given)")
    num_train_epochs: float = _field(3.0, "epochs, fractions allowed; --max_steps wins")
    max_steps: int = _field(-1, "total optimizer steps; -1 = from epochs")
    per_device_train_batch_size: int = _field(8, "examples per batch-axis device per micro-step")
    per_device_eval_batch_size: int = _field(8, "examples per batch-axis device in evaluation")
    gradient_accumulation_steps: int = _field(1, "micro-steps per optimizer step")
    global_batch_size: int | None = _field(
        None,
        "examples per optimizer step over all devices (T5X/MaxText style); "
        "overrides --per_device_train_batch_size and must divide evenly",
    )
    logging_steps: int = _field(500, "log train metrics every N steps")
    eval_steps: int | None = _field(None, "evaluate every N steps (default: --logging_steps)")
    save_steps: int = _field(500, "checkpoint every N steps")
    save_total_limit: int | None = _field(None, "keep at most N checkpoints")
    save_every_minutes: float = _field(
        0.0,
        "also checkpoint when this many minutes passed since the last save "
        "(0 = off); the step cadence of --save_steps holds besides",
    )
    keep_every_n_steps: int | None = _field(
        None, "keep the checkpoints of steps that are multiples of N forever, whatever --save_total_limit removes"
    )
    skip_step_on_spike: float = _field(
        0.0,
        "skip the update of a step whose loss or gradient norm is more than Z "
        "standard deviations above its running window (0 = off; decided inside the "
        "jitted step)",
    )
    spike_window: int = _field(100, "steps of the running window --skip_step_on_spike measures against")
    max_consecutive_skips: int = _field(5, "stop as a divergence (exit 3) after this many skipped steps in a row")
    sample_prompts: str | None = _field(
        None,
        "prompts separated by | whose continuations (greedy and one sampled; "
        "RoBERTa: fill-mask of texts with <mask>) are logged while training",
    )
    sample_every: int | None = _field(None, "log samples every N steps (default: --eval_steps)")
    eval_tasks: str | None = _field(
        None,
        "LM-harness tasks (lm-eval task names, or the `task:` of local YAMLs in "
        "--eval_tasks_dir), comma-separated, run on the model at the end and every "
        "--eval_tasks_steps (GPT-2, T5, BART; pip install 'spmdlm[eval]'; "
        "docs/harness.md)",
    )
    eval_tasks_steps: int | None = _field(None, "also run --eval_tasks every N steps (default: only at the end)")
    eval_tasks_dir: str | None = _field(
        None,
        "a directory of local task YAMLs for --eval_tasks (lm-eval's "
        "dataset_path: json with data_files: works offline)",
    )
    eval_tasks_limit: int | None = _field(None, "at most N examples of each --eval_tasks task")
    seed: int = _field(42, "seed for init, shuffling, objectives and dropout")
    # -- optimisation --------------------------------------------------------------------------------------------
    learning_rate: float = _field(5e-5, "peak learning rate")
    weight_decay: float = _field(
        0.0,
        "decoupled weight decay, scaled by the learning rate (not on biases and norm "
        "scales; with --optim muon only on Muon's matrices)",
    )
    optim: str | None = _field(
        None,
        f"the optimizer: {', '.join(OPTIMIZERS)} (docs/optimizers.md; default: adafactor with --adafactor, else adamw)",
    )
    adam_beta1: float = _field(
        0.9, "AdamW beta1; also Lion's b1, Muon's AdamW part's and schedule-free's interpolation weight"
    )
    adam_beta2: float = _field(
        0.999, "AdamW beta2; also Lion's b2 (0.99 in its paper), Muon's AdamW part's and schedule-free's"
    )
    adam_epsilon: float = _field(1e-8, "AdamW epsilon (not Lion's: it has none)")
    adafactor: bool = _field(False, "= --optim adafactor (Adafactor: factored second moments), the HF scripts' flag")
    max_grad_norm: float = _field(1.0, "clip gradients to this global norm; 0 = off")
    warmup_steps: int = _field(0, "linear warmup steps")
    lr_scheduler_type: str = _field(
        "linear", f"the learning rate after warmup: {' | '.join(LR_SCHEDULERS)} (docs/optimizers.md)"
    )
    min_lr_ratio: float = _field(
        0.0, "the floor of a decaying schedule (linear, cosine, inverse_sqrt, wsd), a fraction of --learning_rate"
    )
    decay_steps: int | None = _field(None, "wsd: the steps of the final decay (default: --decay_ratio of the steps)")
    decay_ratio: float | None = _field(
        None, f"wsd: the fraction of the steps spent decaying (default: {WSD_DECAY_RATIO})"
    )
    remat: str = _field(
        "auto",
        "what each layer keeps for its backward pass: dots = its weight matmuls' outputs, the "
        "rest recomputed (less memory than none, and faster through the layer scan); "
        "dots_with_attention = also the attention probabilities; qkv = only the query, key and value "
        "projections; none = everything; full = its input only (least memory, a third more "
        "compute); auto = dots, or full where dots would not fit (recorded in run_config.json)",
    )
    gradient_checkpointing: bool = _field(False, "= --remat full (the HF scripts' name)")
    scan_unroll: str = _field(
        "auto",
        "layers per iteration of the layer scan (jax.lax.scan's unroll); 0 = fully "
        "unrolled: slower to compile, faster steps for small encoder-decoders on CPU; auto = 0 "
        "for encoder-decoders of up to 12 layers per stack and d_model up to 256 on CPU, else 1 "
        "(recorded in run_config.json)",
    )
    z_loss: float = _field(0.0, "T5X z-loss coefficient (log-partition regulariser) for bf16 stability")
    loss_chunk_size: int = _field(
        0,
        "compute the LM loss this many positions at a time (logits recomputed in the "
        "backward pass): per-device logit memory drops from batch x length x vocab to "
        "batch x chunk x vocab; 0 = all at once",
    )
    # -- mesh and hosts ------------------------------------------------------------------------------------------
    mesh: str = _field("data=-1", "device mesh, e.g. data=8 or data=2,fsdp=2,tensor=2; one axis may be -1")
    coordinator_address: str | None = _field(None, "multi-host: host:port of process 0")
    num_processes: int | None = _field(None, "multi-host: number of processes")
    process_id: int | None = _field(None, "multi-host: this process's index")
    dry_run: bool = _field(False, "build, compile and report the train step's compile time and memory, then stop")
    compile_for: str | None = _field(
        None,
        "compile the train and eval steps for a TPU slice this machine does not "
        "have (e.g. v3:2x2, v5e:16x16; needs libtpu: pip install -e '.[tpu]') and "
        "report memory, FLOPs and a roofline estimate; nothing is trained",
    )
    num_slices: int = _field(1, "with --compile_for: the number of such slices (multi-slice, joined by DCN)")
    dcn_mesh: str | None = _field(None, "multi-slice: the mesh across slices, e.g. data=2 (outside data/fsdp)")
    # -- output --------------------------------------------------------------------------------------------------
    export_hf: bool = _field(True, "export to OUTPUT_DIR/hf in transformers format at the end")
    report_to: str = _field(
        "tensorboard",
        "where metrics go besides metrics.jsonl, comma-separated: tensorboard, "
        "wandb, mlflow, or none (wandb and mlflow: pip install -e '.[wandb]' / '.[mlflow]')",
    )
    run_name: str | None = _field(None, "the run's name in the trackers (default: the output dir's name)")
    push_to_hub: bool = _field(False, "upload the export to the Hugging Face Hub (or HF_ENDPOINT) from process 0")
    hub_model_id: str | None = _field(None, "Hub repository, user/name or name (default: the output dir's name)")
    hub_token: str | None = _field(None, "Hub token (default: HF_TOKEN or the cached huggingface-cli login)")
    hub_private_repo: bool = _field(False, "create the Hub repository private")
    hub_strategy: str = _field(
        "end",
        "when to upload: end (the export, once), every_save (the export at each "
        "checkpoint too), checkpoint (also the latest checkpoint, under last-checkpoint/)",
    )
    card_license: str | None = _field(None, "the model card's license (an SPDX-like Hub id, e.g. apache-2.0)")
    card_tags: str | None = _field(None, "extra model card tags, comma-separated")
    card_datasets: str | None = _field(None, "the model card's datasets (Hub dataset names), comma-separated")
    # accepted for command-line compatibility with the HF scripts; they change nothing here
    use_fast_tokenizer: bool = _field(True, "accepted for compatibility (tokenizers are always fast)")
    keep_linebreaks: bool = _field(True, "accepted for compatibility (where documents end: --text_documents)")
    token: str | None = _field(None, "the HF scripts' name for --hub_token")
    trust_remote_code: bool = _field(False, "accepted for compatibility")
    # the objective flags of the model families (spmdlm.data.objectives.Flag), by name: given or default
    objective: Mapping[str, Any] = dataclasses.field(default_factory=dict, metadata={"help": None})

    def replace(self, **changes) -> RunArgs:
        """A copy with `changes`, run-argument fields or objective flags by name."""
        fields = {f.name for f in dataclasses.fields(self)}
        objective = {k: v for k, v in changes.items() if k not in fields}
        if objective:
            changes = {k: v for k, v in changes.items() if k in fields}
            changes["objective"] = {**self.objective, **objective}
        return dataclasses.replace(self, **changes)

    @property
    def uses_embedded_corpus(self) -> bool:
        return (
            self.train_file is None
            and self.model_name_or_path is None
            and self.dataset_dir is None
            and self.dataset_name is None
            and self.data_mixture is None
        )

    @property
    def training(self) -> bool:
        return self.do_train is not False and not (self.do_eval and self.do_train is None)

    @property
    def dry_running(self) -> bool:
        """--dry_run of a training run: build, compile and report the step, and write nothing."""
        return self.dry_run and self.training

    @property
    def evaluating(self) -> bool:
        return self.do_eval is not False and not (self.do_train and self.do_eval is None)

    def to_json(self) -> dict[str, Any]:
        """Flat, as run_config.json records it: the objective flags beside the others."""
        out = dataclasses.asdict(self)
        for name in SECRET_FLAGS:  # never write secrets to disk
            out.pop(name)
        return {**out, **out.pop("objective")}


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
