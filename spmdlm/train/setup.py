"""The run's context (RunContext: what the stages share) and three of its stages: resolve (config, mesh, lengths:
everything that can be refused before a file is written), the tokenizer, and the sharded state with the memory gate.

spmdlm/train/run.py runs the stages in order; `--compile_for` (spmdlm/train/aot.py) runs resolve and an abstract
state only. The data stage is spmdlm/train/corpora.py, the output dir's policy spmdlm/train/outputs.py.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdlm import devices, hf_export, storage
from spmdlm.data import datasets, mixture, pipeline, records
from spmdlm.data.objectives import Objective
from spmdlm.data.tokenization import (
    TOKENIZER_LAYOUTS,
    load_tokenizer,
    special_token_ids,
    token_byte_lengths,
    tokenizer_layout,
    train_tokenizer,
)
from spmdlm.errors import ArgumentError, RunError, TasksError
from spmdlm.families import families, get_family, load_config, load_pretrained_config
from spmdlm.families.base import Family, Generation
from spmdlm.generation.harness import task_manager
from spmdlm.generation.scoring import check_likelihood
from spmdlm.mesh import batch_axis_size, idle_axes, make_mesh
from spmdlm.models.attention import resolve_attention
from spmdlm.run_args import RunArgs
from spmdlm.run_args.choices import DEFAULT_MODEL_TYPE
from spmdlm.run_args.sections import ControlArgs
from spmdlm.train.optim import learning_rate_schedule
from spmdlm.train.plan import LayerPlan, plan_layers
from spmdlm.train.state import DTYPES, build_train_state
from spmdlm.train.step import Stepper

log = logging.getLogger("spmdlm")


@dataclasses.dataclass
class Data:
    train: records.PreparedSplit | mixture.MixedSplit | None
    validation: records.PreparedSplit | None
    # a mixture's: each source's held-out split, by name, evaluated separately (`validation` is then None)
    source_validation: dict[str, records.PreparedSplit] = dataclasses.field(default_factory=dict)

    @property
    def validation_splits(self) -> dict[str | None, records.PreparedSplit]:
        """What evaluation reads: a mixture's splits by source name, or the one corpus's under None."""
        if self.source_validation:
            return dict(self.source_validation)
        return {None: self.validation} if self.validation is not None else {}


def is_main() -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class Run:
    """The run as resolved (before any file is written), which no later stage changes."""

    args: RunArgs
    mesh: Mesh
    out: Path
    family: Family
    global_batch: int
    per_device_batch: int  # examples per batch device in one micro-step (batch_sizes)
    run_start: float
    config_source: str  # the preset, file or directory the model config came from
    attention: str  # the implementation --attention resolved to (models/attention.py)
    sources: tuple[mixture.Source, ...] = ()  # a weighted mixture's (spmdlm.data.mixture); () for one corpus
    tasks: Any = None  # --eval_tasks: lm_eval's TaskManager that holds them (resolve_tasks), or None


@dataclasses.dataclass
class RunContext:
    """What the stages of a run share: the run description (`run`, frozen) and the pieces the stages fill in
    (spmdlm/train/run.py). The description's fields read through (ctx.args, ctx.mesh, ...)."""

    run: Run
    config: Any  # the model config: the tokenizer stage sets its special token ids
    previous: dict = dataclasses.field(default_factory=dict)  # the output dir's run_config.json (outputs.py)
    resuming: bool = False
    latest_step: int = 0  # of the checkpoints found when resuming
    tokenizer: Any = None
    trained_tokenizer: bool = False
    checkpoint_config: Any = None  # --model_name_or_path's own, where --tokenizer_name extends its vocabulary
    objective: Objective | None = None
    data: Data | None = None
    dataset_cards: dict = dataclasses.field(default_factory=dict)  # prepared datasets' cards as opened, by directory
    schedule: pipeline.Schedule | None = None
    hub: Any = None  # spmdlm.train.publish.Hub: --push_to_hub's repository, on process 0 (publish.hub_for)
    layer_plan: LayerPlan | None = None  # --remat and --scan_unroll as resolved (setup_state; train/plan.py)

    args = property(lambda self: self.run.args)
    mesh = property(lambda self: self.run.mesh)
    out = property(lambda self: self.run.out)
    family = property(lambda self: self.run.family)
    global_batch = property(lambda self: self.run.global_batch)
    per_device_batch = property(lambda self: self.run.per_device_batch)
    run_start = property(lambda self: self.run.run_start)
    config_source = property(lambda self: self.run.config_source)
    attention = property(lambda self: self.run.attention)
    sources = property(lambda self: self.run.sources)
    tasks = property(lambda self: self.run.tasks)

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps if self.schedule else 0

    @property
    def training(self) -> bool:
        """Whether the run trains (it has training data once the data stage ran)."""
        return self.data is not None and self.data.train is not None

    @property
    def steps_left(self) -> bool:
        """Whether steps remain to train (not so for a finished run, or one that only evaluates)."""
        return self.training and self.latest_step < self.total_steps


