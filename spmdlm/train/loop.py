"""One training loop for every family: named stages that pass one RunContext.

resolve (config, mesh, lengths) -> check/prepare the output dir -> tokenizer -> objective and data -> sharded state
-> train (or restore) -> evaluate -> finish (results, export). See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdlm import checkpoint, storage
from spmdlm.config import ArgumentError, RunArgs
from spmdlm.data import pipeline, sources
from spmdlm.data.tokenizer import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer
from spmdlm.families import FAMILIES, get_family, load_config
from spmdlm.families.base import Family
from spmdlm.mesh import batch_axis_size, idle_axes, make_mesh
from spmdlm.train.optim import OptimConfig, learning_rate_schedule, make_optimizer
from spmdlm.train.guard import LOCK_NAME, Preempted, RunLock, StopOnSignal
from spmdlm.train.report import Reporter, write_json
from spmdlm.train.step import Stepper, create_train_state

log = logging.getLogger("spmdlm")

# Run arguments that must match for a run to resume in the same output dir, besides the model config, the global
# batch and the family's own (its objective's flags). Others may change: logging cadence, the mesh (the state is
# restored into the new shardings), or the step budget (which also stretches the learning-rate schedule).
# The model type is compared through the model config. The learning rate, its schedule and warmup may change: the
# change is logged.
COMMON_RESUME_KEYS = ("model_name_or_path", "tokenizer_name", "train_file", "dataset_dir", "dataset_name",
                      "dataset_config_name", "text_column", "validation_file",
                      "validation_split_percentage", "max_train_samples", "seed", "weight_decay", "adafactor",
                      "gradient_accumulation_steps")
LOGGED_CHANGES = ("learning_rate", "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs",
                  "logging_steps", "eval_steps", "save_steps", "max_grad_norm", "z_loss", "mesh", "dtype",
                  "sample_prompts", "sample_every")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OUR_OUTPUTS = ("checkpoints", checkpoint.DAMAGED_DIR, "tensorboard", "metrics.jsonl", "samples.jsonl",
               "eval_results.json", "loss_curve.png", "hf", "run_config.json")


class RunError(ValueError):
    """A run that cannot start as asked (output dir, shapes, sizes)."""


class DivergenceError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite (exit code 3)."""


@dataclasses.dataclass
class Data:
    train: sources.PreparedSplit | None
    validation: sources.PreparedSplit | None


def is_main() -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass
class RunContext:
    """What the stages of a run share; filled in stage by stage."""

    args: RunArgs
    mesh: Mesh
    out: Path
    family: Family
    config: Any
    global_batch: int
    run_start: float
    previous: dict  # the run_config.json found in the output dir ({} if none)
    config_source: str  # the preset, file or directory the model config came from
    resuming: bool = False
    latest_step: int = 0  # of the checkpoints found when resuming
    tokenizer: Any = None
    trained_tokenizer: bool = False
    objective: Any = None
    data: Data | None = None
    schedule: pipeline.Schedule | None = None

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps if self.schedule else 0


# -- stage 1: resolve the run's config (everything that can be refused is checked before any file is written) -------
def resolve(args: RunArgs, run_start: float, devices=None) -> RunContext:
    mesh = make_mesh(args.mesh, devices, dcn_spec=args.dcn_mesh)
    global_batch = global_batch_size(args, mesh)
    out = storage.path(args.output_dir, "--output_dir")  # a local dir or a bucket (gs://)
    if out.exists() and not out.is_dir():
        raise RunError(f"--output_dir {out} is a file; give a directory")
    if args.model_name_or_path:
        from spmdlm.export import read_hf_config

        config = read_hf_config(args.model_name_or_path)
        config_name = args.model_name_or_path
    else:
        model_type = args.model_type or "gpt2"
        default = FAMILIES[model_type].default_preset if model_type in FAMILIES else model_type
        config_name = args.config_name or (str(out) if (out / "config.json").exists() else default)
        config = load_config(config_name, args.model_type)
        if not args.config_name and not args.uses_embedded_corpus and config_name == default:
            log.info("no --config_name: using the %s preset (%s); pass --config_name for another size", default,
                     ", ".join(f"{k}={v}" for k, v in config.to_hf_dict().items()
                               if type(v) is int and not k.endswith("token_id")))
        if args.vocab_size:
            config = config.replace(vocab_size=args.vocab_size)
    family = get_family(config.model_type)
    check_flags_apply(args, family)
    family.check_lengths(args, config)
    return RunContext(args, mesh, out, family, config, global_batch, run_start, read_run_config(out), config_name)


