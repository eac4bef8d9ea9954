"""One training loop for every objective: set up, resume, train, evaluate, checkpoint, report, export."""

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

from spmdlm import checkpoint
from spmdlm.config import ArgumentError, RunArgs
from spmdlm.data import pipeline, sources
from spmdlm.data.tokenizer import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer
from spmdlm.mesh import batch_axis_size, make_mesh
from spmdlm.models import get_architecture, load_config
from spmdlm.train.optim import OptimConfig, learning_rate_schedule, make_optimizer
from spmdlm.train.report import Reporter
from spmdlm.train.step import Stepper, create_train_state

log = logging.getLogger("spmdlm")

# Run arguments that must match for a run to resume in the same output dir, besides the model config and the
# global batch. Others may change: logging cadence, the mesh (the state is restored into the new shardings), or
# the step budget (which also stretches the learning-rate schedule from the resumed step on).
RESUME_KEYS = ("model_type", "model_name_or_path", "tokenizer_name", "train_file", "validation_file",
               "validation_split_percentage", "max_train_samples", "block_size", "max_seq_length", "seed",
               "learning_rate", "weight_decay", "adafactor", "gradient_accumulation_steps", "mlm_probability",
               "mean_noise_span_length")
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


def check_output_dir(args: RunArgs, config) -> bool:
    """-> True when the output dir holds a resumable run of this config; refuses anything else unasked."""
    out = Path(args.output_dir)
    if not out.exists() or not any(out.iterdir()):
        return False
    saved_path = out / "run_config.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else None
    has_checkpoints = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    if has_checkpoints and saved is not None and not args.overwrite_output_dir:
        # only complete checkpoints count (an interrupted async save leaves a temporary folder)
        has_checkpoints = bool(checkpoint.make_manager(out, read_only=True).all_steps())
    if args.overwrite_output_dir:
        _remove_our_outputs(out, saved)
        return False
    if has_checkpoints and saved is None:
        raise RunError(f"--output_dir {out} holds checkpoints but no run_config.json, so they cannot be checked "
                       "against this run; restore the file, choose another --output_dir, or --overwrite_output_dir")
    if has_checkpoints:
        changed = [k for k in RESUME_KEYS if saved.get(k) != getattr(args, k, None)]
        # Token ids are set from the tokenizer after this check, so they are not compared here.
        shape_of = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("_token_id")}
        if shape_of(saved.get("model_config")) != shape_of(config.to_hf_dict()):
            changed.append("model config")
        if saved.get("global_batch") != global_batch_size(args, make_mesh(args.mesh)):
            changed.append("global batch size")
        if changed:
            raise RunError(f"--output_dir {out} holds a run with other settings ({', '.join(changed)}); "
                           "use the same flags to resume, another --output_dir, or --overwrite_output_dir")
        return True
    # A dir holding only a config/tokenizer (as the recipes prepare it) or what a run of ours wrote before its first
    # checkpoint can be used as is; anything else is someone's data.
    reusable = {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "merges.txt", "spiece.model", *OUR_OUTPUTS}
    if {p.name for p in out.iterdir()} - reusable:
        raise RunError(f"--output_dir {out} is not empty and holds no run to resume; "
                       "pass --overwrite_output_dir to use it anyway or choose another --output_dir")
    _remove_our_outputs(out, saved)
    return False


def _remove_our_outputs(out: Path, saved: dict | None) -> None:
    """Only what a run of ours wrote: recipes keep their config and tokenizer in the output dir (a tokenizer we
    trained ourselves goes too, or a new corpus would silently reuse it)."""
    if not is_main():
        return
    names = list(OUR_OUTPUTS)
    if saved and saved.get("trained_tokenizer"):
        names += TOKENIZER_FILES
    for name in names:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


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