# -- resolve: the run's config, mesh and lengths (everything that can be refused, before any file is written) ---
def resolve(args: RunArgs, run_start: float, mesh_devices=None) -> RunContext:
    """`mesh_devices`: the devices to build the mesh of (default: this process's JAX devices)."""
    mesh = make_mesh(args.devices.mesh, mesh_devices, dcn_spec=args.devices.dcn_mesh)
    global_batch, per_device_batch = batch_sizes(args.control, mesh)
    out = storage.path(args.control.output_dir, "--output_dir")  # a local dir or a bucket (gs://)
    if out.exists() and not out.is_dir():
        raise RunError(f"--output_dir {out} is a file; give a directory")
    if args.model.model_name_or_path:
        config = load_pretrained_config(args.model.model_name_or_path)
        config_name = args.model.model_name_or_path
    else:
        model_type = args.model.model_type or DEFAULT_MODEL_TYPE
        default = families()[model_type].default_preset if model_type in families() else model_type
        config_name = args.model.config_name or (str(out) if (out / "config.json").exists() else default)
        config = load_config(config_name, args.model.model_type)
        if not args.model.config_name and not args.uses_embedded_corpus and config_name == default:
            log.info(
                "no --config_name: using the %s preset (%s); pass --config_name for another size",
                default,
                ", ".join(
                    f"{k}={v}" for k, v in config.to_hf_dict().items() if type(v) is int and not k.endswith("token_id")
                ),
            )
        if args.model.vocab_size:
            config = config.replace(vocab_size=args.model.vocab_size)
    family = get_family(config.model_type)
    check_flags_apply(args, family)
    if args.reporting.sample_prompts and family.generation is Generation.NONE:
        raise ArgumentError(f"--sample_prompts: a {family.name} model neither generates nor fills masks; leave it out")
    tasks = resolve_tasks(args, family)
    family.check_lengths(args.objective, config)
    if args.control.training and args.optimization.learning_rate == 0:
        log.warning("--learning_rate 0: training will not change the weights (give a positive rate to train)")
    attention = choose_attention(args, family, config, mesh)
    run = Run(
        args,
        mesh,
        out,
        family,
        global_batch,
        per_device_batch,
        run_start,
        config_name,
        attention,
        args.data.sources(),
        tasks,
    )
    ctx = RunContext(run, config)
    if args.model.model_name_or_path:
        check_pretrained(ctx)
    return ctx


