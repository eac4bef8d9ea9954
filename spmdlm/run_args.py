"""The run's flags: one frozen dataclass, `RunArgs`, whose fields are the launcher's flags with the Hugging Face
scripts' names, each with its default and --help text, grouped as `--help` shows them (spmdlm/config.py parses and
validates them), and the constants their choices come from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spmdlm.data.readers import TEXT_DOCUMENTS_HELP, TEXT_FORMAT_HELP
from spmdlm.models.stack import REMAT_POLICIES

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
    # -- operations: profiler, goodput, watchdog (docs/operations.md) --------------------------------------------
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
