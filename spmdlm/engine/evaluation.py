"""Held-out evaluation, the same for a run (spmdlm/train/loop.py) and for python -m spmdlm.evaluate: the steps
(`make_stepper`, the one place they are built, for a run and for a model alone) and the metrics over the validation
splits (`evaluate`), summed token-weighted; docs/evaluation.md says what each figure counts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from spmdlm.data import pipeline
from spmdlm.data.objectives import Objective
from spmdlm.data.records import PreparedSplit
from spmdlm.data.tokenization import token_byte_lengths
from spmdlm.engine.step import Loss, Stepper, Training, with_average
from spmdlm.families.base import Forward
from spmdlm.mesh import batch_axis_size
from spmdlm.run_args.sections import ControlArgs, OptimizationArgs


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """What an evaluation reads: the validation splits by source name (None: the one corpus's), the objective that
    makes their examples, and how they are batched (`seed`: the masks and spans; `max_examples` per split)."""

    splits: Mapping[str | None, PreparedSplit]
    objective: Objective
    seed: int
    global_batch: int
    max_examples: int | None = None


def held_out_of(splits, objective: Objective, control: ControlArgs, mesh: Mesh, max_examples: int | None) -> HeldOut:
    """The evaluation of `splits` as a run's control section says (--seed, --per_device_eval_batch_size on the batch
    devices of `mesh`), at most `max_examples` (--max_eval_samples) of each."""
    global_batch = control.per_device_eval_batch_size * batch_axis_size(mesh)
    return HeldOut(splits, objective, control.seed, global_batch, max_examples)


def loss_of(objective: Objective, optim: OptimizationArgs | None = None) -> Loss:
    """How the steps sum the loss for `objective`: over its scored labels (MLM's label capacity; T5's sentinels
    unscored), with a run's --z_loss and --loss_chunk_size (`optim`; an evaluation alone: neither)."""
    return Loss(
        z_loss=optim.z_loss if optim else 0.0,
        loss_chunk=optim.loss_chunk_size if optim else 0,
        label_capacity=objective.label_capacity,
        unscored=objective.unscored_label_ids,
    )


def byte_lengths(tokenizer, vocab_size: int) -> np.ndarray | None:
    """Each vocabulary id's UTF-8 bytes, for bits per byte; None without a tokenizer (--compile_for: the eval step
    compiles without the one gather it adds)."""
    return None if tokenizer is None else token_byte_lengths(tokenizer, vocab_size)


def make_stepper(
    graphdef,
    state,
    mesh: Mesh,
    forward: Forward,
    loss: Loss,
    byte_counts: np.ndarray | None,
    training: Training = Training(),
) -> Stepper:
    """The steps of a model, built here for a run (its train state and `training`) and for python -m
    spmdlm.evaluate (a model alone: `state` holds its parameters, no optimizer) alike, so both evaluate the same:
    the eval step sums `loss` and, with `byte_counts` (`byte_lengths`), the bytes for bits per byte."""
    return Stepper(graphdef, state, mesh, forward, loss=loss, training=training, byte_lengths=byte_counts)


def evaluate(
    stepper: Stepper,
    state,
    held_out: HeldOut,
    should_stop: Callable[[], bool] = lambda: False,
    on_batch: Callable[[], None] = lambda: None,
) -> dict[str, float] | None:
    """Eval metrics over the validation splits (a mixture: each source's, as eval/<source>/loss etc., and all of them
    token-weighted under the plain names); None when `should_stop` says so between batches (a run's stop signal).
    `on_batch` hears of each finished batch (a hang watchdog's heartbeat). A run that keeps an average of its
    parameters (--ema_decay) is evaluated with it too, by the same eval step: eval_ema_loss, eval/<source>/ema_loss
    etc."""
    results = evaluate_weights(stepper, state, held_out, should_stop, on_batch)
    averaged = with_average(stepper.graphdef, state) if results and stepper.optim and stepper.optim.ema_decay else None
    if averaged is None:
        return results
    of_average = evaluate_weights(stepper, averaged, held_out, should_stop, on_batch)
    if of_average is None:
        return None
    return {**results, **{ema_key(key): value for key, value in of_average.items()}}


def ema_key(key: str) -> str:
    """The name of an evaluation result of the average: eval_loss -> eval_ema_loss, eval/<source>/loss ->
    eval/<source>/ema_loss (TensorBoard: eval/ema_loss)."""
    head, _, name = key.rpartition("/")
    return f"{head}/ema_{name}" if head else f"eval_ema_{key.removeprefix('eval_')}"


def evaluate_weights(
    stepper: Stepper,
    state,
    held_out: HeldOut,
    should_stop: Callable[[], bool],
    on_batch: Callable[[], None],
) -> dict[str, float] | None:
    """`evaluate` of the parameters in `state` (the eval step's: model_for_evaluation)."""
    per_split: dict[str | None, Any] = {}
    for name, split in held_out.splits.items():
        totals: dict[str, Any] = {}
        for batch in pipeline.eval_batches(
            split,
            held_out.objective,
            seed=held_out.seed,
            global_batch=held_out.global_batch,
            max_examples=held_out.max_examples,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        ):
            if should_stop():
                return None
            totals = eval_step_in_turn(stepper, state, pipeline.to_global(batch, stepper.mesh), totals)
            on_batch()
        per_split[name] = totals
    if should_stop():
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
