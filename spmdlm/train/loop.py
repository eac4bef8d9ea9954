"""One training loop for every family: named stages that pass one RunContext.

resolve (config, mesh, lengths) -> check/prepare the output dir -> tokenizer -> objective and data -> sharded state
-> train (or restore) -> evaluate -> finish (results, export). See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdlm import checkpoint
from spmdlm.config import ArgumentError, RunArgs
from spmdlm.data import pipeline, sources
from spmdlm.data.tokenizer import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer
from spmdlm.families import FAMILIES, get_family, load_config
from spmdlm.families.base import Family
from spmdlm.mesh import batch_axis_size, make_mesh
from spmdlm.train.optim import OptimConfig, learning_rate_schedule, make_optimizer
from spmdlm.train.report import Reporter
from spmdlm.train.step import Stepper, create_train_state

log = logging.getLogger("spmdlm")

# Run arguments that must match for a run to resume in the same output dir, besides the model config, the global
# batch and the family's own (its objective's flags). Others may change: logging cadence, the mesh (the state is
# restored into the new shardings), or the step budget (which also stretches the learning-rate schedule).
COMMON_RESUME_KEYS = ("model_type", "model_name_or_path", "tokenizer_name", "train_file", "validation_file",
                      "validation_split_percentage", "max_train_samples", "seed", "learning_rate", "weight_decay",
                      "adafactor", "gradient_accumulation_steps")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OUR_OUTPUTS = ("checkpoints", "tensorboard", "metrics.jsonl", "eval_results.json", "loss_curve.png", "hf",
               "run_config.json")


class RunError(ValueError):
    """A run that cannot start as asked (output dir, shapes, sizes)."""


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
    tokenizer: Any = None
    trained_tokenizer: bool = False
    objective: Any = None
    data: Data | None = None
    schedule: pipeline.Schedule | None = None

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps if self.schedule else 0


# -- stage 1: resolve the run's config (everything that can be refused is checked before any file is written) -------
def resolve(args: RunArgs, run_start: float) -> RunContext:
    mesh = make_mesh(args.mesh)
    global_batch = global_batch_size(args, mesh)
    out = Path(args.output_dir)
    if args.model_name_or_path:
        from spmdlm.export import read_hf_config

        config = read_hf_config(args.model_name_or_path)
        config_name = args.model_name_or_path
    else:
        model_type = args.model_type or "gpt2"
        default = FAMILIES[model_type].default_preset if model_type in FAMILIES else model_type
        config_name = args.config_name or (str(out) if (out / "config.json").exists() else default)
        config = load_config(config_name, args.model_type)
        if args.vocab_size:
            config = config.replace(vocab_size=args.vocab_size)
    family = get_family(config.model_type)
    family.check_lengths(args, config)
    previous_path = out / "run_config.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else {}
    return RunContext(args, mesh, out, family, config, global_batch, run_start, previous, config_name)


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
        has_checkpoints = bool(checkpoint.make_manager(out, read_only=True).all_steps())
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
        if saved.get("global_batch") != ctx.global_batch:
            changed.append("global batch size")
        if changed:
            raise RunError(f"--output_dir {out} holds a run with other settings ({', '.join(changed)}); "
                           "use the same flags to resume, another --output_dir, or --overwrite_output_dir")
        return "resume"
    # A dir holding only a config/tokenizer (as the recipes prepare it) or what a run of ours wrote before its first
    # checkpoint can be used as is; anything else is someone's data.
    reusable = {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "merges.txt", "spiece.model", *OUR_OUTPUTS}
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
            path = ctx.out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        ctx.previous = {}
    ctx.out.mkdir(parents=True, exist_ok=True)


# -- stage 3: tokenizer -----------------------------------------------------------------------------------------------
def read_corpora(args: RunArgs) -> tuple[list[str], list[str]]:
    """Training and validation documents; without --validation_file a hash split of the training documents."""
    if args.train_file:
        docs = sources.read_documents(sources.expand_files(args.train_file, "--train_file"))
    else:
        log.info("no --train_file: using the embedded corpus (this Python's standard library sources)")
        docs = sources.read_embedded_corpus()
    train, held_out = [], []
    split = args.validation_split_percentage if not args.validation_file else 0.0
    for doc in docs:
        (held_out if split and sources.in_validation_split(doc, split) else train).append(doc)
    if args.validation_file:
        held_out = list(sources.read_documents(sources.expand_files(args.validation_file, "--validation_file")))
    if not train:
        raise sources.DataError("the training corpus has no text; check --train_file")
    return train, held_out


def setup_tokenizer(ctx: RunContext, train_docs: list[str]) -> None:
    """Given (--tokenizer_name), the model's, one found in the output dir, or one trained here on the corpus."""
    args, out, config = ctx.args, ctx.out, ctx.config
    origin = "trained"
    if args.tokenizer_name:
        tok, origin = load_tokenizer(args.tokenizer_name), "given"
    elif args.model_name_or_path and (Path(args.model_name_or_path) / "tokenizer.json").exists():
        tok, origin = load_tokenizer(args.model_name_or_path), "model"
    elif (out / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", out)
        tok, origin = load_tokenizer(out), "output_dir"
    else:
        vocab = args.vocab_size or config.vocab_size
        log.info("training a %d-token tokenizer on %d documents", vocab, len(train_docs))
        tok = train_tokenizer(ctx.family, train_docs, vocab)
        if is_main():
            save_tokenizer(tok, out, ctx.family, model_max_length=config.max_length)
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
    cache = Path(args.cache_dir or Path.home() / ".cache" / "spmdlm")
    common = dict(record_length=ctx.objective.record_length, separator_id=ids["eos"], cache_dir=cache,
                  overwrite_cache=args.overwrite_cache, mode=getattr(ctx.objective, "preparation", "stream"),
                  pad_id=ids.get("pad"))

    def prepare(docs, name):
        split = sources.prepare_split(docs, ctx.tokenizer, name=name, **common) if is_main() else None
        if jax.process_count() > 1:  # the others wait for process 0's file, then read the same cache
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"prepared {name}")
            if not is_main():
                split = sources.prepare_split(docs, ctx.tokenizer, name=name, **{**common, "overwrite_cache": False})
        return split

    train = prepare(train_docs, "train") if args.training else None
    if train is not None and args.max_train_samples:
        train = dataclasses.replace(train, num_records=min(train.num_records, args.max_train_samples))
    validation = None
    if val_docs and args.evaluating:
        try:
            validation = prepare(val_docs, "validation")
        except sources.DataError as e:
            if args.validation_file:
                raise
            log.warning("no evaluation: the held-out %.1f%% of the documents is too small (%s); raise "
                        "--validation_split_percentage or pass --validation_file", args.validation_split_percentage, e)
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
                                      remat=args.gradient_checkpointing, scan_unroll=args.scan_unroll or True)
        return model, nnx.Optimizer(model, make_optimizer(optim, model, steps), wrt=nnx.Param)

    graphdef, state = create_train_state(build, ctx.mesh, abstract=ctx.resuming)
    if args.model_name_or_path and not ctx.resuming:
        from spmdlm.export import load_hf_into_state

        state = load_hf_into_state(args.model_name_or_path, graphdef, state)
    stepper = Stepper(graphdef, state, ctx.mesh, grad_accum=args.gradient_accumulation_steps, z_loss=args.z_loss,
                      dropout_seed=args.seed, schedule=learning_rate_schedule(optim, steps))
    return graphdef, state, stepper


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
    prepare_output_dir(ctx, check_output_dir(ctx))
    if args.push_to_hub:
        log.warning("--push_to_hub: spmdlm does not upload (it never uses the network); the model will be exported "
                    "to %s — upload that folder with `huggingface-cli upload` from a connected machine", ctx.out / "hf")
    setup_tokenizer(ctx, train_docs)
    setup_data(ctx, train_docs, val_docs)
    graphdef, state, stepper = setup_state(ctx)

    run_config = {**args.to_json(), "global_batch": ctx.global_batch, "model_config": ctx.config.to_hf_dict(),
                  "trained_tokenizer": ctx.trained_tokenizer, "checkpoint_format": checkpoint.FORMAT}
    if is_main():
        (ctx.out / "run_config.json").write_text(json.dumps(run_config, indent=2))
    n_params = count_parameters(graphdef, state)
    mesh = ctx.mesh
    log.info("model %s (config %s): %.2fM parameters | mesh %s | global batch %d (%d per device x %d batch devices "
             "x %d accumulation) | %d steps", ctx.family.name, ctx.config_source, n_params / 1e6, dict(mesh.shape),
             ctx.global_batch, ctx.global_batch // (batch_axis_size(mesh) * args.gradient_accumulation_steps),
             batch_axis_size(mesh), args.gradient_accumulation_steps, ctx.total_steps)
    reporter = Reporter(ctx.out, enabled=is_main(), config=ctx.config, objective=ctx.objective,
                        global_batch=ctx.global_batch, mesh=mesh, dtype=args.dtype, run_start=ctx.run_start)
    results: dict[str, Any] = {"total_steps": ctx.total_steps, "parameters": n_params}

    # -- stage 6: train (or restore for evaluation only) ---------------------------------------------------------
    step = 0
    if ctx.data.train is not None:
        stats = stepper.compile_train(state, pipeline.batch_spec(ctx.objective, ctx.global_batch))
        reporter.compile_stats(stats)
        if args.dry_run:
            return {**results, **stats}
        iterator = pipeline.train_batches(ctx.data.train, ctx.objective, seed=args.seed,
                                          global_batch=ctx.global_batch, num_epochs=ctx.schedule.num_epochs,
                                          process_index=jax.process_index(), process_count=jax.process_count())
        manager = checkpoint.make_manager(ctx.out, save_interval_steps=1, max_to_keep=args.save_total_limit)
        if ctx.resuming:
            state, step = checkpoint.restore(manager, None, state, iterator)
            log.info("resumed from the checkpoint at step %d", step)
            reporter.truncate_after(step)
        results.update(train_loop(ctx, stepper, state, iterator, manager, reporter, step, run_config))
        state = results.pop("state")
        manager.wait_until_finished()
        manager.close()
    elif ctx.resuming:  # evaluation only: of the latest checkpoint
        manager = checkpoint.make_manager(ctx.out, read_only=True)
        state, step = checkpoint.restore(manager, None, state)
        log.info("evaluating the checkpoint at step %d", step)

    # -- stage 7 and 8: evaluate, report, export ----------------------------------------------------------------
    if ctx.data.validation is not None and args.evaluating:
        metrics = evaluate(stepper, state, ctx)
        reporter.log_eval(step if ctx.data.train is None else ctx.total_steps, metrics)
        results.update(metrics)
    finish(ctx, graphdef, state, reporter, results)
    return results