# -- a checkpoint to continue (--model_name_or_path): its tokenizer and weights, checked before any corpus is read -----
def check_pretrained(ctx: RunContext) -> None:
    """The run's tokenizer is the checkpoint's own (or --tokenizer_name's, which may extend it: the vocabulary grows)
    or a prepared dataset's; never one trained here. Then the weights are checked against the config."""
    args, family = ctx.args, ctx.family
    path = storage.path(args.model.model_name_or_path, "--model_name_or_path")
    own = load_tokenizer(path, family) if tokenizer_layout(path) else None
    if args.model.tokenizer_name:
        ctx.tokenizer = load_tokenizer(args.model.tokenizer_name, family)
        if own is not None:
            extend_vocabulary(ctx, own, f"--tokenizer_name {args.model.tokenizer_name}", "leave --tokenizer_name out")
    elif dataset_dir_of(ctx):
        ctx.tokenizer = load_tokenizer(datasets.tokenizer_dir(dataset_dir_of(ctx)), family)
        if own is not None:  # the dataset's ids must mean what they meant to the checkpoint
            extend_vocabulary(
                ctx, own, f"the tokenizer of --dataset_dir {dataset_dir_of(ctx)}", "prepare the dataset with it"
            )
    elif own is not None:
        ctx.tokenizer = own
    else:
        layouts = " or ".join(" + ".join(layout) for layout in TOKENIZER_LAYOUTS)
        raise ArgumentError(
            f"--model_name_or_path {path} has no tokenizer ({layouts}); pass the tokenizer it was "
            "trained with as --tokenizer_name"
        )
    check_tokenizer_fits(ctx.tokenizer, ctx.config)
    hf_export.check_checkpoint(path, ctx.checkpoint_config or ctx.config)


def dataset_dir_of(ctx: RunContext) -> str | None:
    return ctx.args.data.dataset_dir or next((s.dataset_dir for s in ctx.sources if s.dataset_dir), None)


def extend_vocabulary(ctx: RunContext, own, given: str, fix: str) -> None:
    """The run's tokenizer (`given`: --tokenizer_name's, or a prepared dataset's) over a checkpoint with its own: it
    must keep every id of the checkpoint's (new tokens appended, as tokenizer.add_tokens does); the embedding grows
    to hold them (hf_export.grown). `fix` ends the refusal."""
    old, new = own.get_vocab(), ctx.tokenizer.get_vocab()
    moved = sorted((i, token) for token, i in old.items() if new.get(token) != i)
    if moved:
        i, token = moved[0]
        raise ArgumentError(
            f"{given} does not extend the tokenizer of --model_name_or_path: {len(moved)} of its tokens have "
            f"other ids (e.g. {token!r}: {i} -> {new.get(token)}); give a tokenizer that keeps every old id and "
            f"appends new tokens (transformers' add_tokens), or {fix}"
        )
    if len(new) > ctx.config.vocab_size:
        log.info(
            "%s extends the checkpoint's %d tokens by %d: the embedding grows from %d to %d rows, the new ones "
            "the mean of the old",
            given,
            len(old),
            len(new) - len(old),
            ctx.config.vocab_size,
            len(new),
        )
        ctx.checkpoint_config, ctx.config = ctx.config, ctx.config.replace(vocab_size=len(new))


def check_tokenizer_fits(tok, config) -> None:
    if tok.get_vocab_size() > config.vocab_size:
        raise ArgumentError(
            f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
            f"{config.vocab_size}; use --vocab_size/a config with vocab_size >= "
            f"{tok.get_vocab_size()} or a smaller tokenizer"
        )


def resolve_tasks(args: RunArgs, family: Family):
    """--eval_tasks, before any work: the family scores continuations, lm-eval is installed, every task exists."""
    if not args.reporting.eval_tasks:
        return None
    try:
        check_likelihood(family)
        return task_manager(
            args.reporting.eval_tasks, [args.reporting.eval_tasks_dir] if args.reporting.eval_tasks_dir else ()
        )
    except TasksError as e:
        raise ArgumentError(f"--eval_tasks: {e}") from None


def choose_attention(args: RunArgs, family: Family, config, mesh: Mesh) -> str:
    """--attention for this run's model on its devices (those of the slice compiled for, with --compile_for)."""
    model = nnx.eval_shape(lambda: family.make_model(config, rngs=nnx.Rngs(0)))
    device = mesh.devices.flat[0]
    platform = device.platform
    try:
        chosen, note = resolve_attention(
            model,
            args.model.attention,
            platform=platform,
            dtype=DTYPES[args.model.dtype],
            training=args.control.training,
            device_kind=device.device_kind,
        )
    except ValueError as e:
        raise ArgumentError(f"--attention {args.model.attention}: {e}") from None
    if note:
        log.info("--attention %s", note)
    log.debug("attention: %s on %s", chosen, platform)
    return chosen


