"""The run's flags in sections, one frozen dataclass per `--help` group, each checking its own values when made (every
numeric flag's bounds, then the section's rules). Field names are the flags' names (the Hugging Face scripts')."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from spmdlm import bounds
from spmdlm.data.batch_ramp import RAMP_HELP, check_ramp
from spmdlm.data.mixture import sources_of
from spmdlm.data.readers import TEXT_DOCUMENTS, TEXT_DOCUMENTS_HELP, TEXT_FORMAT_HELP, TEXT_FORMATS
from spmdlm.errors import ArgumentError
from spmdlm.models.attention import CHOICES as ATTENTION_CHOICES
from spmdlm.optimizers import declared_flags, lr_schedules, optimizers
from spmdlm.optimizers.entries import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, Flag
from spmdlm.optimizers.schedules.wsd import DECAY_RATIO, DECAY_STEPS
from spmdlm.run_args.choices import (
    DEFAULT_MODEL_TYPE,
    FLAG_BOUNDS,
    HUB_STRATEGIES,
    REMAT_CHOICES,
    REPORT_TO,
    check_objective_flags,
    parse_scan_unroll,
)
from spmdlm.run_args.profile_window import parse_profile_steps
from spmdlm.run_args.schedule_rules import EXTENSION_HELP, check_schedule


def _field(default, help: str, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _declared(flag: Flag):
    """A field of a flag an optimizer or a schedule declares (spmdlm/optimizers)."""
    return _field(flag.default, flag.help)


def _one_of(flag: str, value, choices) -> None:
    if value not in choices:
        raise ArgumentError(f"--{flag} {value!r}: use one of {', '.join(c for c in choices if c is not None)}")


class _Section:
    """A group of flags: checked when made (every numeric flag's bounds, then the section's own rules)."""

    TITLE: ClassVar[str]  # its --help group

    def __post_init__(self):
        for field in dataclasses.fields(self):
            bounds.check(field.name, getattr(self, field.name), FLAG_BOUNDS.get(field.name))
        self.check()

    def check(self) -> None:
        """The section's own rules beyond the bounds; raises ArgumentError."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelArgs(_Section):
    """The model, its tokenizer and how it computes."""

    TITLE: ClassVar[str] = "model"

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

    def check(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ArgumentError(f"--dtype {self.dtype!r} is not supported; use float32 or bfloat16")
        _one_of("attention", self.attention, ATTENTION_CHOICES)

    def check_family(self, model_types) -> None:
        """--model_type names a registered family."""
        if self.model_type is not None and self.model_type not in model_types:
            raise ArgumentError(
                f"--model_type {self.model_type!r} is not a model family; use one of {', '.join(model_types)}"
            )


@dataclasses.dataclass(frozen=True)
class DataArgs(_Section):
    """The training and held-out text, and where its tokens are cached."""

    TITLE: ClassVar[str] = "data"

    cache_dir: str | None = _field(None, "where tokenized data is cached (default ~/.cache/spmdlm)")
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

    def check(self) -> None:
        if sum(x is not None for x in (self.train_file, self.dataset_dir, self.dataset_name, self.data_mixture)) > 1:
            raise ArgumentError("give one of --train_file, --data_mixture, --dataset_dir and --dataset_name")
        _one_of("text_documents", self.text_documents, TEXT_DOCUMENTS)
        _one_of("text_format", self.text_format, (None, *TEXT_FORMATS))
        if self.dataset_config_name and not self.dataset_name:
            raise ArgumentError("--dataset_config_name needs --dataset_name")

    @property
    def given(self) -> bool:
        """Whether any training data is named (else: the embedded corpus)."""
        return any(x is not None for x in (self.train_file, self.dataset_dir, self.dataset_name, self.data_mixture))

    def sources(self):
        """A weighted mixture's sources (--train_file with weights, or --data_mixture's file); () for one corpus."""
        return sources_of(self.train_file, self.data_mixture)

    def check_sources(self) -> None:
        """What needs the mixture's file read: a mixture takes no --validation_file."""
        if self.validation_file and self.sources():
            raise ArgumentError(
                "--validation_file does not apply to a mixture: give each source's validation_file in "
                "--data_mixture (or let each be split by --validation_split_percentage)"
            )

    @property
    def holds_out(self) -> bool:
        """Whether held-out documents can exist without training (a file, a split, or a prepared dataset)."""
        return bool(
            self.validation_file
            or self.validation_split_percentage
            or self.dataset_dir is not None
            or self.dataset_name is not None
            or self.sources()
        )


@dataclasses.dataclass(frozen=True)
class ControlArgs(_Section):
    """The output dir, what the run does, its length, batches, checkpoints and seed."""

    TITLE: ClassVar[str] = "run control"

    output_dir: str | None = _field(
        None,
        "where checkpoints, logs, metrics and the export go (default: runs/MODEL-DATA, named after the preset or "
        "config and the data, e.g. runs/roberta-tiny-fortunes)",
    )
    overwrite_output_dir: bool = _field(False, "start afresh in a non-empty output dir instead of refusing")
    allow_data_change: bool = _field(
        False,
        "resume although the training data or the tokenizer changed since the run started (run_config.json records "
        "their fingerprints): the batches from then on are those of the new data, not an uninterrupted run's",
    )
    allow_mixture_change: bool = _field(
        False,
        "resume although the mixture's sources or weights changed since the run started: it continues from the "
        "same step, the batches from then on being those the new weights give",
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
    batch_size_ramp: str | None = _field(None, RAMP_HELP)
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
    seed: int = _field(42, "seed for init, shuffling, objectives and dropout")
    dry_run: bool = _field(False, "build, compile and report the train step's compile time and memory, then stop")

    def check(self) -> None:
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise ArgumentError("--num_train_epochs must be positive (or set --max_steps)")
        check_ramp(self.batch_size_ramp, self.global_batch_size, self.gradient_accumulation_steps)

    @property
    def training(self) -> bool:
        return self.do_train is not False and not (self.do_eval and self.do_train is None)

    @property
    def evaluating(self) -> bool:
        return self.do_eval is not False and not (self.do_train and self.do_eval is None)

    @property
    def dry_running(self) -> bool:
        """--dry_run of a training run: build, compile and report the step, and write nothing."""
        return self.dry_run and self.training


@dataclasses.dataclass(frozen=True)
class ReportingArgs(_Section):
    """What is measured and logged while training, how often, and where it goes."""

    TITLE: ClassVar[str] = "reporting"

    logging_steps: int = _field(500, "log train metrics every N steps")
    eval_steps: int | None = _field(None, "evaluate every N steps (default: --logging_steps)")
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
        "a folder of local task YAMLs for --eval_tasks (lm-eval's dataset_path: json with data_files: works offline)",
    )
    eval_tasks_limit: int | None = _field(None, "at most N examples of each --eval_tasks task")
    report_to: str = _field(
        "tensorboard",
        "where metrics go besides metrics.jsonl, comma-separated: tensorboard, "
        "wandb, mlflow, or none (wandb and mlflow: pip install -e '.[wandb]' / '.[mlflow]')",
    )
    run_name: str | None = _field(None, "the run's name in the trackers (default: the output dir's name)")
    monitor_every: int = _field(0, "log the stability monitors every N steps (0 = off; docs/training.md)")
    monitor_warn_factor: float = _field(4.0, "warn when a layer's grad norm or attention logit passes F x its median")

    def check(self) -> None:
        given = [
            f"--{name}"
            for name in ("eval_tasks_steps", "eval_tasks_dir", "eval_tasks_limit")
            if getattr(self, name) is not None
        ]
        if given and not self.eval_tasks:
            raise ArgumentError(f"{', '.join(given)} apply to --eval_tasks; give the tasks to run")
        unknown = [t for t in (part.strip() for part in self.report_to.split(",")) if t not in REPORT_TO]
        if unknown:
            raise ArgumentError(
                f"--report_to {self.report_to!r}: {', '.join(unknown)} is not one of {', '.join(REPORT_TO)}"
            )

    def resolved(self) -> ReportingArgs:
        """--eval_steps defaults to --logging_steps, --sample_every to --eval_steps."""
        eval_steps = self.logging_steps if self.eval_steps is None else self.eval_steps
        return self.replace(
            eval_steps=eval_steps, sample_every=eval_steps if self.sample_every is None else self.sample_every
        )

    @property
    def targets(self) -> tuple[str, ...]:
        """The trackers of --report_to (none: only metrics.jsonl)."""
        return tuple(t for t in (part.strip() for part in self.report_to.split(",")) if t and t != "none")


@dataclasses.dataclass(frozen=True)
class OptimizationArgs(_Section):
    """The optimizer and its schedule, the loss, and what each layer keeps for its backward pass."""

    TITLE: ClassVar[str] = "optimisation"

    learning_rate: float = _field(5e-5, "peak learning rate")
    weight_decay: float = _field(
        0.0,
        "decoupled weight decay, scaled by the learning rate (not on biases and norm "
        "scales; with --optim muon only on Muon's matrices)",
    )
    # --optim's and --lr_scheduler_type's choices are the registry's (spmdlm/optimizers), listed in --help by `listing`
    optim: str | None = _field(
        None,
        "the optimizer: {} (docs/optimizers.md; default: adafactor with --adafactor, else adamw)",
        listing=lambda: ", ".join(optimizers()),
    )
    # The optimizers' and schedules' own flags older than their registry are fields, where run_config.json records
    # them (run_args.choices.SECTION_FLAGS); any other flag an entry declares is held in `entry_flags`.
    adam_beta1: float = _declared(ADAM_BETA1)
    adam_beta2: float = _declared(ADAM_BETA2)
    adam_epsilon: float = _declared(ADAM_EPSILON)
    adafactor: bool = _field(False, "= --optim adafactor (Adafactor: factored second moments), the HF scripts' flag")
    max_grad_norm: float = _field(1.0, "clip gradients to this global norm; 0 = off")
    warmup_steps: int = _field(0, "linear warmup steps")
    lr_scheduler_type: str = _field(
        "linear", "the learning rate after warmup: {} (docs/optimizers.md)", listing=lambda: " | ".join(lr_schedules())
    )
    min_lr_ratio: float = _field(
        0.0, "the floor of a decaying schedule (linear, cosine, inverse_sqrt, wsd), a fraction of --learning_rate"
    )
    lr_scheduler_on_extension: str = _field("continue", EXTENSION_HELP)
    decay_steps: int | None = _declared(DECAY_STEPS)
    decay_ratio: float | None = _declared(DECAY_RATIO)
    skip_step_on_spike: float = _field(
        0.0,
        "skip the update of a step whose loss or gradient norm is more than Z "
        "standard deviations above its running window (0 = off; decided inside the "
        "jitted step)",
    )
    spike_window: int = _field(100, "steps of the running window --skip_step_on_spike measures against")
    max_consecutive_skips: int = _field(5, "stop as a divergence (exit 3) after this many skipped steps in a row")
    ema_decay: float | None = _field(
        None,
        "keep an exponential moving average of the parameters with this decay, e.g. 0.999 (float32, sharded like "
        "them, in the checkpoint): evaluated beside them as eval_ema_*; export it with spmdlm.export --weights ema",
    )
    ema_start: int = _field(0, "the average copies the parameters up to this step and averages from the next on")
    remat: str = _field(
        "auto",
        "what each layer keeps for its backward pass: dots = its weight matmuls' outputs, the "
        "rest recomputed (less memory than none, and faster through the layer scan); "
        "dots_with_attention = also the attention probabilities; qkv = only the query, key and value "
        "projections; none = everything; full = its input only (least memory, a third more "
        "compute); auto = none with --scan_unroll per_layer where auto picks that on CPU, else dots, or "
        "full where dots would not fit (recorded in run_config.json)",
    )
    gradient_checkpointing: bool = _field(False, "= --remat full (the HF scripts' name)")
    scan_unroll: str = _field(
        "auto",
        "layers per iteration of the layer scan (jax.lax.scan's unroll); 0 = fully "
        "unrolled: slower to compile, faster steps for small encoder-decoders on CPU; auto = 0 "
        "for encoder-decoders of up to 12 layers per stack and d_model up to 256 on CPU, else 1; "
        "per_layer = unrolled with one parameter array per layer, as the HF Flax models (checkpoints stay "
        "stacked); with --remat auto, auto picks per_layer and remat none on CPU for T5 v1.1 and for RoBERTa "
        "and BART up to d_model 256, where that measured fastest (benchmarks/README.md) (recorded in "
        "run_config.json)",
    )
    z_loss: float = _field(0.0, "T5X z-loss coefficient (log-partition regulariser) for bf16 stability")
    loss_chunk_size: int = _field(
        0,
        "compute the LM loss this many positions at a time (logits recomputed in the "
        "backward pass): per-device logit memory drops from batch x length x vocab to "
        "batch x chunk x vocab; 0 = all at once",
    )
    entry_flags: Mapping[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata={"help": "the values of the entries' flags that are not fields, by name", "flag": False},
    )

    def check(self) -> None:
        known = optimizers()
        if self.optim is not None and self.optim not in known:
            raise ArgumentError(f"--optim {self.optim!r} is not supported; use one of {', '.join(known)}")
        if self.adafactor and self.optim not in (None, "adafactor"):
            raise ArgumentError(f"--adafactor means --optim adafactor, not --optim {self.optim}; give one of them")
        flags = declared_flags()
        check_objective_flags({flag.name: self.flag_value(flag) for flag in flags}, flags)
        known[self.optimizer].check(self.flags_of(known[self.optimizer]))  # a flag of another one: ignored
        check_schedule(self)
        parse_scan_unroll(self.scan_unroll)
        if self.remat not in REMAT_CHOICES:
            raise ArgumentError(f"--remat must be one of {', '.join(REMAT_CHOICES)}, got {self.remat!r}")
        if self.ema_decay is not None and known[self.optimizer].evaluation_params is not None:
            raise ArgumentError(
                f"--ema_decay with --optim {self.optimizer}: it evaluates an average of its own already; leave "
                "--ema_decay out or choose another --optim"
            )

    def check_steps(self, max_steps: int) -> None:
        """The schedule's rules against the run's length (wsd: the warmup and the final decay fit in --max_steps)."""
        schedule = lr_schedules()[self.lr_scheduler_type]
        schedule.check_steps(self.flags_of(schedule), self.warmup_steps, max_steps)

    def flag_value(self, flag: Flag):
        """The value of a flag an optimizer or a schedule declares: its field, else `entry_flags`, else its default."""
        if flag.name in self.__dataclass_fields__:
            return getattr(self, flag.name)
        return self.entry_flags.get(flag.name, flag.default)

    def flags_of(self, entry) -> dict[str, Any]:
        """An optimizer's or a schedule's own flags, by name: what its `build`, `after` and `check` read."""
        return {flag.name: self.flag_value(flag) for flag in entry.flags}

    def resolved(self) -> OptimizationArgs:
        """--optim chosen (--adafactor is its old spelling, which run_config.json keeps recording: resuming compares
        it) and --gradient_checkpointing as --remat full."""
        return self.replace(
            optim=self.optimizer,
            adafactor=self.optimizer == "adafactor",
            remat="full" if self.gradient_checkpointing else self.remat,
        )

    @property
    def optimizer(self) -> str:
        """The optimizer run: --optim, else adafactor with --adafactor, else adamw."""
        return self.optim or ("adafactor" if self.adafactor else "adamw")

    @property
    def unroll(self) -> int | None:
        """--scan_unroll: None for auto, else the layers per scan iteration (0 = fully unrolled)."""
        return parse_scan_unroll(self.scan_unroll)


@dataclasses.dataclass(frozen=True)
class DevicesArgs(_Section):
    """The device mesh, the processes of a multi-host job, and the slices --compile_for compiles for."""

    TITLE: ClassVar[str] = "mesh and hosts"

    mesh: str = _field("data=-1", "device mesh, e.g. data=8 or data=2,fsdp=2,tensor=2; one axis may be -1")
    coordinator_address: str | None = _field(None, "multi-host: host:port of process 0")
    num_processes: int | None = _field(None, "multi-host: number of processes")
    process_id: int | None = _field(None, "multi-host: this process's index")
    compile_for: str | None = _field(
        None,
        "compile the train and eval steps for a TPU slice this machine does not "
        "have (e.g. v3:2x2, v5e:16x16; needs libtpu: pip install -e '.[tpu]') and "
        "report memory, FLOPs and a roofline estimate; nothing is trained",
    )
    num_slices: int = _field(1, "with --compile_for: the number of such slices (multi-slice, joined by DCN)")
    dcn_mesh: str | None = _field(None, "multi-slice: the mesh across slices, e.g. data=2 (outside data/fsdp)")


@dataclasses.dataclass(frozen=True)
class OperationsArgs(_Section):
    """Seeing and guarding a running job: a profiler on demand, slow-step warnings, a watchdog (docs/operations.md)."""

    TITLE: ClassVar[str] = "operations: profiler, goodput, watchdog"
    HANG_TIMEOUT_MULTI_HOST_MINUTES: ClassVar[float] = 30.0  # --hang_timeout_minutes' default with several processes

    profile_steps: str | None = _field(
        None,
        "trace steps A-B (e.g. 5-7; or one step, 5) with jax.profiler on process 0, into "
        "OUTPUT_DIR/tensorboard/plugins/profile/ (TensorBoard's Profile tab, xprof); the log says how to view it",
    )
    profile_every: int | None = _field(None, "repeat the --profile_steps window every N steps")
    profile_all_hosts: bool = _field(False, "trace --profile_steps on every process, not only process 0")
    slow_step_factor: float = _field(
        3.0, "warn when a step takes more than this many times the recent median step (stragglers); 0 = off"
    )
    hang_timeout_minutes: float | None = _field(
        None,
        "when no step, save or evaluation completes for this many minutes (fractions allowed), write every "
        "thread's stack to the log and OUTPUT_DIR/hang-<host>.txt and exit (code 5) so the scheduler restarts "
        "the run from its last checkpoint; 0 = off (default: 30 with several processes, off with one)",
    )
    max_loss: float | None = _field(
        None,
        "stop as a divergence (exit 3) when 3 logged losses in a row pass this; 0 = only NaN or infinity stop the "
        "run (default: 3 x the median of the recent logged losses, at least 10 above ln(vocabulary) and the first "
        "step's loss; docs/troubleshooting.md)",
    )

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile_steps 'A-B' (or 'A'): the first and last step traced, 1 <= A <= B; None: no profile."""
        return parse_profile_steps(self.profile_steps)

    def check(self) -> None:
        window = self.profile_window
        if window is not None:
            if self.profile_every is not None and self.profile_every <= window[1] - window[0]:
                raise ArgumentError(
                    f"--profile_every {self.profile_every} must be at least the --profile_steps window "
                    f"({window[1] - window[0] + 1} steps), so one trace ends before the next starts"
                )
        elif self.profile_every is not None or self.profile_all_hosts:
            raise ArgumentError(
                "--profile_every and --profile_all_hosts apply to --profile_steps; give the steps to trace"
            )
        if 0 < self.slow_step_factor <= 1:
            raise ArgumentError(
                f"--slow_step_factor must be 0 (off) or above 1, got {self.slow_step_factor:g}: "
                "every step would be reported as slow"
            )

    def check_steps(self, max_steps: int) -> None:
        """The --profile_steps window starts within --max_steps (when given): a trace that is never taken is refused,
        not silently skipped."""
        window = self.profile_window
        if window is not None and 0 < max_steps < window[0]:
            raise ArgumentError(
                f"--profile_steps {self.profile_steps} starts after the run's last step (--max_steps {max_steps}): "
                f"no trace would be taken; give steps within 1-{max_steps}"
            )

    def hang_timeout(self, process_count: int) -> float:
        """--hang_timeout_minutes, or its default: on with several processes (a hung collective waits forever), off
        with one (nothing another host does can hang it, and a hung data read shows in the progress)."""
        if self.hang_timeout_minutes is not None:
            return self.hang_timeout_minutes
        return self.HANG_TIMEOUT_MULTI_HOST_MINUTES if process_count > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class OutputArgs(_Section):
    """The export, its model card and its upload to the Hub."""

    TITLE: ClassVar[str] = "output"

    export_hf: bool = _field(True, "export to OUTPUT_DIR/hf in transformers format at the end")
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

    def check(self) -> None:
        _one_of("hub_strategy", self.hub_strategy, HUB_STRATEGIES)
        if self.push_to_hub and not self.export_hf and self.hub_strategy == "end":
            raise ArgumentError(
                "--push_to_hub uploads the export, and --export_hf false writes none: drop "
                "--export_hf false, or upload checkpoints with --hub_strategy checkpoint"
            )


@dataclasses.dataclass(frozen=True)
class CompatArgs(_Section):
    """The HF scripts' flags that change nothing here (--token: --hub_token's other name)."""

    TITLE: ClassVar[str] = "accepted for compatibility with the HF scripts"

    use_fast_tokenizer: bool = _field(True, "accepted for compatibility (tokenizers are always fast)")
    keep_linebreaks: bool = _field(True, "accepted for compatibility (where documents end: --text_documents)")
    token: str | None = _field(None, "the HF scripts' name for --hub_token")
    trust_remote_code: bool = _field(False, "accepted for compatibility")