def check_flags_apply(args: RunArgs, family: Family) -> None:
    """An objective flag of another family (e.g. --block_size for T5) is an error, not silently ignored."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunArgs)}
    for other in FAMILIES.values():
        for flag in other.sequence_flags:
            if flag not in family.sequence_flags and getattr(args, flag) != defaults[flag]:
                raise ArgumentError(f"--{flag} does not apply to {family.name}; its flags are "
                                    f"{', '.join('--' + f for f in family.sequence_flags)} (the first sets the "
                                    "example length)")


def read_run_config(out: Path) -> dict:
    path = out / "run_config.json"
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path} is not valid JSON ({e}); restore it, or start afresh with --overwrite_output_dir") \
            from None
    if not isinstance(saved, dict):
        raise RunError(f"{path} is not a run config; restore it, or start afresh with --overwrite_output_dir")
    return saved


def global_batch_size(args: RunArgs, mesh) -> int:
    per_step = batch_axis_size(mesh) * args.gradient_accumulation_steps
    if args.global_batch_size is not None:
        if args.global_batch_size % per_step:
            raise ArgumentError(
                f"--global_batch_size {args.global_batch_size} is not divisible by the {batch_axis_size(mesh)} "
                f"batch devices (data x fsdp of --mesh {args.mesh}) x {args.gradient_accumulation_steps} "
                f"accumulation steps; use a multiple of {per_step}")
        return args.global_batch_size
    return args.per_device_train_batch_size * per_step


# -- stage 2: the output dir: check (refuse or resume), then prepare (remove only our own outputs) ------------------
def check_output_dir(ctx: RunContext) -> str:
    """-> 'resume' (a run of these settings is there), 'fresh' (nothing to keep) or 'clear' (our outputs to remove).
    Refuses anything else unasked; deletes nothing."""
    args, out, saved = ctx.args, ctx.out, ctx.previous or None
    if not out.exists() or not any(out.iterdir()):
        return "fresh"
    if args.overwrite_output_dir:
        return "clear"
    has_checkpoints = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    if has_checkpoints and saved is not None:
        # only complete checkpoints count (an interrupted async save leaves a temporary folder)
        ctx.latest_step = max(checkpoint.make_manager(out, read_only=True).all_steps(), default=0)
        has_checkpoints = ctx.latest_step > 0
    if has_checkpoints and saved is None:
        raise RunError(f"--output_dir {out} holds checkpoints but no run_config.json, so they cannot be checked "
                       "against this run; restore the file, choose another --output_dir, or --overwrite_output_dir")
    if has_checkpoints:
        checkpoint.check_format(saved, out)
        keys = COMMON_RESUME_KEYS + ctx.family.resume_keys
        changed = [k for k in keys if saved.get(k) != getattr(args, k, None)]
        # Token ids are set from the tokenizer after this check, so they are not compared here.
        shape_of = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("_token_id")}
        if shape_of(saved.get("model_config")) != shape_of(ctx.config.to_hf_dict()):
            changed.append("model config")
        if changed:
            raise RunError(f"--output_dir {out} holds a run with other settings ({', '.join(changed)}); "
                           "use the same flags to resume, another --output_dir, or --overwrite_output_dir")
        if saved.get("global_batch") != ctx.global_batch:
            raise RunError(f"--output_dir {out} holds a run with a global batch of {saved.get('global_batch')} "
                           f"examples, this one has {ctx.global_batch}; resume with --global_batch_size "
                           f"{saved.get('global_batch')} (any mesh that divides it), or use another --output_dir")
        logged = [f"{k} {saved.get(k)} -> {getattr(args, k)}" for k in LOGGED_CHANGES
                  if k in saved and saved[k] != getattr(args, k)]
        if logged:
            log.info("resuming with changed settings: %s", ", ".join(logged))
        return "resume"
    # A dir holding only a config/tokenizer (as the recipes prepare it) or what a run of ours wrote before its first
    # checkpoint can be used as is; anything else is someone's data.
    reusable = {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "merges.txt", "spiece.model", LOCK_NAME, *OUR_OUTPUTS}
    if {p.name for p in out.iterdir()} - reusable:
        raise RunError(f"--output_dir {out} is not empty and holds no run to resume; "
                       "pass --overwrite_output_dir to use it anyway or choose another --output_dir")
    return "clear"


def prepare_output_dir(ctx: RunContext, verdict: str) -> None:
    """Remove only what a run of ours wrote: recipes keep their config and tokenizer in the output dir (a tokenizer
    we trained ourselves goes too, or a new corpus would silently reuse it)."""
    ctx.resuming = verdict == "resume"
    if not is_main():
        return
    if verdict == "clear":
        names = list(OUR_OUTPUTS)
        if ctx.previous.get("trained_tokenizer"):
            names += TOKENIZER_FILES
        for name in names:
            storage.remove(ctx.out / name)
        ctx.previous = {}
    ctx.out.mkdir(parents=True, exist_ok=True)


# -- stage 3: tokenizer -----------------------------------------------------------------------------------------------
def read_corpora(args: RunArgs) -> tuple[list[str], list[str]]:
    """Training and validation documents; without --validation_file a hash split of the training documents (or the
    dataset's own validation split). None with --dataset_dir: it is tokenized already."""
    if args.dataset_dir:
        return [], []
    held_out = None
    if args.train_file or args.dataset_name:
        corpus = sources.open_corpus([args.train_file] if args.train_file else (), dataset_name=args.dataset_name,
                                     dataset_config_name=args.dataset_config_name, text_column=args.text_column,
                                     flag="--train_file")
        docs = corpus.documents("train")
        if args.dataset_name and "validation" in corpus.splits and not args.validation_file:
            held_out = list(corpus.documents("validation"))
    else:
        log.info("no --train_file: using the embedded corpus (this Python's standard library sources)")
        docs = sources.read_embedded_corpus()
    train, split_off = [], []
    split = args.validation_split_percentage if held_out is None and not args.validation_file else 0.0
    for doc in docs:
        (split_off if split and sources.in_validation_split(doc, split) else train).append(doc)
    if args.validation_file:
        held_out = list(sources.read_documents(sources.expand_files(args.validation_file, "--validation_file"),
                                               text_column=args.text_column))
    if not train:
        raise sources.DataError("the training corpus has no text; check --train_file")
    return train, split_off if held_out is None else held_out


def setup_tokenizer(ctx: RunContext, train_docs: list[str]) -> None:
    """Given (--tokenizer_name), the model's, one found in the output dir, or one trained here on the corpus."""
    args, out, config = ctx.args, ctx.out, ctx.config
    origin = "trained"
    if args.tokenizer_name:
        tok, origin = load_tokenizer(args.tokenizer_name), "given"
    elif args.dataset_dir:
        tok, origin = load_tokenizer(storage.path(args.dataset_dir) / sources.TOKENIZER_DIR), "given"
    elif args.model_name_or_path and (storage.path(args.model_name_or_path) / "tokenizer.json").exists():
        tok, origin = load_tokenizer(args.model_name_or_path), "model"
    elif (out / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", out)
        tok, origin = load_tokenizer(out), "output_dir"
    else:
        vocab = args.vocab_size or config.vocab_size
        log.info("training a %d-token tokenizer on %d documents", vocab, len(train_docs))
        tok = train_tokenizer(ctx.family, train_docs, vocab)  # saved with run_config.json (write_run_files)
    if tok.get_vocab_size() > config.vocab_size:
        raise ArgumentError(f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                            f"{config.vocab_size}; use --vocab_size/a config with vocab_size >= "
                            f"{tok.get_vocab_size()} or a smaller tokenizer")
    fields = {f.name for f in dataclasses.fields(config)}
    ctx.config = config.replace(**{f"{k}_token_id": v for k, v in special_token_ids(tok, ctx.family).items()
                                   if v is not None and f"{k}_token_id" in fields})
    ctx.tokenizer = tok
    ctx.trained_tokenizer = origin == "trained" or (origin == "output_dir" and bool(ctx.previous.get("trained_tokenizer")))


# -- stage 4: objective and data ------------------------------------------------------------------------------------
def setup_data(ctx: RunContext, train_docs, val_docs) -> None:
    args = ctx.args
    ctx.objective = ctx.family.build_objective(args, ctx.config, ctx.tokenizer)
    ids = special_token_ids(ctx.tokenizer, ctx.family)
    cache = storage.path(args.cache_dir or Path.home() / ".cache" / "spmdlm", "--cache_dir")
    mode = getattr(ctx.objective, "preparation", "stream")
    if args.dataset_dir:  # prepared by python -m spmdlm.prepare: checked against this run's tokenizer and lengths
        train, validation, _ = sources.open_dataset(args.dataset_dir, tokenizer=ctx.tokenizer,
                                                    record_length=ctx.objective.record_length, mode=mode)
        finish_data(ctx, train if args.training else None, validation if args.evaluating else None)
        return
    common = dict(record_length=ctx.objective.record_length, separator_id=ids["eos"], cache_dir=cache,
                  overwrite_cache=args.overwrite_cache, mode=mode, pad_id=ids.get("pad"),
                  workers=args.preprocessing_num_workers or 1)

    def prepare(docs, name):
        split = sources.prepare_split(docs, ctx.tokenizer, name=name, **common) if is_main() else None
        if jax.process_count() > 1:  # the others wait for process 0's file, then read the same cache
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"prepared {name}")
            if not is_main():
                split = sources.prepare_split(docs, ctx.tokenizer, name=name, **{**common, "overwrite_cache": False})
        return split

    train = prepare(train_docs, "train") if args.training else None
    validation = None
    if val_docs and args.evaluating:
        try:
            validation = prepare(val_docs, "validation")
        except sources.DataError as e:
            if args.validation_file:
                raise
            log.warning("no evaluation: the held-out %.1f%% of the documents is too small (%s); raise "
                        "--validation_split_percentage or pass --validation_file", args.validation_split_percentage, e)
    finish_data(ctx, train, validation)


def finish_data(ctx: RunContext, train, validation) -> None:
    args = ctx.args
    if train is not None and args.max_train_samples:
        train = dataclasses.replace(train, num_records=min(train.num_records, args.max_train_samples))
    ctx.data = Data(train, validation)
    if train is not None:
        ctx.schedule = pipeline.make_schedule(train.num_records, ctx.global_batch, args.num_train_epochs,
                                              args.max_steps)


# -- stage 5: the sharded train state -------------------------------------------------------------------------------
def setup_state(ctx: RunContext):
    """-> (graphdef, state, stepper). Resuming builds an abstract state only: a fresh init would be a second copy."""
    args = ctx.args
    optim = OptimConfig(
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, adafactor=args.adafactor,
        max_grad_norm=args.max_grad_norm, warmup_steps=args.warmup_steps, lr_scheduler_type=args.lr_scheduler_type,
    )
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    steps = max(ctx.total_steps, 1)

    def build():
        model = ctx.family.make_model(ctx.config, rngs=nnx.Rngs(params=args.seed), dtype=dtype,
                                      remat=args.remat, scan_unroll=args.scan_unroll or True)
        return model, nnx.Optimizer(model, make_optimizer(optim, model, steps), wrt=nnx.Param)

    graphdef, state = create_train_state(build, ctx.mesh, abstract=ctx.resuming)
    check_mesh_use(state, ctx)
    if args.model_name_or_path and not ctx.resuming:
        from spmdlm.export import load_hf_into_state

        state = load_hf_into_state(args.model_name_or_path, graphdef, state)
    stepper = Stepper(graphdef, state, ctx.mesh, grad_accum=args.gradient_accumulation_steps, z_loss=args.z_loss,
                      dropout_seed=args.seed, schedule=learning_rate_schedule(optim, steps),
                      loss_chunk=args.loss_chunk_size, label_capacity=getattr(ctx.objective, "label_capacity", None))
    return graphdef, state, stepper


def check_mesh_use(state, ctx: RunContext) -> None:
    """A tensor axis that shards nothing only replicates the work; an idle fsdp axis is plain data parallelism."""
    idle = idle_axes(state, ctx.mesh)
    if "tensor" in idle:
        raise ArgumentError(
            f"--mesh {ctx.args.mesh}: the tensor axis ({ctx.mesh.shape['tensor']}) divides none of the model's "
            "sharded dimensions (heads x head size, MLP width, vocabulary), so it would only repeat the same work; "
            "use a tensor size that divides them, or give those devices to data/fsdp")
    if "fsdp" in idle:
        log.warning("--mesh %s: the fsdp axis (%d) divides no parameter dimension, so parameters are replicated "
                    "(plain data parallelism)", ctx.args.mesh, ctx.mesh.shape["fsdp"])


def count_parameters(graphdef, state) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)))