def get_tokenizer(args: RunArgs, config, model_type: str, train_docs: list[str]) -> tuple[Any, str]:
    """-> (tokenizer, where it came from: 'given', 'model', 'output_dir' or 'trained')."""
    out = Path(args.output_dir)
    if args.tokenizer_name:
        return load_tokenizer(args.tokenizer_name), "given"
    if args.model_name_or_path and (Path(args.model_name_or_path) / "tokenizer.json").exists():
        return load_tokenizer(args.model_name_or_path), "model"
    if (out / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", out)
        return load_tokenizer(out), "output_dir"
    vocab = args.vocab_size or config.vocab_size
    log.info("training a %d-token tokenizer on %d documents", vocab, len(train_docs))
    tok = train_tokenizer(model_type, train_docs, vocab)
    if is_main():
        save_tokenizer(tok, out, model_type, model_max_length=config.max_length)
    return tok, "trained"


DEFAULT_PRESETS = {"gpt2": "gpt2", "t5": "t5-v1_1-base"}
T5_MAX_SEQ_LENGTH = 512  # T5 has relative positions, so no model maximum: the T5 recipes' length


def check_lengths(model_type: str, config, args: RunArgs) -> None:
    """Example lengths the model can take, checked before any data is read."""
    if model_type == "gpt2":
        block = args.block_size or min(1024, config.n_positions)
        if block > config.n_positions:
            raise ArgumentError(f"--block_size {block} is longer than the model's n_positions "
                                f"{config.n_positions}; lower --block_size or use a config with more positions")
    elif model_type == "t5":
        from spmdlm.data.tokenizer import T5_NUM_SENTINELS

        # Validates the lengths, and that a T5 tokenizer's 100 sentinels cover every span, before any data is read.
        _span_corruption(args, range(T5_NUM_SENTINELS), eos_id=1, decoder_start_id=0)


def _span_corruption(args: RunArgs, sentinels, eos_id: int, decoder_start_id: int):
    from spmdlm.data.objectives.t5 import SpanCorruption

    try:
        return SpanCorruption(
            inputs_length=args.max_seq_length or T5_MAX_SEQ_LENGTH, sentinel_ids=tuple(int(s) for s in sentinels),
            eos_id=eos_id, noise_density=args.mlm_probability or 0.15,
            mean_noise_span_length=args.mean_noise_span_length, decoder_start_id=decoder_start_id,
        )
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def build_objective(model_type: str, config, args: RunArgs, tok):
    if model_type == "gpt2":
        from spmdlm.data.objectives.clm import CausalLM

        return CausalLM(args.block_size or min(1024, config.n_positions))
    if model_type == "t5":
        from spmdlm.data.tokenizer import sentinel_ids

        return _span_corruption(args, sentinel_ids(tok), special_token_ids(tok, "t5")["eos"],
                                config.decoder_start_token_id)
    raise ArgumentError(f"no objective for model_type {model_type!r}")


def prepare_data(args: RunArgs, objective, tok, model_type: str, train_docs, val_docs) -> Data:
    ids = special_token_ids(tok, model_type)
    cache = Path(args.cache_dir or Path.home() / ".cache" / "spmdlm")
    common = dict(record_length=objective.record_length, separator_id=ids["eos"], cache_dir=cache,
                  overwrite_cache=args.overwrite_cache)

    def prepare(docs, name):
        split = sources.prepare_split(docs, tok, name=name, **common) if is_main() else None
        if jax.process_count() > 1:  # the others wait for process 0's file, then read the same cache
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"prepared {name}")
            if not is_main():
                split = sources.prepare_split(docs, tok, name=name, **{**common, "overwrite_cache": False})
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
    return Data(train, validation)


