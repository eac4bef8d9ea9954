"""The train and evaluate stages of a run (spmdlm/train/run.py lists the stages): training from the newest good
checkpoint, or restoring it to evaluate, as one frozen `Trained`; the training loop of every family (steps, logging,
evaluation and samples on their cadence, checkpoints, loss spikes and divergence, stop signals); the held-out
evaluation (spmdlm/engine/evaluation.py) and --eval_tasks at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from spmdlm import checkpoint
from spmdlm.data import pipeline
from spmdlm.data.batch_ramp import RAMP_FLAG, stage_at
from spmdlm.data.mixture import MixedSplit
from spmdlm.engine import monitors
from spmdlm.engine.evaluation import evaluate
from spmdlm.engine.step import Stepper, model_for_evaluation
from spmdlm.errors import DivergenceError, NonFiniteStateError, Preempted, RunError
from spmdlm.families.base import Generation
from spmdlm.generation import fill_mask, generate
from spmdlm.generation.harness import TASK_METRICS, flat_metrics, harness_lm, run_tasks
from spmdlm.mesh import batch_axis_size
from spmdlm.run_args import RunArgs
from spmdlm.train import publish
from spmdlm.train.prepared import Prepared
from spmdlm.train.reporting import profiling
from spmdlm.train.reporting.report import Reporter
from spmdlm.train.reporting.trackers import is_eval_key
from spmdlm.train.safety import divergence, watchdog
from spmdlm.train.safety.guard import StopOnSignal
from spmdlm.train.stages.program import Model, check_memory, compile_step

log = logging.getLogger("spmdlm")


@dataclasses.dataclass(frozen=True)
class Trained:
    """The train stage's result: the train state the model is at, its step, whether steps ran in this invocation,
    and the training's results (train_loss, throughput, a mixture's epochs; a finished run's own kept)."""

    state: Any
    step: int
    trained: bool
    results: dict


