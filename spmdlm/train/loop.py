"""The training loop of every family (steps, logging, evaluation and samples on their cadence, checkpoints, loss
spikes and divergence, stop signals) and the evaluation it runs: the train and evaluate stages of a run
(spmdlm/train/run.py lists the stages).
"""

from __future__ import annotations

import functools
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
from spmdlm.data.mixture import MixedSplit
from spmdlm.errors import DivergenceError, NonFiniteStateError, Preempted
from spmdlm.families.base import Generation
from spmdlm.generation import fill_mask, generate
from spmdlm.generation.harness import flat_metrics, harness_lm, run_tasks
from spmdlm.mesh import batch_axis_size
from spmdlm.run_args import RunArgs
from spmdlm.train import profiling, publish, watchdog
from spmdlm.train.guard import StopOnSignal
from spmdlm.train.report import Reporter
from spmdlm.train.setup import (
    RunContext,
)
from spmdlm.train.step import Stepper, model_for_evaluation

log = logging.getLogger("spmdlm")


def abandoned(stop: StopOnSignal | None) -> bool:
    if stop is not None and stop.requested and jax.process_count() == 1:
        log.warning("evaluation abandoned: saving first")
        return True
    return False


def evaluate(
    stepper: Stepper, state, ctx: RunContext, stop: StopOnSignal | None = None, watch: watchdog.Watchdog | None = None
) -> dict[str, float] | None:
    """Eval metrics over the validation split (a mixture: each source's, as eval/<source>/loss etc., and all of them
    token-weighted under the plain names); None when a stop signal arrived meanwhile (single process: the save comes
    first, as a preemption's grace period is short; several processes finish it, as every one must). `watch` hears
    of each finished batch."""
    args = ctx.args
    global_batch = args.control.per_device_eval_batch_size * batch_axis_size(ctx.mesh)
    per_split: dict[str | None, Any] = {}
    for name, split in ctx.data.validation_splits.items():
        totals: dict[str, Any] = {}
        for batch in pipeline.eval_batches(
            split,
            ctx.objective,
            seed=args.control.seed,
            global_batch=global_batch,
            max_examples=args.data.max_eval_samples,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        ):
            if abandoned(stop):
                return None
            totals = eval_step_in_turn(stepper, state, pipeline.to_global(batch, ctx.mesh), totals)
            if watch is not None:
                watch.beat("an evaluation batch")
        per_split[name] = totals
    if abandoned(stop):
        return None
    per_split = jax.device_get(per_split)
    results = summarise(functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), per_split.values()))
    for name, totals in per_split.items():
        if name is not None:
            results.update(
                {
                    f"eval/{name}/{key.removeprefix('eval_')}": value
                    for key, value in summarise(totals).items()
                    if not key.endswith("_all_positions")
                }
            )
    return results


def eval_step_in_turn(stepper: Stepper, state, batch, totals: dict[str, Any]) -> dict[str, Any]:
    """`totals` plus `batch`'s sums, dispatched with at most one eval step in flight: the step before has finished.

    Why not dispatch ahead: on simulated CPU devices (threads of this process) XLA starts each program's part on
    each device as a task of one thread pool, and a device that holds its limit of started, unfinished programs
    makes the next start wait for one of them to finish. A loop that dispatched all of its steps at once let a busy
    host start later steps on one device before an earlier one; those wait for the earlier one's sums, the earlier
    one's start waits for them, and its part on the other device waits in an all-reduce for good (`rendezvous ...
    waiting for all reduce`: a stack dump shows one start blocked on the device's semaphore). One step in flight
    never reaches that limit; the host prepares the next batch meanwhile, as in training.
    """
    if not totals:
        totals = stepper.eval_zeros(state, batch)
    summed = stepper.eval_step(state, batch, totals)
    jax.block_until_ready(totals)  # the previous step's output: that step has finished
    return summed