def evaluate(stepper: Stepper, state, data: Data, objective, args: RunArgs, mesh) -> dict[str, float]:
    global_batch = args.per_device_eval_batch_size * batch_axis_size(mesh)
    totals: dict[str, Any] = {}
    for batch in pipeline.eval_batches(data.validation, objective, seed=args.seed, global_batch=global_batch,
                                       max_examples=args.max_eval_samples, process_index=jax.process_index(),
                                       process_count=jax.process_count()):
        sums = stepper.eval_step(state, pipeline.to_global(batch, mesh))
        totals = sums if not totals else jax.tree.map(jnp.add, totals, sums)
    totals = jax.device_get(totals)
    tokens = max(float(totals["tokens"]), 1.0)
    loss = float(totals["loss_sum"]) / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)),
            "eval_accuracy": float(totals["correct"]) / tokens, "eval_tokens": tokens}


def run(args: RunArgs) -> dict[str, Any]:
    run_start = time.perf_counter()
    # -- everything that can be refused is checked before any file is written ------------------------------------
    mesh = make_mesh(args.mesh)
    global_batch = global_batch_size(args, mesh)
    out = Path(args.output_dir)
    if args.model_name_or_path:
        from spmdlm.export import read_hf_config

        config = read_hf_config(args.model_name_or_path)
    else:
        config_name = args.config_name or (str(out) if (out / "config.json").exists()
                                           else DEFAULT_PRESETS.get(args.model_type, args.model_type))
        config = load_config(config_name, args.model_type)
        if args.vocab_size:
            config = config.replace(vocab_size=args.vocab_size)
    model_type = config.model_type
    arch = get_architecture(model_type)
    check_lengths(model_type, config, args)
    train_docs, val_docs = read_corpora(args)
    previous_path = out / "run_config.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else {}
    resuming = check_output_dir(args, config)
    if args.push_to_hub:
        log.warning("--push_to_hub: spmdlm does not upload (it never uses the network); the model will be exported "
                    "to %s — upload that folder with `huggingface-cli upload` from a connected machine", out / "hf")
    if is_main():
        out.mkdir(parents=True, exist_ok=True)

    # -- tokenizer, objective, data ------------------------------------------------------------------------------
    tok, tokenizer_origin = get_tokenizer(args, config, model_type, train_docs)
    trained_tokenizer = tokenizer_origin == "trained" or (
        tokenizer_origin == "output_dir" and bool(previous.get("trained_tokenizer")))
    if tok.get_vocab_size() > config.vocab_size:
        raise ArgumentError(f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                            f"{config.vocab_size}; use --vocab_size/a config with vocab_size >= "
                            f"{tok.get_vocab_size()} or a smaller tokenizer")
    fields = {f.name for f in dataclasses.fields(config)}
    config = config.replace(**{f"{k}_token_id": v for k, v in special_token_ids(tok, model_type).items()
                               if v is not None and f"{k}_token_id" in fields})
    objective = build_objective(model_type, config, args, tok)
    data = prepare_data(args, objective, tok, model_type, train_docs, val_docs)

    # -- state -----------------------------------------------------------------------------------------------------
    total_steps = 0
    if data.train is not None:
        schedule = pipeline.make_schedule(data.train.num_records, global_batch, args.num_train_epochs, args.max_steps)
        total_steps = schedule.total_steps
    optim = OptimConfig(
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, adafactor=args.adafactor,
        max_grad_norm=args.max_grad_norm, warmup_steps=args.warmup_steps, lr_scheduler_type=args.lr_scheduler_type,
    )
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32

    def build():
        model = arch.model_class(config, rngs=nnx.Rngs(params=args.seed), dtype=dtype,
                                 remat=args.gradient_checkpointing)
        return model, nnx.Optimizer(model, make_optimizer(optim, model, max(total_steps, 1)), wrt=nnx.Param)

    # Resuming restores into an abstract state: the fresh init would be a second copy of everything.
    graphdef, state = create_train_state(build, mesh, abstract=resuming)
    if args.model_name_or_path and not resuming:
        from spmdlm.export import load_hf_into_state

        state = load_hf_into_state(args.model_name_or_path, graphdef, state)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)))
    stepper = Stepper(graphdef, state, mesh, grad_accum=args.gradient_accumulation_steps, z_loss=args.z_loss,
                      dropout_seed=args.seed, schedule=learning_rate_schedule(optim, max(total_steps, 1)))
    run_config = {**args.to_json(), "global_batch": global_batch, "model_config": config.to_hf_dict(),
                  "trained_tokenizer": trained_tokenizer}
    if is_main():
        (out / "run_config.json").write_text(json.dumps(run_config, indent=2))

    log.info("model %s: %.2fM parameters | mesh %s | global batch %d (%d per device x %d batch devices x %d "
             "accumulation) | %d steps", model_type, n_params / 1e6, dict(mesh.shape), global_batch,
             global_batch // (batch_axis_size(mesh) * args.gradient_accumulation_steps), batch_axis_size(mesh),
             args.gradient_accumulation_steps, total_steps)

    reporter = Reporter(out, enabled=is_main(), config=config, objective=objective, global_batch=global_batch,
                        mesh=mesh, dtype=args.dtype, run_start=run_start)
    results: dict[str, Any] = {"total_steps": total_steps, "parameters": n_params}
    step = 0
    if data.train is not None:
        stats = stepper.compile_train(state, pipeline.batch_spec(objective, global_batch))
        reporter.compile_stats(stats)
        if args.dry_run:
            return {**results, **stats}
        iterator = pipeline.train_batches(data.train, objective, seed=args.seed, global_batch=global_batch,
                                          num_epochs=schedule.num_epochs, process_index=jax.process_index(),
                                          process_count=jax.process_count())
        manager = checkpoint.make_manager(out, save_interval_steps=1, max_to_keep=args.save_total_limit)
        if resuming:
            state, step = checkpoint.restore(manager, None, state, iterator)
            log.info("resumed from the checkpoint at step %d", step)
            reporter.truncate_after(step)
        results.update(train_loop(args, stepper, state, iterator, manager, data, objective, mesh, reporter, step,
                                  total_steps, run_config))
        state = results.pop("state")
        manager.wait_until_finished()
        manager.close()
    elif resuming:  # evaluation only: of the latest checkpoint
        manager = checkpoint.make_manager(out, read_only=True)
        state, step = checkpoint.restore(manager, None, state)
        log.info("evaluating the checkpoint at step %d", step)
    if data.validation is not None and args.evaluating:
        metrics = evaluate(stepper, state, data, objective, args, mesh)
        reporter.log_eval(step if data.train is None else total_steps, metrics)
        results.update(metrics)
    if is_main():
        (out / "eval_results.json").write_text(json.dumps(
            {k: v for k, v in results.items() if k.startswith("eval_") or k.startswith("train_")}, indent=2))
        reporter.finish(results)
    if args.export_hf and data.train is not None:
        from spmdlm.export import export_state

        export_state(graphdef, state, config, out / "hf", tokenizer=tok)
    return results


def train_loop(args, stepper, state, iterator, manager, data, objective, mesh, reporter, start_step, total_steps,
               run_config) -> dict[str, Any]:
    pending: list[dict] = []  # device-side metrics since the last log; fetched only at log time
    reporter.start(start_step, total_steps)
    step = start_step
    train_loss = float("nan")
    while step < total_steps:
        batch = pipeline.to_global(next(iterator), mesh)
        state, metrics = stepper.train_step(state, batch, step)
        step += 1
        pending.append(metrics)
        if step % args.logging_steps == 0 or step == total_steps:
            train_loss = reporter.log_train(step, jax.device_get(pending))
            pending = []
        else:
            reporter.tick(step)
        if data.validation is not None and args.evaluating and step % args.eval_steps == 0 and step < total_steps:
            reporter.log_eval(step, evaluate(stepper, state, data, objective, args, mesh))
        if step % args.save_steps == 0 or step == total_steps:
            checkpoint.save(manager, step, state, iterator, run_config, force=True)
    return {"state": state, "train_loss": train_loss, **reporter.throughput()}