def finish(ctx: RunContext, graphdef, state, reporter: Reporter, results: dict[str, Any]) -> None:
    if is_main():
        (ctx.out / "eval_results.json").write_text(json.dumps(
            {k: v for k, v in results.items() if k.startswith("eval_") or k.startswith("train_")}, indent=2))
        reporter.finish(results)
    if ctx.args.export_hf and ctx.data.train is not None:
        from spmdlm.export import export_state

        export_state(graphdef, state, ctx.config, ctx.out / "hf", tokenizer=ctx.tokenizer)


def train_loop(ctx: RunContext, stepper: Stepper, state, iterator, manager, reporter: Reporter, start_step: int,
               run_config: dict) -> dict[str, Any]:
    args, total_steps = ctx.args, ctx.total_steps
    pending: list[dict] = []  # device-side metrics since the last log; fetched only at log time
    reporter.start(start_step, total_steps)
    step = start_step
    train_loss = float("nan")
    while step < total_steps:
        batch = pipeline.to_global(next(iterator), ctx.mesh)
        state, metrics = stepper.train_step(state, batch, step)
        step += 1
        pending.append(metrics)
        if step % args.logging_steps == 0 or step == total_steps:
            train_loss = reporter.log_train(step, jax.device_get(pending))
            pending = []
        else:
            reporter.tick(step)
        if ctx.data.validation is not None and args.evaluating and step % args.eval_steps == 0 and step < total_steps:
            reporter.log_eval(step, evaluate(stepper, state, ctx))
        if step % args.save_steps == 0 or step == total_steps:
            checkpoint.save(manager, step, state, iterator, run_config, force=True)
    return {"state": state, "train_loss": train_loss, **reporter.throughput()}
