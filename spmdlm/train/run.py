"""A training run, stage by stage, in order: `run_stages` names them. Each stage is a function of what the earlier
ones produced: the run's context (spmdlm/train/setup.py RunContext: the arguments, mesh, model config and family,
filled in as the stages go) and the pieces a stage hands on (documents, the reporter, the model's state, results).

resolve (everything that can be refused before a file is written; spmdlm/train/setup.py) -> documents (read and
refused before the output dir is touched; spmdlm/train/corpora.py) -> output dir (refuse, resume or clear;
spmdlm/train/outputs.py) -> tokenizer -> data (tokenized or opened prepared) -> state (the sharded model and
optimizer) -> compile (and the memory gate) -> train (or restore; spmdlm/train/loop.py) -> evaluate -> export and
publish (spmdlm/train/publish.py).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from typing import Any

import jax
from flax import nnx

from spmdlm import checkpoint
from spmdlm.data import pipeline
from spmdlm.errors import RunError
from spmdlm.generation.harness import TASK_METRICS
from spmdlm.hf_export import export_state, what_it_needs
from spmdlm.mesh import batch_axis_size
from spmdlm.run_args import RunArgs
from spmdlm.train import publish
from spmdlm.train.corpora import prepare_data, read_documents, training_texts
from spmdlm.train.guard import RunLock
from spmdlm.train.loop import evaluate, source_epochs, task_metrics, train_loop
from spmdlm.train.metrics_log import write_json
from spmdlm.train.outputs import (
    check_fingerprints,
    check_output_dir,
    export_done,
    missing_outputs,
    outputs_undone_on_failure,
    prepare_output_dir,
    read_results,
    write_run_files,
)
from spmdlm.train.report import Reporter
from spmdlm.train.setup import RunContext, check_memory, is_main, resolve, setup_state, setup_tokenizer
from spmdlm.train.state import count_parameters
from spmdlm.train.step import Stepper, model_for_evaluation
from spmdlm.train.trackers import is_eval_key

log = logging.getLogger("spmdlm")


@dataclasses.dataclass
class Model:
    """The state stage's pieces: the model's graph, its sharded train state and the compiled steps around them."""

    graphdef: Any
    state: Any
    stepper: Stepper
    parameters: int


def run(args: RunArgs) -> dict[str, Any]:
    if args.control.dry_running:  # writes nothing: the records go to a scratch cache, removed at the end
        with tempfile.TemporaryDirectory(prefix="spmdlm-dry-run-") as scratch:
            return run_stages(args.replace(cache_dir=scratch))
    return run_stages(args)


def run_stages(args: RunArgs) -> dict[str, Any]:
    """The run: its stages in order."""
    ctx = resolve(args, time.perf_counter())
    ctx.hub = publish.hub_for(ctx)  # a bad repository id or no token: refused before anything is written
    documents = read_documents(ctx)
    # the lock before anything is written or removed in the output dir (a dry run does neither)
    with RunLock(ctx.out, enabled=is_main() and not args.control.dry_running):
        prepare_output_dir(ctx, check_output_dir(ctx))
        setup_tokenizer(ctx, training_texts(ctx, documents))
        prepare_data(ctx, documents)
        check_resumable(ctx)
        reporter = make_reporter(ctx)
        with outputs_undone_on_failure(ctx):  # a tracker that cannot start, a step that does not fit: nothing left
            start_trackers(ctx, reporter)
            model = build_model(ctx)
            previous = read_results(ctx.out) if ctx.resuming else {}
            results = {"total_steps": ctx.total_steps, "parameters": model.parameters}
            if finished_before(ctx, previous):
                return finish_again(ctx, {**results, **previous})
            stats = compile_step(ctx, model, reporter) if ctx.steps_left else None
        if args.control.dry_running:  # reported in the log only: nothing is written
            return {**results, **(stats or {})}
        step, trained = train(ctx, model, reporter, write_run_files(ctx), stats, results, previous)
        results.update(evaluate_model(ctx, model, reporter, step, previous, kept=ctx.training and not trained))
        export_and_publish(ctx, model, reporter, {**previous, **results}, trained)
        return results


def check_resumable(ctx: RunContext) -> None:
    """The data and tokenizer a resumed run finds are those it started with, and its step is within this run's."""
    check_fingerprints(ctx)
    if ctx.training and ctx.latest_step > ctx.total_steps:  # it would report and export a later model
        raise RunError(
            f"--output_dir {ctx.out} holds a checkpoint at step {ctx.latest_step}, past this run's "
            f"{ctx.total_steps} steps; give --max_steps {ctx.latest_step} or more to continue it, or use "
            "another --output_dir"
        )