def train(prepared: Prepared, model: Model, reporter: Reporter, run_config: dict, stats, previous: dict) -> Trained:
    """Train from the newest good checkpoint (or from scratch) to the last step; evaluation only: restore the
    newest."""
    run = prepared.run
    if not prepared.training:
        if not prepared.output_dir.resuming:
            return Trained(model.state, 0, False, {})
        return restore_for_evaluation(prepared, model)
    manager = checkpoint.make_manager(
        run.out,
        save_interval_steps=1,
        max_to_keep=run.args.control.save_total_limit,
        keep_every_n_steps=run.args.control.keep_every_n_steps,
    )
    iterator = pipeline.train_batches(
        prepared.data.train,
        prepared.data.objective,
        seed=run.args.control.seed,
        global_batch=run.ramp,
        num_epochs=prepared.schedule.num_epochs,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    state, step, trained, results = model.state, 0, False, {}
    try:
        if prepared.output_dir.resuming:
            with reporter.goodput.span("checkpoint"):
                state, step = checkpoint.restore_newest_good(manager, state, iterator)
            log.info("resumed from the checkpoint at step %d", step)
            reporter.truncate_after(step)
        if step < prepared.total_steps:
            if stats is None:  # the finished run's last checkpoint was damaged: train again from an older one
                compile_step(model, prepared.data.objective, run, reporter)
            done = train_loop(prepared, model.stepper, state, iterator, manager, reporter, step, run_config)
            state, trained = done.pop("state"), True
            results = {**done, **source_epochs(prepared)}
        else:  # finished before: keep its training results, redo only what is missing
            results = {k: v for k, v in previous.items() if k.startswith("train_")}
        with reporter.goodput.span("checkpoint"):
            checkpoint.check_saved(manager, wait=True)
    finally:
        checkpoint.close(manager)
    return Trained(state, prepared.total_steps, trained, results)


def restore_for_evaluation(prepared: Prepared, model: Model) -> Trained:
    """Evaluation only: the latest checkpoint's state, read in place."""
    manager = checkpoint.make_manager(prepared.run.out, read_only=True)
    state, step = checkpoint.restore_newest_good(manager, model.state, move_aside=False)
    log.info("evaluating the checkpoint at step %d", step)
    return Trained(state, step, False, {})


def evaluate_model(prepared: Prepared, model: Model, trained: Trained, reporter: Reporter, previous: dict) -> dict:
    """The held-out metrics and --eval_tasks at the end (a finished run's own, where it only redoes what is
    missing)."""
    kept = prepared.training and not trained.trained
    out: dict[str, Any] = {}
    if prepared.data.validation_splits and prepared.run.args.control.evaluating:
        if kept and "eval_loss" in previous:
            out.update({k: v for k, v in previous.items() if is_eval_key(k)})
        else:
            with reporter.goodput.span("evaluation"):
                out.update(metrics := evaluate(model.stepper, trained.state, prepared.held_out()))
            reporter.log_eval(trained.step, metrics)
    if prepared.run.tasks is not None:
        before = {k: v for k, v in previous.items() if k.startswith(TASK_METRICS + "/")}
        with reporter.goodput.span("evaluation"):
            metrics = before if kept and before else task_metrics(prepared, model.graphdef, trained.state)
        if metrics and metrics is not before:
            reporter.log_tasks(trained.step, metrics)
        out.update(metrics or {})
    return out


def abandoned(stop: StopOnSignal | None) -> bool:
    if stop is not None and stop.requested and jax.process_count() == 1:
        log.warning("evaluation abandoned: saving first")
        return True
    return False


class TasksAbandoned(Exception):
    """A stop signal arrived while LM-harness tasks ran: the save goes first."""


def task_metrics(prepared: Prepared, graphdef, state, stop: StopOnSignal | None = None) -> dict[str, float] | None:
    """--eval_tasks on the parameters evaluation reads, as {eval_tasks/<task>/<metric>: value}; None when a stop
    signal arrived meanwhile (as `evaluate`). Every process takes part (the model is sharded); process 0 reports."""
    args = prepared.run.args
    model, _ = model_for_evaluation(graphdef, state, args.optimization)

    def interrupt() -> None:
        if abandoned(stop):
            raise TasksAbandoned

    lm = harness_lm(
        prepared.run.family,
        model,
        prepared.vocabulary.tokenizer,
        prepared.run.mesh,
        interrupt=interrupt,
        seed=args.control.seed,
        batch_size=args.control.per_device_eval_batch_size * batch_axis_size(prepared.run.mesh),
    )
    try:
        results = run_tasks(
            lm,
            args.reporting.eval_tasks,
            manager=prepared.run.tasks,
            limit=args.reporting.eval_tasks_limit,
            seed=args.control.seed,
        )
    except TasksAbandoned:
        return None
    except Exception as e:  # noqa: BLE001 - lm-eval's own (a task's dataset, a metric): never the run's outputs
        log.warning(
            "--eval_tasks failed at this step (%s: %s); training, evaluation and the export go on",
            type(e).__name__,
            str(e).strip().partition("\n")[0],
        )
        return {}
    return flat_metrics(results)


def watchers(prepared: Prepared, me: int) -> tuple[profiling.Profiler, watchdog.Watchdog]:
    """The loop's profiler (--profile_steps) and hang watchdog (--hang_timeout_minutes), for process `me`."""
    ops, out = prepared.run.args.operations, prepared.run.out
    return (
        profiling.Profiler(ops.profile_window, ops.profile_every, ops.profile_all_hosts, out, me),
        watchdog.Watchdog(ops.hang_timeout(jax.process_count()), out, watchdog.host_label(me)),
    )


def train_loop(
    prepared: Prepared,
    stepper: Stepper,
    state,
    iterator,
    manager,
    reporter: Reporter,
    start_step: int,
    run_config: dict,
) -> dict[str, Any]:
    args, total_steps = prepared.run.args, prepared.total_steps
    pending: list[dict] = []  # device-side metrics since the last log; fetched only at log time
    reporter.start(start_step, total_steps)
    step = last_saved = start_step
    train_loss = float("nan")
    clock = SaveClock(args.control.save_every_minutes)
    bound = divergence.LossBound.for_run(args, prepared.vocabulary.config.vocab_size, total_steps)
    skipped = 0  # steps skipped as loss spikes so far (--skip_step_on_spike), as last logged
    me, took = jax.process_index(), reporter.goodput.span
    profiler, watch = watchers(prepared, me)
    with StopOnSignal() as stop, reporter, watch, profiler:
        while step < total_steps:
            start_stage(prepared, stepper, state, (step, start_step), reporter)
            with took("data_wait"):
                batch = pipeline.to_global(next(iterator), prepared.run.mesh)
            with profiler.at_step(step + 1, state):
                state, metrics = stepper.train_step(state, batch, step)
            step += 1
            if stepper.monitors_at(step - 1):  # fetched now: only a monitor step waits for its step
                reporter.log_monitors(step, jax.device_get(pop_monitors(metrics)))
            reporter.goodput.step_done(step, metrics)  # waits for the step before: its completion is timed
            watch.beat(f"step {step - 1}")
            pending.append(metrics)
            if step % args.reporting.logging_steps == 0 or step == total_steps:
                fetched = jax.device_get(pending)
                check_finite(fetched, step, last_saved, args)  # no extra sync: these metrics are fetched anyway
                bound.check(fetched, step, manager, args)  # a finite loss past the run's own bound: divergence too
                skipped = say_skipped(fetched, step, skipped)
                train_loss = reporter.log_train(step, fetched)
                pending = []
            else:
                reporter.tick(step)
            checkpoint.check_saved(manager, last_saved)  # a failed async save stops the run now, not at the next
            evaluate_between_steps(prepared, stepper, state, step, reporter, stop, watch)
            stopping = stop.should_stop(step)
            if step % args.control.save_steps == 0 or step == total_steps or stopping or clock.due():
                with took("checkpoint"):
                    save(manager, step, state, iterator, run_config, pending, last_saved, args)
                watch.beat(f"the save at step {step}")
                last_saved = step
                clock.saved()
                reporter.sync()  # a bucket output dir: the metrics up to the checkpoint are there with it
                if not stopping:  # a preemption's grace period is for the checkpoint
                    publish.push_checkpoint(prepared, stepper.graphdef, state, step, manager)
            if stopping:
                checkpoint.check_saved(manager, step, wait=True)
                raise Preempted(stop.signum, step, checkpoint.checkpoint_dir(prepared.run.out) / str(step))
        reporter.goodput.steps_finished()
        profiler.close(state)
    return {"state": state, "train_loss": train_loss, **reporter.throughput()}


def start_stage(prepared: Prepared, stepper: Stepper, state, steps: tuple[int, int], reporter: Reporter) -> None:
    """At `steps` (the step about to run, the loop's first): where a --batch_size_ramp stage begins (or where the
    loop begins, in one), its program made current (compiled the first time, and refused like the first when it
    cannot fit) and one line saying its batch. Nothing without a ramp: the step compiled before the loop is the
    only one."""
    run, (step, first) = prepared.run, steps
    if not run.ramp.ramps or (step not in run.ramp.steps and step != first):
        return
    if step == first and (unreached := run.ramp.unreached(prepared.total_steps)):
        log.warning("%s", unreached)
    stage = stage_at(run.stages, step)
    if stage.passed:  # the newest checkpoints were damaged, and the one restored lies in a stage planned as passed
        raise RunError(
            f"the checkpoint restored is at step {step}, in the {RAMP_FLAG} stage of {stage.global_batch} sequences, "
            f"which this run was not planned to take again (the newer checkpoints were set aside as damaged); run "
            "the same command again on the mesh it had, whose batch devices divide it"
        )
    with reporter.goodput.span("compile"):
        spec = pipeline.batch_spec(prepared.data.objective, stage.global_batch)
        stats = stepper.compile_train(state, spec, stage.accumulation)
    check_memory(stats, stage.per_device)
    reporter.goodput.slow.forget()  # steps of another size: the slow-step median starts over
    log.info(
        "step %d: global batch %d (%d per device x %d batch devices x %d accumulation; --batch_size_ramp %s)",
        step,
        stage.global_batch,
        stage.per_device,
        batch_axis_size(run.mesh),
        stage.accumulation,
        run.ramp.spec(),
    )


def pop_monitors(metrics: dict) -> dict:
    """A monitor step's `monitor/...` metrics, taken out of the ones the logging step sums."""
    return {key: metrics.pop(key) for key in [k for k in metrics if k.startswith(monitors.PREFIX)]}


def evaluate_between_steps(
    prepared: Prepared, stepper: Stepper, state, step: int, reporter: Reporter, stop: StopOnSignal, watch
) -> None:
    """What runs after step `step` when it is due: the held-out evaluation, --eval_tasks, the samples."""
    args, took = prepared.run.args, reporter.goodput.span
    before_the_end = step < prepared.total_steps
    if (
        prepared.data.validation_splits
        and args.control.evaluating
        and step % args.reporting.eval_steps == 0
        and before_the_end
    ):
        with took("evaluation"):
            metrics = evaluate(stepper, state, prepared.held_out(), lambda: abandoned(stop))
        watch.beat(f"the evaluation at step {step}")
        if metrics is not None:
            reporter.log_eval(step, metrics)
    tasks_every = args.reporting.eval_tasks_steps
    if prepared.run.tasks is not None and tasks_every and step % tasks_every == 0 and before_the_end:
        with took("evaluation"):
            metrics = task_metrics(prepared, stepper.graphdef, state, stop)
        if metrics:
            reporter.log_tasks(step, metrics)
    if args.reporting.sample_prompts and (step % args.reporting.sample_every == 0 or step == prepared.total_steps):
        with took("evaluation"):
            reporter.log_samples(step, samples(prepared, stepper.graphdef, state, step))


def source_epochs(prepared: Prepared) -> dict[str, Any]:
    """A mixture's epochs reached by each source over the run's examples (logged; kept in eval_results.json)."""
    train = prepared.data.train
    if not isinstance(train, MixedSplit):
        return {}
    examples = prepared.run.ramp.examples_before(prepared.total_steps)
    epochs = train.epochs_reached(prepared.run.args.control.seed, examples)
    log.info("epochs reached per source: %s", ", ".join(f"{name} {value:.3g}" for name, value in epochs.items()))
    return {"train_source_epochs": epochs}


def samples(prepared: Prepared, graphdef, state, step: int) -> list[dict[str, Any]]:
    """What the model makes of --sample_prompts now: a greedy and a sampled continuation of each (RoBERTa: its top
    candidates for each <mask>). Every process takes part (the model is sharded); process 0 reports."""
    args, config, tok = prepared.run.args, prepared.vocabulary.config, prepared.vocabulary.tokenizer
    model, _ = model_for_evaluation(graphdef, state, args.optimization)
    prompts = split_prompts(args.reporting.sample_prompts, tok)
    if prepared.run.family.generation is Generation.FILL_MASK:
        return [
            {
                "prompt": p,
                "fill_mask": [
                    [token for token, _, _ in candidates] for candidates in fill_mask(model, config, tok, p, 3)
                ],
            }
            for p in prompts
        ]
    common = dict(max_new_tokens=min(32, config.max_length // 2))
    greedy = generate(model, config, tok, prompts, temperature=0.0, **common)
    sampled = generate(model, config, tok, prompts, temperature=0.8, top_k=50, seed=step, **common)
    return [{"prompt": p, "greedy": g, "sampled": s} for p, g, s in zip(prompts, greedy, sampled)]


def split_prompts(text: str, tokenizer) -> list[str]:
    """--sample_prompts split at |, except within the tokenizer's special tokens (GPT-2's <|endoftext|>)."""
    kept = sorted(
        (t.content for t in tokenizer.get_added_tokens_decoder().values() if "|" in t.content), key=len, reverse=True
    )
    parts = re.split(f"({'|'.join(map(re.escape, kept))})|\\|" if kept else r"(\|)", text)  # text, bar, text, ...
    prompts, current = [], parts[0]
    for token, after in zip(parts[1::2], parts[2::2]):
        if token in (None, "|"):  # a bare bar: the next prompt
            prompts, current = prompts + [current], after
        else:
            current += token + after
    return [p for p in prompts + [current] if p.strip()]


def save(
    manager, step: int, state, iterator, run_config: dict, pending: list[dict], last_saved: int, args: RunArgs
) -> None:
    """Checkpoint, unless the metrics not yet logged (fetched here) or the state itself are not finite."""
    check_finite(jax.device_get(pending), step, last_saved, args)
    try:
        checkpoint.save(manager, step, state, iterator, run_config, force=True)
    except NonFiniteStateError as e:
        raise DivergenceError(f"training diverged by step {step}: {e}; {_advice(last_saved, args)}") from None


def say_skipped(fetched: list[dict], step: int, before: int) -> int:
    """Log the steps --skip_step_on_spike skipped since the last log; -> the count so far."""
    total = int(fetched[-1].get("skipped_steps", 0))
    if total > before:
        log.warning(
            "%d step%s up to step %d skipped as loss spikes (their updates not applied); %d in all",
            total - before,
            "s" * (total - before > 1),
            step,
            total,
        )
    return total


class SaveClock:
    """--save_every_minutes: whether that long passed since the last save. Process 0's clock decides for every
    process (a save is collective), told to the others by one small broadcast per step, only on several hosts."""

    def __init__(self, minutes: float):
        self.seconds, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        if not self.seconds:
            return False
        due = time.monotonic() - self.last >= self.seconds
        if jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    def saved(self) -> None:
        self.last = time.monotonic()


def check_finite(fetched: list[dict], step: int, last_saved: int, args: RunArgs) -> None:
    """A loss or gradient norm that is not finite stops the run (exit 3); with --skip_step_on_spike such a step was
    skipped (its update never applied), and --max_consecutive_skips skipped steps in a row stop it instead."""
    first = step - len(fetched) + 1
    for offset, metrics in enumerate(fetched):
        if "consecutive_skips" in metrics and int(metrics["consecutive_skips"]) > 0:
            if int(metrics["consecutive_skips"]) >= args.optimization.max_consecutive_skips:
                raise DivergenceError(
                    f"training diverged at step {first + offset}: {int(metrics['consecutive_skips'])} steps in a "
                    f"row were skipped as loss spikes (--skip_step_on_spike {args.optimization.skip_step_on_spike:g}, "
                    f"--max_consecutive_skips {args.optimization.max_consecutive_skips}); {_advice(last_saved, args)}"
                )
            continue
        loss = float(metrics["loss_sum"]) / max(float(metrics["tokens"]), 1.0)
        grad_norm = float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise DivergenceError(
                f"training diverged at step {first + offset}: loss {loss:.4g}, grad norm "
                f"{grad_norm:.4g}; {_advice(last_saved, args)}"
            )


def _advice(last_saved: int, args: RunArgs) -> str:
    kept = f"the last checkpoint (step {last_saved}) is kept" if last_saved else "no checkpoint was written"
    tries = [f"a lower --learning_rate (now {args.optimization.learning_rate:g})"]
    if not 0 < args.optimization.max_grad_norm <= 1.0:
        tries.append(f"--max_grad_norm 1.0 (now {args.optimization.max_grad_norm:g})")
    tries.append("--z_loss 1e-4" if not args.optimization.z_loss else "more --warmup_steps")
    if args.model.dtype != "float32":
        tries.append("--dtype float32")
    return f"{kept}, nothing after it is saved or exported; try {', '.join(tries)}"