def check_flags_apply(args: RunArgs, family: Family) -> None:
    """An objective flag of another family (e.g. --block_size for T5) is an error, not silently ignored."""
    own = {flag.name for flag in family.flags}
    for other in families().values():
        for flag in other.flags:
            if flag.name not in own and flag.of(args.objective) != flag.default:
                raise ArgumentError(
                    f"--{flag.name} does not apply to {family.name}; its flags are "
                    f"{', '.join('--' + f.name for f in family.flags)} (the first sets the "
                    "example length)"
                )


def batch_sizes(control: ControlArgs, mesh) -> tuple[int, int]:
    """-> (global batch, per-device batch): examples per optimizer step over all devices, and per batch device in one
    micro-step."""
    per_step = batch_axis_size(mesh) * control.gradient_accumulation_steps
    if control.global_batch_size is None:
        return control.per_device_train_batch_size * per_step, control.per_device_train_batch_size
    if control.global_batch_size % per_step:
        raise ArgumentError(
            f"--global_batch_size {control.global_batch_size} is not divisible by the {batch_axis_size(mesh)} "
            f"batch devices (data x fsdp of the mesh {dict(mesh.shape)}) x {control.gradient_accumulation_steps} "
            "accumulation steps; "
            f"use a multiple of {per_step}"
        )
    return control.global_batch_size, control.global_batch_size // per_step