def make_reporter(ctx: RunContext) -> Reporter:
    return Reporter(
        ctx.out,
        enabled=is_main(),
        family=ctx.family,
        config=ctx.config,
        objective=ctx.objective,
        global_batch=ctx.global_batch,
        mesh=ctx.mesh,
        dtype=ctx.args.model.dtype,
        run_start=ctx.run_start,
        args=ctx.args,
    )


def start_trackers(ctx: RunContext, reporter: Reporter) -> None:
    """First of the work under the output dir: a login or a server that fails costs no set-up."""
    if ctx.steps_left and not ctx.args.control.dry_run:
        reporter.start_trackers(ctx.latest_step)


def build_model(ctx: RunContext) -> Model:
    """The sharded train state (abstract when resuming: the checkpoint fills it), logged with the run's shape."""
    graphdef, state, stepper = setup_state(ctx, abstract=ctx.resuming)
    model = Model(graphdef, state, stepper, count_parameters(graphdef, state))
    log.info(
        "model %s (config %s): %.2fM parameters | mesh %s | global batch %d (%d per device x %d batch devices "
        "x %d accumulation) | %d steps",
        ctx.family.name,
        ctx.config_source,
        model.parameters / 1e6,
        dict(ctx.mesh.shape),
        ctx.global_batch,
        ctx.per_device_batch,
        batch_axis_size(ctx.mesh),
        ctx.args.control.gradient_accumulation_steps,
        ctx.total_steps,
    )
    return model


def finished_before(ctx: RunContext, previous: dict[str, Any]) -> bool:
    """A finished run found whole (its evaluation and export there): nothing to do."""
    if not ctx.training or ctx.latest_step < ctx.total_steps or missing_outputs(ctx, previous):
        return False
    log.info(
        "the run in %s is complete (step %d of %d) and its evaluation and export are there: nothing to do "
        "(--overwrite_output_dir starts afresh)",
        ctx.out,
        ctx.latest_step,
        ctx.total_steps,
    )
    return True


def finish_again(ctx: RunContext, results: dict[str, Any]) -> dict[str, Any]:
    if ctx.args.output.push_to_hub:  # re-running a finished run retries its upload
        publish.publish_export(ctx, results)
    return results


def compile_step(ctx: RunContext, model: Model, reporter: Reporter) -> dict[str, Any]:
    """The train step compiled and refused before anything is written when it cannot fit (the output dir is left
    as it was)."""
    with reporter.goodput.span("compile"):
        stats = model.stepper.compile_train(model.state, pipeline.batch_spec(ctx.objective, ctx.global_batch))
    check_memory(stats, ctx)
    reporter.compile_stats(stats)
    return stats