# -- stage 7: evaluation --------------------------------------------------------------------------------------------
def evaluate(stepper: Stepper, state, ctx: RunContext) -> dict[str, float]:
    args = ctx.args
    global_batch = args.per_device_eval_batch_size * batch_axis_size(ctx.mesh)
    totals: dict[str, Any] = {}
    for batch in pipeline.eval_batches(ctx.data.validation, ctx.objective, seed=args.seed, global_batch=global_batch,
                                       max_examples=args.max_eval_samples, process_index=jax.process_index(),
                                       process_count=jax.process_count()):
        sums = stepper.eval_step(state, pipeline.to_global(batch, ctx.mesh))
        totals = sums if not totals else jax.tree.map(jnp.add, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_accuracy": float(totals["correct"]) / tokens, "eval_tokens": tokens}


def run(args: RunArgs) -> dict[str, Any]:
    ctx = resolve(args, time.perf_counter())
    train_docs, val_docs = read_corpora(args)
    with RunLock(ctx.out, enabled=is_main()):  # before anything is written or removed in the output dir
        prepare_output_dir(ctx, check_output_dir(ctx))
        return run_locked(ctx, train_docs, val_docs)


def run_locked(ctx: RunContext, train_docs, val_docs) -> dict[str, Any]:
    args = ctx.args
    if args.push_to_hub:
        log.warning("--push_to_hub: spmdlm does not upload (it never uses the network); the model will be exported "
                    "to %s — upload that folder with `huggingface-cli upload` from a connected machine", ctx.out / "hf")
    setup_tokenizer(ctx, train_docs)
    setup_data(ctx, train_docs, val_docs)
    graphdef, state, stepper = setup_state(ctx)
    n_params = count_parameters(graphdef, state)
    mesh = ctx.mesh
    log.info("model %s (config %s): %.2fM parameters | mesh %s | global batch %d (%d per device x %d batch devices "
             "x %d accumulation) | %d steps", ctx.family.name, ctx.config_source, n_params / 1e6, dict(mesh.shape),
             ctx.global_batch, ctx.global_batch // (batch_axis_size(mesh) * args.gradient_accumulation_steps),
             batch_axis_size(mesh), args.gradient_accumulation_steps, ctx.total_steps)
    reporter = Reporter(ctx.out, enabled=is_main(), config=ctx.config, objective=ctx.objective,
                        global_batch=ctx.global_batch, mesh=mesh, dtype=args.dtype, run_start=ctx.run_start)
    previous_results = read_results(ctx.out) if ctx.resuming else {}
    results: dict[str, Any] = {"total_steps": ctx.total_steps, "parameters": n_params}
    training = ctx.data.train is not None
    if training and ctx.latest_step >= ctx.total_steps and not missing_outputs(ctx, previous_results):
        log.info("the run in %s is complete (step %d of %d) and its evaluation and export are there: nothing to "
                 "do (--overwrite_output_dir starts afresh)", ctx.out, ctx.latest_step, ctx.total_steps)
        return {**results, **previous_results}

    def compile_train() -> dict[str, Any]:
        stats = stepper.compile_train(state, pipeline.batch_spec(ctx.objective, ctx.global_batch))
        check_memory(stats, ctx)  # before anything is written: a refused run leaves the output dir as it was
        reporter.compile_stats(stats)
        return stats

    stats = compile_train() if training and ctx.latest_step < ctx.total_steps else None
    run_config = write_run_files(ctx)
    if training and args.dry_run:
        reporter.sync()  # a bucket output dir gets the compile record too
        return {**results, **(stats or {})}

    # -- stage 6: train (or restore for evaluation only) ---------------------------------------------------------
    step, trained = 0, False
    if training:
        manager = checkpoint.make_manager(ctx.out, save_interval_steps=1, max_to_keep=args.save_total_limit)
        iterator = pipeline.train_batches(ctx.data.train, ctx.objective, seed=args.seed,
                                          global_batch=ctx.global_batch, num_epochs=ctx.schedule.num_epochs,
                                          process_index=jax.process_index(), process_count=jax.process_count())
        try:
            if ctx.resuming:
                state, step = checkpoint.restore_newest_good(manager, state, iterator)
                log.info("resumed from the checkpoint at step %d", step)
                reporter.truncate_after(step)
            if step < ctx.total_steps:
                if stats is None:  # the finished run's last checkpoint was damaged: train again from an older one
                    compile_train()
                results.update(train_loop(ctx, stepper, state, iterator, manager, reporter, step, run_config))
                state, trained = results.pop("state"), True
            else:  # finished before: keep its training results, redo only what is missing
                results.update({k: v for k, v in previous_results.items() if k.startswith("train_")})
            checkpoint.check_saved(manager, wait=True)
        finally:
            checkpoint.close(manager)
    elif ctx.resuming:  # evaluation only: of the latest checkpoint
        manager = checkpoint.make_manager(ctx.out, read_only=True)
        state, step = checkpoint.restore_newest_good(manager, state, move_aside=False)
        log.info("evaluating the checkpoint at step %d", step)

    # -- stage 7 and 8: evaluate, report, export ----------------------------------------------------------------
    if ctx.data.validation is not None and args.evaluating:
        if training and not trained and "eval_loss" in previous_results:
            results.update({k: v for k, v in previous_results.items() if k.startswith("eval_")})
        else:
            metrics = evaluate(stepper, state, ctx)
            reporter.log_eval(step if not training else ctx.total_steps, metrics)
            results.update(metrics)
    export = args.export_hf and training and (trained or not export_done(ctx.out))
    finish(ctx, graphdef, state, reporter, {**previous_results, **results}, export)
    return results


def write_run_files(ctx: RunContext) -> dict[str, Any]:
    """The tokenizer (unless one is there: a later export finds it beside the checkpoints) and run_config.json:
    written once the run is known to fit."""
    run_config = {**ctx.args.to_json(), "global_batch": ctx.global_batch, "model_config": ctx.config.to_hf_dict(),
                  "trained_tokenizer": ctx.trained_tokenizer, "checkpoint_format": checkpoint.FORMAT}
    if is_main():
        if not (ctx.out / "tokenizer.json").exists():
            save_tokenizer(ctx.tokenizer, ctx.out, ctx.family, model_max_length=ctx.config.max_length)
        write_json(ctx.out / "run_config.json", run_config)
    return run_config


def read_results(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "eval_results.json").read_text())
    except (OSError, ValueError):
        return {}