def summarise(totals: dict[str, Any]) -> dict[str, float]:
    """Loss, perplexity, accuracy, tokens, and bits per byte and bytes (docs/evaluation.md) of eval sums: of the
    objective's scored labels first, when it has them, then of all positions."""

    def metrics(prefix: str, suffix: str = "") -> dict[str, float]:
        tokens = max(float(totals[f"{prefix}tokens"]), 1.0)
        loss = float(totals[f"{prefix}loss_sum"]) / tokens
        out = {
            f"eval_loss{suffix}": loss,
            f"eval_perplexity{suffix}": math.exp(min(loss, 50.0)),
            f"eval_accuracy{suffix}": float(totals[f"{prefix}correct"]) / tokens,
            f"eval_tokens{suffix}": tokens,
        }
        if f"{prefix}bytes" in totals:  # summed nats over the bytes the labels stand for, in bits
            size = int(totals[f"{prefix}bytes"])
            out[f"eval_bits_per_byte{suffix}"] = float(totals[f"{prefix}loss_sum"]) / max(size, 1) / math.log(2)
            out[f"eval_bytes{suffix}"] = size
        return out

    if "scored_tokens" not in totals:
        return metrics("")
    return {**metrics("scored_"), **metrics("", "_all_positions")}


class TasksAbandoned(Exception):
    """A stop signal arrived while LM-harness tasks ran: the save goes first."""