def train(ctx: RunContext, model: Model, reporter: Reporter, run_config: dict, stats, results, previous):
    """Train from the newest good checkpoint (or from scratch) to the last step; evaluation only: restore the
    newest. -> (the step the model is at, whether steps ran); `results` takes the training's."""
    if not ctx.training:
        return (restore_for_evaluation(ctx, model) if ctx.resuming else 0), False
    args = ctx.args
    manager = checkpoint.make_manager(
        ctx.out,
        save_interval_steps=1,
        max_to_keep=args.control.save_total_limit,
        keep_every_n_steps=args.control.keep_every_n_steps,
    )
    iterator = pipeline.train_batches(
        ctx.data.train,
        ctx.objective,
        seed=args.control.seed,
        global_batch=ctx.global_batch,
        num_epochs=ctx.schedule.num_epochs,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    step, trained = 0, False
    try:
        if ctx.resuming:
            with reporter.goodput.span("checkpoint"):
                model.state, step = checkpoint.restore_newest_good(manager, model.state, iterator)
            log.info("resumed from the checkpoint at step %d", step)
            reporter.truncate_after(step)
        if step < ctx.total_steps:
            if stats is None:  # the finished run's last checkpoint was damaged: train again from an older one
                compile_step(ctx, model, reporter)
            done = train_loop(ctx, model.stepper, model.state, iterator, manager, reporter, step, run_config)
            model.state, trained = done.pop("state"), True
            results.update(done, **source_epochs(ctx))
        else:  # finished before: keep its training results, redo only what is missing
            results.update({k: v for k, v in previous.items() if k.startswith("train_")})
        with reporter.goodput.span("checkpoint"):
            checkpoint.check_saved(manager, wait=True)
    finally:
        checkpoint.close(manager)
    return ctx.total_steps, trained


def restore_for_evaluation(ctx: RunContext, model: Model) -> int:
    """Evaluation only: the latest checkpoint's state, read in place."""
    manager = checkpoint.make_manager(ctx.out, read_only=True)
    model.state, step = checkpoint.restore_newest_good(manager, model.state, move_aside=False)
    log.info("evaluating the checkpoint at step %d", step)
    return step


def evaluate_model(ctx: RunContext, model: Model, reporter: Reporter, step: int, previous, *, kept: bool) -> dict:
    """The held-out metrics and --eval_tasks at the end (`kept`: a finished run's own, where it only redoes what is
    missing)."""
    out: dict[str, Any] = {}
    if ctx.data.validation_splits and ctx.args.control.evaluating:
        if kept and "eval_loss" in previous:
            out.update({k: v for k, v in previous.items() if is_eval_key(k)})
        else:
            with reporter.goodput.span("evaluation"):
                out.update(metrics := evaluate(model.stepper, model.state, ctx))
            reporter.log_eval(step, metrics)
    if ctx.tasks is not None:
        before = {k: v for k, v in previous.items() if k.startswith(TASK_METRICS + "/")}
        with reporter.goodput.span("evaluation"):
            metrics = before if kept and before else task_metrics(ctx, model.graphdef, model.state)
        if metrics and metrics is not before:
            reporter.log_tasks(step, metrics)
        out.update(metrics or {})
    return out


def export_and_publish(ctx: RunContext, model: Model, reporter: Reporter, results: dict, trained: bool) -> None:
    """eval_results.json and the summary; the export (the parameters evaluation reads) unless one is there from
    the same training; the model card, and the upload with --push_to_hub."""
    if is_main():
        if trained:  # goodput is of an invocation that trained; one that only redoes outputs keeps the run's
            results.update(reporter.log_goodput(ctx.total_steps))
        write_json(
            ctx.out / "eval_results.json",
            {k: v for k, v in results.items() if is_eval_key(k) or k.startswith(("train_", "goodput"))},
            "eval_results.before_write",
        )
        reporter.finish(results)
    if ctx.args.output.export_hf and ctx.training and (trained or not export_done(ctx.out)):
        evaluated = nnx.state(model_for_evaluation(model.graphdef, model.state, ctx.args.optimization))
        export_state(model.graphdef, evaluated, ctx.config, ctx.out / "hf", tokenizer=ctx.tokenizer)
        log.info("exported to %s: %s", ctx.out / "hf", what_it_needs(ctx.family, ctx.out / "hf"))
    publish.publish_export(ctx, results)