def export_done(out: Path) -> bool:
    return (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()


def missing_outputs(ctx: RunContext, previous_results: dict) -> list[str]:
    """What a finished run would still have to write: its evaluation or its export."""
    missing = []
    if ctx.data.validation is not None and ctx.args.evaluating and "eval_loss" not in previous_results:
        missing.append("evaluation")
    if ctx.args.export_hf and not export_done(ctx.out):
        missing.append("export")
    return missing


def check_memory(stats: dict[str, Any], ctx: RunContext) -> None:
    """Refuse a step that cannot fit before running it: an out-of-memory crash (or the kernel's OOM killer) later
    says nothing about what to change."""
    need = stats.get("argument_bytes", 0) + stats.get("output_bytes", 0) + stats.get("temp_bytes", 0) - \
        stats.get("alias_bytes", 0)
    capacity, what = device_memory_bytes()
    local = jax.local_device_count()
    if not capacity or need * (local if what == "host" else 1) <= capacity:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    shared = f"the host's {gib(capacity)} of RAM shared by {local} CPU devices" if what == "host" else \
        f"the device's {gib(capacity)}"
    args = ctx.args
    raise RunError(
        f"the train step needs {gib(need)} per device (arguments {gib(stats.get('argument_bytes', 0))}, temporaries "
        f"{gib(stats.get('temp_bytes', 0))}) but has {shared}; try a smaller --per_device_train_batch_size (now "
        f"{ctx.global_batch // (batch_axis_size(ctx.mesh) * args.gradient_accumulation_steps)}) or sequence length, "
        "--gradient_checkpointing, fsdp (--mesh fsdp=N), --dtype bfloat16, or a smaller --config_name")


def device_memory_bytes() -> tuple[int | None, str]:
    """(bytes, 'device') of an accelerator, or (physical RAM, 'host') for CPU devices, which share it."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host"
        except (ValueError, OSError):
            return None, "host"
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit"), "device"


def finish(ctx: RunContext, graphdef, state, reporter: Reporter, results: dict[str, Any], export: bool) -> None:
    if is_main():
        write_json(ctx.out / "eval_results.json",
                   {k: v for k, v in results.items() if k.startswith("eval_") or k.startswith("train_")})
        reporter.finish(results)
    if export:
        from spmdlm.export import export_state

        export_state(graphdef, state, ctx.config, ctx.out / "hf", tokenizer=ctx.tokenizer)


def train_loop(ctx: RunContext, stepper: Stepper, state, iterator, manager, reporter: Reporter, start_step: int,
               run_config: dict) -> dict[str, Any]:
    args, total_steps = ctx.args, ctx.total_steps
    pending: list[dict] = []  # device-side metrics since the last log; fetched only at log time
    reporter.start(start_step, total_steps)
    step = start_step
    last_saved = start_step
    train_loss = float("nan")
    with StopOnSignal() as stop, reporter:
        while step < total_steps:
            batch = pipeline.to_global(next(iterator), ctx.mesh)
            state, metrics = stepper.train_step(state, batch, step)
            step += 1
            pending.append(metrics)
            if step % args.logging_steps == 0 or step == total_steps:
                fetched = jax.device_get(pending)
                check_finite(fetched, step, last_saved, args)  # no extra sync: these metrics are fetched anyway
                train_loss = reporter.log_train(step, fetched)
                pending = []
            else:
                reporter.tick(step)
            checkpoint.check_saved(manager, last_saved)  # a failed async save stops the run now, not at the next
            if ctx.data.validation is not None and args.evaluating and step % args.eval_steps == 0 \
                    and step < total_steps:
                reporter.log_eval(step, evaluate(stepper, state, ctx))
            if args.sample_prompts and (step % args.sample_every == 0 or step == total_steps):
                reporter.log_samples(step, samples(ctx, stepper.graphdef, state, step))
            stopping = stop.should_stop(step)
            if step % args.save_steps == 0 or step == total_steps or stopping:
                save(manager, step, state, iterator, run_config, pending, last_saved, args)
                last_saved = step
                reporter.sync()  # a bucket output dir: the metrics up to the checkpoint are there with it
            if stopping:
                checkpoint.check_saved(manager, step, wait=True)
                raise Preempted(stop.signum, step, checkpoint.checkpoint_dir(ctx.out) / str(step))
    return {"state": state, "train_loss": train_loss, **reporter.throughput()}


def samples(ctx: RunContext, graphdef, state, step: int) -> list[dict[str, Any]]:
    """What the model makes of --sample_prompts now: a greedy and a sampled continuation of each (RoBERTa: its top
    candidates for each <mask>). Every process takes part (the model is sharded); process 0 reports."""
    from spmdlm.generate import fill_mask, generate

    model, _ = nnx.merge(graphdef, state)
    prompts = [p for p in ctx.args.sample_prompts.split("|") if p.strip()]
    if ctx.family.hf_auto_class == "AutoModelForMaskedLM":
        return [{"prompt": p, "fill_mask": [[token for token, _, _ in candidates]
                                            for candidates in fill_mask(model, ctx.config, ctx.tokenizer, p, 3)]}
                for p in prompts]
    common = dict(max_new_tokens=min(32, ctx.config.max_length // 2))
    greedy = generate(model, ctx.config, ctx.tokenizer, prompts, temperature=0.0, **common)
    sampled = generate(model, ctx.config, ctx.tokenizer, prompts, temperature=0.8, top_k=50, seed=step, **common)
    return [{"prompt": p, "greedy": g, "sampled": s} for p, g, s in zip(prompts, greedy, sampled)]


def save(manager, step: int, state, iterator, run_config: dict, pending: list[dict], last_saved: int,
         args: RunArgs) -> None:
    """Checkpoint, unless the metrics not yet logged (fetched here) or the state itself are not finite."""
    check_finite(jax.device_get(pending), step, last_saved, args)
    try:
        checkpoint.save(manager, step, state, iterator, run_config, force=True)
    except checkpoint.NonFiniteStateError as e:
        raise DivergenceError(f"training diverged by step {step}: {e}; {_advice(last_saved, args)}") from None


def check_finite(fetched: list[dict], step: int, last_saved: int, args: RunArgs) -> None:
    first = step - len(fetched) + 1
    for offset, metrics in enumerate(fetched):
        loss = float(metrics["loss_sum"]) / max(float(metrics["tokens"]), 1.0)
        grad_norm = float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise DivergenceError(f"training diverged at step {first + offset}: loss {loss:.4g}, grad norm "
                                  f"{grad_norm:.4g}; {_advice(last_saved, args)}")


def _advice(last_saved: int, args: RunArgs) -> str:
    kept = f"the last checkpoint (step {last_saved}) is kept" if last_saved else "no checkpoint was written"
    tries = [f"a lower --learning_rate (now {args.learning_rate:g})"]
    if not 0 < args.max_grad_norm <= 1.0:
        tries.append(f"--max_grad_norm 1.0 (now {args.max_grad_norm:g})")
    tries.append("--z_loss 1e-4" if not args.z_loss else "more --warmup_steps")
    if args.dtype != "float32":
        tries.append("--dtype float32")
    return f"{kept}, nothing after it is saved or exported; try {', '.join(tries)}"
