"""The resolve stage: the run's config, mesh, lengths and batch sizes, and a checkpoint to continue with its
tokenizer (everything that can be refused before a file is written), as one frozen `Run` that no later stage changes.

spmdlm/train/run.py runs the stages in order; `--compile_for` (spmdlm/train/compile_for/aot.py) runs resolve and an
abstract state (model.py beside this file) only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from spmdlm import checkpoint, hf_export, storage
from spmdlm.data import datasets, mixture
from spmdlm.data.batch_ramp import BatchRamp, BatchStage, Extension, RampedSteps, largest_stage, plan_stages
from spmdlm.data.tokenization import TOKENIZER_LAYOUTS, from_checkpoint, load_tokenizer, tokenizer_layout
from spmdlm.engine.state import DTYPES
from spmdlm.errors import ArgumentError, RunError, TasksError
from spmdlm.families import families, get_family, load_config, load_pretrained_config
from spmdlm.families.base import Family, Generation
from spmdlm.generation.harness import task_manager
from spmdlm.generation.scoring import check_likelihood
from spmdlm.mesh import batch_axis_size, make_mesh
from spmdlm.models.attention import resolve_attention
from spmdlm.run_args import RunArgs
from spmdlm.run_args.choices import DEFAULT_MODEL_TYPE
from spmdlm.run_args.sections import ControlArgs

log = logging.getLogger("spmdlm")


def is_main() -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class Run:
    """The run as resolved (before any file is written), which no later stage changes."""

    args: RunArgs
    mesh: Mesh
    out: Path
    family: Family
    config: Any  # the model config as resolved (the tokenizer stage's Vocabulary.config adds its special token ids)
    global_batch: int  # examples per step (a batch-size ramp's final batch)
    per_device_batch: int  # examples per batch device in one micro-step (a ramp's largest: batch_sizes)
    stages: tuple[BatchStage, ...]  # the global batch of each step and how the mesh takes it (one without a ramp)
    run_start: float
    config_source: str  # the preset, file or directory the model config came from
    attention: str  # the implementation --attention resolved to (models/attention.py)
    sources: tuple[mixture.Source, ...] = ()  # a weighted mixture's (spmdlm.data.mixture); () for one corpus
    tasks: Any = None  # --eval_tasks: lm_eval's TaskManager that holds them (resolve_tasks), or None
    tokenizer: Any = None  # --model_name_or_path's own or the one given with it (check_pretrained), else None
    checkpoint_config: Any = None  # --model_name_or_path's own, where --tokenizer_name extends its vocabulary
    resume_step: int = 0  # the newest checkpoint's step, of a run found to resume (`found_to_resume`); else 0
    extensions: tuple[Extension, ...] = ()  # the changes of the run's length its resumes found, oldest first

    @property
    def ramp(self) -> BatchRamp:
        """The global batch of each step (one fixed size without --batch_size_ramp)."""
        return BatchRamp(tuple(s.first_step for s in self.stages), tuple(s.global_batch for s in self.stages))

    def schedule_length(self, total_steps: int) -> int | RampedSteps:
        """The run's length as its learning-rate schedule takes it (engine/optim.learning_rate_schedule): in final-batch
        steps when the batch ramps, after the lengths it had before a resume changed it."""
        if self.ramp.ramps or self.extensions:
            return RampedSteps(total_steps, self.ramp, self.extensions)
        return total_steps


# -- resolve: the run's config, mesh and lengths (everything that can be refused, before any file is written) ---
def resolve(args: RunArgs, run_start: float, mesh_devices=None) -> Run:
    """`mesh_devices`: the devices to build the mesh of (default: this process's JAX devices)."""
    mesh = make_mesh(args.devices.mesh, mesh_devices, dcn_spec=args.devices.dcn_mesh)
    out = storage.path(args.control.output_dir, "--output_dir")  # a local dir or a bucket (gs://)
    if out.exists() and not out.is_dir():
        raise RunError(f"--output_dir {out} is a file; give a directory")
    saved, resume_step = found_to_resume(args, out)
    stages = batch_sizes(args.control, mesh, resume_step)
    config, config_name = resolve_config(args, out)
    family = get_family(config.model_type)
    check_flags_apply(args, family)
    if args.reporting.sample_prompts and family.generation is Generation.NONE:
        raise ArgumentError(f"--sample_prompts: a {family.name} model neither generates nor fills masks; leave it out")
    tasks = resolve_tasks(args, family)
    family.check_lengths(args.objective, config)
    if args.control.training and args.optimization.learning_rate == 0:
        log.warning("--learning_rate 0: training will not change the weights (give a positive rate to train)")
    attention = choose_attention(args, family, config, mesh)
    tokenizer, checkpoint_config = None, None
    if args.model.model_name_or_path:
        tokenizer, config, checkpoint_config = check_pretrained(args, family, config)
    return Run(
        args,
        mesh,
        out,
        family,
        config,
        stages[-1].global_batch,
        largest_stage(stages).per_device,
        stages,
        run_start,
        config_name,
        attention,
        args.data.sources(),
        tasks,
        tokenizer,
        checkpoint_config,
        resume_step,
        extensions_of(args, saved, resume_step),
    )


# -- a run to resume: where it stands, for the batch stages still to run and the learning-rate schedule ---------------
def found_to_resume(args: RunArgs, out: Path) -> tuple[dict, int]:
    """-> (the run_config.json, the newest checkpoint's step) of the run a training run in `out` resumes; ({}, 0) when
    it resumes none (no checkpoint, --overwrite_output_dir; a run_config.json the output dir stage refuses)."""
    if not args.control.training or args.control.overwrite_output_dir or not (out / "checkpoints").is_dir():
        return {}, 0
    try:
        saved = json.loads((out / "run_config.json").read_text())
    except (OSError, ValueError):
        return {}, 0
    if not isinstance(saved, dict):
        return {}, 0
    return saved, max(checkpoint.make_manager(out, read_only=True).all_steps(), default=0)


def extensions_of(args: RunArgs, saved: dict, resume_step: int) -> tuple[Extension, ...]:
    """The changes of length the resumed run had (run_config.json's `lr_schedule_extensions`), and this resume as one
    more from the length it had (its `total_steps`; an earlier version's run_config.json: its --max_steps, if given),
    continued or restarted as --lr_scheduler_on_extension says. One that changes nothing is left out later
    (engine/optim.learning_rate_schedule, outputs.write_run_files)."""
    if not resume_step:
        return ()
    kept = tuple(Extension(e["at_step"], e["steps_before"]) for e in saved.get("lr_schedule_extensions") or ())
    length = saved.get("total_steps") or (saved.get("max_steps") if (saved.get("max_steps") or 0) > 0 else None)
    if not isinstance(length, int) or length < resume_step:
        return kept
    restart = args.optimization.lr_scheduler_on_extension == "restart"
    return (*kept, Extension(resume_step, length, restart))


def resolve_config(args: RunArgs, out: Path):
    """-> (the model config, where it came from): --model_name_or_path's, or a preset, a file or the output dir's."""
    if args.model.model_name_or_path:
        return load_pretrained_config(args.model.model_name_or_path), args.model.model_name_or_path
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
    return config, config_name


# -- a checkpoint to continue (--model_name_or_path): its tokenizer and weights, checked before any corpus is read -----
def check_pretrained(args: RunArgs, family: Family, config):
    """The run's tokenizer is the checkpoint's own (or --tokenizer_name's, which may extend it: the vocabulary grows)
    or a prepared dataset's; never one trained here. Then the weights are checked against the config.
    -> (the tokenizer, the config with the vocabulary it needs, the checkpoint's own config where that grew)."""
    path = storage.path(args.model.model_name_or_path, "--model_name_or_path")
    hf_export.check_vocab_size(path, config)  # an edited config.json, not the tokenizer, is then the one to blame
    own = load_tokenizer(path, family) if tokenizer_layout(path) else None
    checkpoint_config, given = None, None
    if args.model.tokenizer_name:
        tokenizer = load_tokenizer(args.model.tokenizer_name, family)
        if own is not None:
            given = f"--tokenizer_name {args.model.tokenizer_name}"
            config, checkpoint_config = extend_vocabulary(own, tokenizer, config, given, "leave --tokenizer_name out")
    elif dataset_dir := dataset_dir_of(args):
        tokenizer = load_tokenizer(datasets.tokenizer_dir(dataset_dir), family)
        if own is not None:  # the dataset's ids must mean what they meant to the checkpoint
            given = f"the tokenizer of --dataset_dir {dataset_dir}"
            config, checkpoint_config = extend_vocabulary(own, tokenizer, config, given, "prepare the dataset with it")
    elif own is not None:
        tokenizer = own
    else:
        layouts = " or ".join(" + ".join(layout) for layout in TOKENIZER_LAYOUTS)
        raise ArgumentError(
            f"--model_name_or_path {path} has no tokenizer ({layouts}); pass the tokenizer it was "
            "trained with as --tokenizer_name"
        )
    tokenizer = from_checkpoint(tokenizer, path, family, own=own, given=given)  # its token ids, for the export
    check_tokenizer_fits(tokenizer, config)
    hf_export.check_checkpoint(path, checkpoint_config or config)
    return tokenizer, config, checkpoint_config


def dataset_dir_of(args: RunArgs) -> str | None:
    """--dataset_dir, or the first mixture source's prepared dataset: whose tokenizer the run takes."""
    return args.data.dataset_dir or next((s.dataset_dir for s in args.data.sources() if s.dataset_dir), None)


def extend_vocabulary(own, tokenizer, config, given: str, fix: str):
    """The run's tokenizer (`given`: --tokenizer_name's, or a prepared dataset's) over a checkpoint with its own: it
    must keep every id of the checkpoint's (new tokens appended, as tokenizer.add_tokens does); the embedding grows
    to hold them (hf_export.grown). `fix` ends the refusal. -> (the run's config, the checkpoint's where it grew)."""
    old, new = own.get_vocab(), tokenizer.get_vocab()
    moved = sorted((i, token) for token, i in old.items() if new.get(token) != i)
    if moved:
        i, token = moved[0]
        raise ArgumentError(
            f"{given} does not extend the tokenizer of --model_name_or_path: {len(moved)} of its tokens have "
            f"other ids (e.g. {token!r}: {i} -> {new.get(token)}); give a tokenizer that keeps every old id and "
            f"appends new tokens (transformers' add_tokens), or {fix}"
        )
    if len(new) <= config.vocab_size:
        return config, None
    log.info(
        "%s extends the checkpoint's %d tokens by %d: the embedding grows from %d to %d rows, the new ones "
        "the mean of the old",
        given,
        len(old),
        len(new) - len(old),
        config.vocab_size,
        len(new),
    )
    return config.replace(vocab_size=len(new)), config


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


def batch_sizes(control: ControlArgs, mesh, resume_step: int = 0) -> tuple[BatchStage, ...]:
    """-> the run's batch stages (batch_ramp.BatchStage): examples per optimizer step over all devices, per batch
    device in one micro-step, and the micro-steps; one stage, or one per --batch_size_ramp entry (those a run resumed
    at `resume_step` has passed need not divide among this mesh's devices)."""
    if control.batch_size_ramp is not None:
        ramp, max_per_device = BatchRamp.parse(control.batch_size_ramp), control.per_device_train_batch_size
        hosts = len({device.process_index for device in mesh.devices.flat})  # (--compile_for: the slice's)
        return plan_stages(ramp, batch_axis_size(mesh), hosts, max_per_device, resume_step)
    global_batch, per_device = fixed_batch_size(control, mesh)
    return (BatchStage(0, global_batch, per_device, control.gradient_accumulation_steps),)


def fixed_batch_size(control: ControlArgs, mesh) -> tuple[int, int]:
    """-> (global batch, per-device batch) of a run without a ramp."""
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