# -- the tokenizer ---------------------------------------------------------------------------------------------------
def setup_tokenizer(ctx: RunContext, train_docs: list[str]) -> None:
    """Given (--tokenizer_name), a checkpoint's (chosen by check_pretrained), one found in the output dir, or one
    trained here on the corpus."""
    args, out, config = ctx.args, ctx.out, ctx.config
    origin = "trained"
    if ctx.tokenizer is not None:  # --model_name_or_path's own, or the one given with it
        tok, origin = ctx.tokenizer, "model"
    elif args.model.tokenizer_name:
        tok, origin = load_tokenizer(args.model.tokenizer_name, ctx.family), "given"
    elif dataset_dir := dataset_dir_of(ctx):
        tok, origin = load_tokenizer(datasets.tokenizer_dir(dataset_dir)), "given"
    elif (out / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", out)
        tok, origin = load_tokenizer(out), "output_dir"
    else:
        vocab = args.model.vocab_size or config.vocab_size
        log.info("training a %d-token tokenizer on %d documents", vocab, len(train_docs))
        tok = train_tokenizer(ctx.family, train_docs, vocab)  # saved with run_config.json (write_run_files)
    use_tokenizer(ctx, tok)
    ctx.trained_tokenizer = origin == "trained" or (
        origin == "output_dir" and bool(ctx.previous.get("trained_tokenizer"))
    )


def use_tokenizer(ctx: RunContext, tok) -> None:
    """The run's tokenizer, checked against the model's vocabulary; the config takes its special token ids."""
    config = ctx.config
    check_tokenizer_fits(tok, config)
    fields = {f.name for f in dataclasses.fields(config)}
    ctx.config = config.replace(
        **{
            f"{k}_token_id": v
            for k, v in special_token_ids(tok, ctx.family).items()
            if v is not None and f"{k}_token_id" in fields
        }
    )
    ctx.tokenizer = tok


# -- the sharded train state -------------------------------------------------------------------------------
def setup_state(ctx: RunContext, *, abstract: bool):
    """-> (graphdef, state, stepper). `abstract`: shapes and shardings only, nothing allocated — the target a resume
    restores into (a fresh init would be a second copy) and all that compiling for another machine needs. A fresh
    state from --model_name_or_path gets that checkpoint's weights."""
    args = ctx.args
    optim, steps = args.optimization, max(ctx.total_steps, 1)
    ctx.layer_plan = choose_layer_plan(ctx)
    graphdef, state = build_train_state(
        ctx.family,
        ctx.config,
        ctx.mesh,
        optim=optim,
        total_steps=steps,
        seed=args.control.seed,
        dtype=args.model.dtype,
        remat=ctx.layer_plan.remat,
        scan_unroll=ctx.layer_plan.scan_unroll,
        attention=ctx.attention,
        abstract=abstract,
    )
    check_mesh_use(state, ctx)
    if args.model.model_name_or_path and not abstract:
        state = hf_export.load_hf_into_state(args.model.model_name_or_path, graphdef, state, ctx.checkpoint_config)
    stepper = Stepper(
        graphdef,
        state,
        ctx.mesh,
        ctx.family.forward,
        grad_accum=args.control.gradient_accumulation_steps,
        z_loss=args.optimization.z_loss,
        dropout_seed=args.control.seed,
        schedule=learning_rate_schedule(optim, steps),
        loss_chunk=args.optimization.loss_chunk_size,
        label_capacity=ctx.objective.label_capacity,
        unscored=ctx.objective.unscored_label_ids,
        optim=optim,
        byte_lengths=byte_lengths(ctx),
    )
    return graphdef, state, stepper


def byte_lengths(ctx: RunContext):
    """Each vocabulary id's UTF-8 bytes, for bits per byte; None without a tokenizer (--compile_for: the eval step
    compiles without the one gather it adds)."""
    return None if ctx.tokenizer is None else token_byte_lengths(ctx.tokenizer, ctx.config.vocab_size)


def check_mesh_use(state, ctx: RunContext) -> None:
    """A tensor axis that shards nothing only replicates the work; an idle fsdp axis is plain data parallelism."""
    idle = idle_axes(state, ctx.mesh)
    if "tensor" in idle:
        raise ArgumentError(
            f"--mesh {ctx.args.devices.mesh}: the tensor axis ({ctx.mesh.shape['tensor']}) divides none of the model's "
            "sharded dimensions (heads x head size, MLP width, vocabulary), so it would only repeat the same work; "
            "use a tensor size that divides them, or give those devices to data/fsdp"
        )
    if "fsdp" in idle:
        log.warning(
            "--mesh %s: the fsdp axis (%d) divides no parameter dimension, so parameters are replicated "
            "(plain data parallelism)",
            ctx.args.devices.mesh,
            ctx.mesh.shape["fsdp"],
        )


def choose_layer_plan(ctx: RunContext) -> LayerPlan:
    """--remat and --scan_unroll for this run (spmdlm/train/plan.py), each `auto` one said in a line."""
    args, mesh = ctx.args, ctx.mesh
    device = mesh.devices.flat[0]
    lengths = ctx.objective.sequence_lengths()
    model = nnx.eval_shape(lambda: ctx.family.make_model(ctx.config, rngs=nnx.Rngs(0)))
    plan = plan_layers(
        args.optimization.remat,
        args.optimization.scan_unroll,
        model,
        platform=device.platform,
        itemsize=jnp.dtype(DTYPES[args.model.dtype]).itemsize,
        tokens_per_device=ctx.per_device_batch * sum(lengths.values()),
        memory_bytes=devices.memory_per_device(device),
    )
    for flag, why in plan.reasons.items():
        log.info("--%s auto = %s", flag, why)
    return plan


def check_memory(stats: dict[str, Any], ctx: RunContext) -> None:
    """Refuse a step that cannot fit before running it: an out-of-memory crash (or the kernel's OOM killer) later
    says nothing about what to change."""
    need = stats.get("total_bytes", 0)
    capacity, what = devices.device_memory_bytes()
    local = jax.local_device_count()
    if not capacity or need * (local if what == "host" else 1) <= capacity:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    shared = (
        f"the host's {gib(capacity)} of RAM shared by {local} CPU devices"
        if what == "host"
        else f"the device's {gib(capacity)}"
    )
    raise RunError(
        f"the train step needs {gib(need)} per device (arguments {gib(stats.get('argument_bytes', 0))}, temporaries "
        f"{gib(stats.get('temp_bytes', 0))}) but has {shared}; try a smaller --per_device_train_batch_size (now "
        f"{ctx.per_device_batch}) or sequence length, "
        "--gradient_checkpointing, fsdp (--mesh fsdp=N), --dtype bfloat16, or a smaller --config_name"
    )
