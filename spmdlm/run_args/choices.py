"""The choices and limits of the run's flags: the names a flag may take, every numeric flag's bounds, the families'
choices the launcher hands in, and the embedded quick start's values (spmdlm/run_args/sections.py holds the flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spmdlm import bounds
from spmdlm.bounds import Bounds
from spmdlm.data.objectives import Flag
from spmdlm.errors import ArgumentError
from spmdlm.models.hf_config import DEFAULT_MODEL_TYPE as DEFAULT_MODEL_TYPE  # the launcher's default family
from spmdlm.models.stack import PER_LAYER, REMAT_POLICIES
from spmdlm.optimizers.entries import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON
from spmdlm.optimizers.schedules.wsd import DECAY_RATIO, DECAY_STEPS

# --remat: what each scanned layer keeps for its backward pass (the policies: models/stack.py REMAT_POLICIES); auto
# chooses one (spmdlm/engine/plan.py).
REMAT_CHOICES = ("auto", *REMAT_POLICIES)
SEED_MAX = 2**32 - 1  # --seed: Grain's shuffle and random_map take an unsigned 32-bit seed
# The optimizers' and schedules' own flags (spmdlm/optimizers: --optim's and --lr_scheduler_type's choices, each
# declaring its flags) that are fields of the optimisation section: those older than the registry, kept where
# run_config.json records them. Any other flag an entry declares is held in OptimizationArgs.entry_flags.
SECTION_FLAGS = (ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, DECAY_STEPS, DECAY_RATIO)
OPTIMIZER_FLAGS = frozenset({"optim", "adafactor"})  # two spellings of one choice
SECRET_FLAGS = ("hub_token", "token")  # never written anywhere: run_config.json, trackers, the command line
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")
HUB_STRATEGIES = ("end", "every_save", "checkpoint")

# Every numeric flag's valid values (spmdlm/bounds.py: finite, within these bounds), checked by its section when the
# section is made, before anything is read or written; tests/test_config.py checks that no numeric flag is missing.
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
            "num_processes",
            "num_slices",
            "eval_tasks_steps",
            "eval_tasks_limit",
        ),
        _AT_LEAST_1,
    ),
    **dict.fromkeys(("save_every_minutes", "weight_decay"), _OFF_OR_MORE),
    **{flag.name: flag.bounds for flag in SECTION_FLAGS},
    "validation_split_percentage": Bounds(0, 100, below=True, hint="a percentage of the training documents"),
    "num_train_epochs": Bounds(0, hint="fractions allowed; or give --max_steps"),
    "max_steps": Bounds(-1, bounds.MAX_STEPS, hint="-1 = from --num_train_epochs"),
    "skip_step_on_spike": Bounds(0, hint="0 = off, else a number of standard deviations, e.g. 6"),
    "spike_window": Bounds(
        2, SPIKE_WINDOW_MAX, hint="a number of steps, e.g. 100: the window is scanned at every step"
    ),
    "seed": Bounds(0, SEED_MAX, hint="Grain's shuffle takes an unsigned 32-bit seed"),
    "learning_rate": Bounds(0, hint="a negative rate climbs the loss"),
    "max_grad_norm": Bounds(0, hint="0 = no clipping"),
    "warmup_steps": Bounds(0),
    "min_lr_ratio": Bounds(0, 1, hint="a fraction of --learning_rate"),
    "z_loss": Bounds(0, hint="0 = off, e.g. 1e-4 as T5X: a negative one rewards a large log-partition"),
    "loss_chunk_size": Bounds(0, hint="0 = all positions at once"),
    "ema_decay": Bounds(0, 1, above=True, below=True, hint="e.g. 0.999: the weight of the average so far"),
    "ema_start": Bounds(0, bounds.MAX_STEPS, hint="the step from which the average accumulates"),
    "monitor_every": Bounds(0, bounds.MAX_STEPS, hint="0 = off, else a number of steps, e.g. 100"),
    "monitor_warn_factor": Bounds(1, above=True, hint="a multiple of the recent median, e.g. 4"),
    "process_id": Bounds(0),
    # -- operations (profiler, goodput, watchdog)
    "profile_every": _AT_LEAST_1,
    "slow_step_factor": Bounds(0, hint="0 = off, else a factor above 1, e.g. 3"),
    "hang_timeout_minutes": Bounds(0, hint="0 = off; fractions allowed, e.g. 0.5 for 30 seconds"),
    "max_loss": Bounds(0, hint="0 = off: only NaN or infinity stop the run"),
}


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


def check_objective_flags(values: Mapping[str, Any], flags: tuple[Flag, ...]) -> None:
    """Each given objective flag's own rule: a numeric one's bounds (as every numeric flag's), another's check."""
    for flag in flags:
        value = values.get(flag.name, flag.default)
        bounds.check(flag.name, value, flag.bounds)
        if value is not None and not flag.check(value):
            raise ArgumentError(f"--{flag.name} {flag.rule}, got {value}")


@dataclasses.dataclass(frozen=True)
class FamilyChoices:
    """What the launcher's parser needs to know of the model families (built from the registry by
    spmdlm.cli.launch.family_choices: the run's arguments know no registry)."""

    objective_flags: tuple[Flag, ...]  # every family's objective flags (one declaration per name)
    family_flags: Mapping[str, tuple[str, ...]]  # model type -> the names of the objective flags that apply
    quickstarts: Mapping[str, Mapping[str, Any]]  # model type -> the embedded quick start's own flags
    presets: tuple[str, ...]  # --config_name presets
    default_presets: Mapping[str, str] = dataclasses.field(default_factory=dict)  # model type -> its default preset
    objectives: Mapping[str, str] = dataclasses.field(default_factory=dict)  # model type -> its objective in words


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