def task_metrics(ctx: RunContext, graphdef, state, stop: StopOnSignal | None = None) -> dict[str, float] | None:
    """--eval_tasks on the parameters evaluation reads, as {eval_tasks/<task>/<metric>: value}; None when a stop
    signal arrived meanwhile (as `evaluate`). Every process takes part (the model is sharded); process 0 reports."""
    args = ctx.args
    model, _ = model_for_evaluation(graphdef, state, args.optimization)

    def interrupt() -> None:
        if abandoned(stop):
            raise TasksAbandoned

    lm = harness_lm(
        ctx.family,
        model,
        ctx.tokenizer,
        ctx.mesh,
        interrupt=interrupt,
        seed=args.control.seed,
        batch_size=args.control.per_device_eval_batch_size * batch_axis_size(ctx.mesh),
    )
    try:
        results = run_tasks(
            lm,
            args.reporting.eval_tasks,
            manager=ctx.tasks,
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


def train_loop(
    ctx: RunContext, stepper: Stepper, state, iterator, manager, reporter: Reporter, start_step: int, run_config: dict
) -> dict[str, Any]:
    args, total_steps = ctx.args, ctx.total_steps
    pending: list[dict] = []  # device-side metrics since the last log; fetched only at log time
    reporter.start(start_step, total_steps)
    step = start_step
    last_saved = start_step
    train_loss = float("nan")
    clock = SaveClock(args.control.save_every_minutes)
    skipped = 0  # steps skipped as loss spikes so far (--skip_step_on_spike), as last logged
    me, took = jax.process_index(), reporter.goodput.span
    ops = args.operations
    profiler = profiling.Profiler(ops.profile_window, ops.profile_every, ops.profile_all_hosts, ctx.out, me)
    watch = watchdog.Watchdog(ops.hang_timeout(jax.process_count()), ctx.out, watchdog.host_label(me))
    with StopOnSignal() as stop, reporter, watch, profiler:
        while step < total_steps:
            with took("data_wait"):
                batch = pipeline.to_global(next(iterator), ctx.mesh)
            with profiler.at_step(step + 1, state):
                state, metrics = stepper.train_step(state, batch, step)
            step += 1
            reporter.goodput.step_done(step, metrics)  # waits for the step before: its completion is timed
            watch.beat(f"step {step - 1}")
            pending.append(metrics)
            if step % args.reporting.logging_steps == 0 or step == total_steps:
                fetched = jax.device_get(pending)
                check_finite(fetched, step, last_saved, args)  # no extra sync: these metrics are fetched anyway
                skipped = say_skipped(fetched, step, skipped)
                train_loss = reporter.log_train(step, fetched)
                pending = []
            else:
                reporter.tick(step)
            checkpoint.check_saved(manager, last_saved)  # a failed async save stops the run now, not at the next
            evaluate_between_steps(ctx, stepper, state, step, reporter, stop, watch)
            stopping = stop.should_stop(step)
            if step % args.control.save_steps == 0 or step == total_steps or stopping or clock.due():
                with took("checkpoint"):
                    save(manager, step, state, iterator, run_config, pending, last_saved, args)
                watch.beat(f"the save at step {step}")
                last_saved = step
                clock.saved()
                reporter.sync()  # a bucket output dir: the metrics up to the checkpoint are there with it
                if not stopping:  # a preemption's grace period is for the checkpoint
                    publish.push_checkpoint(ctx, stepper.graphdef, state, step, manager)
            if stopping:
                checkpoint.check_saved(manager, step, wait=True)
                raise Preempted(stop.signum, step, checkpoint.checkpoint_dir(ctx.out) / str(step))
        reporter.goodput.steps_finished()
        profiler.close(state)
    return {"state": state, "train_loss": train_loss, **reporter.throughput()}


def evaluate_between_steps(
    ctx: RunContext, stepper: Stepper, state, step: int, reporter: Reporter, stop: StopOnSignal, watch
) -> None:
    """What runs after step `step` when it is due: the held-out evaluation, --eval_tasks, the samples."""
    args, took = ctx.args, reporter.goodput.span
    before_the_end = step < ctx.total_steps
    if (
        ctx.data.validation_splits
        and args.control.evaluating
        and step % args.reporting.eval_steps == 0
        and before_the_end
    ):
        with took("evaluation"):
            metrics = evaluate(stepper, state, ctx, stop)
        watch.beat(f"the evaluation at step {step}")
        if metrics is not None:
            reporter.log_eval(step, metrics)
    tasks_every = args.reporting.eval_tasks_steps
    if ctx.tasks is not None and tasks_every and step % tasks_every == 0 and before_the_end:
        with took("evaluation"):
            metrics = task_metrics(ctx, stepper.graphdef, state, stop)
        if metrics:
            reporter.log_tasks(step, metrics)
    if args.reporting.sample_prompts and (step % args.reporting.sample_every == 0 or step == ctx.total_steps):
        with took("evaluation"):
            reporter.log_samples(step, samples(ctx, stepper.graphdef, state, step))


def source_epochs(ctx: RunContext) -> dict[str, Any]:
    """A mixture's epochs reached by each source over the run's examples (logged; kept in eval_results.json)."""
    train = ctx.data.train
    if not isinstance(train, MixedSplit):
        return {}
    epochs = train.epochs_reached(ctx.args.control.seed, ctx.total_steps * ctx.global_batch)
    log.info("epochs reached per source: %s", ", ".join(f"{name} {value:.3g}" for name, value in epochs.items()))
    return {"train_source_epochs": epochs}


def samples(ctx: RunContext, graphdef, state, step: int) -> list[dict[str, Any]]:
    """What the model makes of --sample_prompts now: a greedy and a sampled continuation of each (RoBERTa: its top
    candidates for each <mask>). Every process takes part (the model is sharded); process 0 reports."""
    model, _ = model_for_evaluation(graphdef, state, ctx.args.optimization)
    prompts = split_prompts(ctx.args.reporting.sample_prompts, ctx.tokenizer)
    if ctx.family.generation is Generation.FILL_MASK:
        return [
            {
                "prompt": p,
                "fill_mask": [
                    [token for token, _, _ in candidates]
                    for candidates in fill_mask(model, ctx.config, ctx.tokenizer, p, 3)
                ],
            }
            for p in prompts
        ]
    common = dict(max_new_tokens=min(32, ctx.config.max_length // 2))
    greedy = generate(model, ctx.config, ctx.tokenizer, prompts, temperature=0.0, **common)
    sampled = generate(model, ctx.config, ctx.tokenizer, prompts, temperature=0.8, top_k=50, seed=step, **common)
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
