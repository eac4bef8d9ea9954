"""Orbax checkpoints of everything a run needs to continue exactly: model, optimizer, step, data iterator, config.

Layout: OUTPUT_DIR/checkpoints/<step>/{model, optimizer, data, config}: pure dicts of the model's and the
optimizer's NNX state (its step counter included), the Grain iterator position, and the run's arguments as JSON.
Model and optimizer are separate items so an export can restore the parameters alone.
Every process takes part in save and restore (orbax coordinates the writes).

Integrity: each save records a fingerprint of every array (a position-weighted sum of its bits, computed on the
devices) in its config item, and refuses a state that is not finite. A restore recomputes and compares them, so
flipped bytes that still decode are caught; a checkpoint that fails is moved aside to OUTPUT_DIR/damaged_checkpoints
(never deleted) and the run falls back to the newest one that restores.

An output dir in a bucket (gs://) works the same: orbax writes through epath and tensorstore (spmdlm/storage.py
configures both), and marks a finished step with commit_success.txt instead of a rename, which GCS does not have.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from spmdlm import storage
from spmdlm.crashpoints import crash_point
from spmdlm.errors import CheckpointError, NonFiniteStateError
from spmdlm.models.stack import stack_layers, unstack_layers

log = logging.getLogger("spmdlm")


ITEMS = ("model", "optimizer", "data", "config")
# 2: scanned layers (stacked parameters). Checkpoints of format 1 (spmdlm 0.1, one parameter per layer) cannot be
# restored into the stacked state; their run_config.json has no "checkpoint_format".
FORMAT = 2
DAMAGED_DIR = "damaged_checkpoints"

# Orbax splits each replicated shard among its replicas for writing (replica-parallel saving), slicing it with one
# jitted dispatch per shard and replica before the save goes asynchronous: ~1 ms each, so a save of a small
# model's ~300 arrays on 8 devices held the step ~1.4 s. Slices under 1 MiB buy no write bandwidth worth that;
# bigger ones are still split. The files written are the same either way.
MIN_REPLICA_SLICE_BYTES = 1 << 20


class _QuietOrbax(logging.Filter):
    """orbax warns on every read-only manager (resume checks, export) that it is read-only, and when a type handler
    is replaced (ours, below): not news to anyone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(
            ("CheckpointManagerOptions.read_only=True", "Given directory is read only", "Type handler registry type")
        )


logging.getLogger("absl").addFilter(_QuietOrbax())
ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES),
    override=True,
)


def checkpoint_dir(output_dir: str | Path) -> Path:
    return storage.absolute(storage.path(output_dir, "--output_dir")) / "checkpoints"


def make_manager(
    output_dir: str | Path,
    *,
    save_interval_steps: int = 1,
    max_to_keep: int | None = None,
    keep_every_n_steps: int | None = None,
    async_save: bool = True,
    read_only: bool = False,
) -> ocp.CheckpointManager:
    """`max_to_keep`: the latest checkpoints kept (None: all); `keep_every_n_steps`: those of steps that are
    multiples of N are kept besides, forever (orbax's preservation policies)."""
    retention = {"max_to_keep": max_to_keep}
    if keep_every_n_steps:
        policies = ocp.checkpoint_managers
        retention = {
            "preservation_policy": policies.AnyPreservationPolicy(
                [policies.LatestN(n=max_to_keep), policies.EveryNSteps(interval_steps=keep_every_n_steps)]
            )
        }
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        read_only=read_only,
        create=not read_only,
        **retention,
    )
    return ocp.CheckpointManager(
        checkpoint_dir(output_dir),
        options=options,
        item_names=ITEMS,
        item_handlers={"data": grain.checkpoint.CheckpointHandler()} if not read_only else None,
    )


# -- fingerprints ----------------------------------------------------------------------------------------------------
def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (one per element)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return x.astype(jnp.uint32)


def _leaf_fingerprint(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(checksum, finite): the sum of word * (2·position + 1) modulo 2**32. Integer sums wrap and are exact in any
    order, so the same bits give the same checksum on any mesh; odd weights catch swapped as well as changed words."""
    words = _words(x)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim) * np.uint32(stride % 2**32)
        stride *= words.shape[dim]
    checksum = jnp.sum(words * (position * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return checksum, finite


@jax.jit
def _fingerprints(tree):
    return jax.tree.map(_leaf_fingerprint, tree)


def fingerprint(tree) -> tuple[dict[str, int], list[str]]:
    """-> ({array path: checksum}, [paths of arrays holding NaN or infinity]) of a pure-dict tree."""
    prints = jax.device_get(_fingerprints(tree))
    checksums, bad = {}, []
    for path, (checksum, finite) in jax.tree_util.tree_leaves_with_path(prints, is_leaf=lambda x: isinstance(x, tuple)):
        key = jax.tree_util.keystr(path)
        checksums[key] = int(checksum)
        if not finite:
            bad.append(key)
    return checksums, bad


def _items_of(state) -> dict[str, Any]:
    model, optimizer = stack_layers(nnx.to_pure_dict(state)).values()  # per-layer stacks saved stacked: one format
    return {"model": model, "optimizer": optimizer}


# -- save ------------------------------------------------------------------------------------------------------------
def save(
    manager: ocp.CheckpointManager, step: int, state, data_iterator, run_config: dict[str, Any], force: bool = False
) -> bool:
    """Start an asynchronous save; refuses a non-finite state (nothing is written then)."""
    items = _items_of(state)
    checksums, bad = fingerprint(items)
    if bad:
        raise NonFiniteStateError(f"the state at step {step} holds NaN or infinity (first in {bad[0]})")
    args = ocp.args.Composite(
        model=ocp.args.StandardSave(items["model"]),
        optimizer=ocp.args.StandardSave(items["optimizer"]),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave({**run_config, "fingerprints": checksums}),
    )
    try:
        crash_point("checkpoint.before_save", checkpoint_dir_of(manager, step))
        saving = manager.save(step, args=args, force=force)
        crash_point("checkpoint.during_save", checkpoint_dir_of(manager, step))
        return saving
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; the user needs the path and the OS error
        # it may be the previous save's failure, surfacing here
        raise save_error(manager, None, e, needed=sum(x.nbytes for x in jax.tree.leaves(items))) from None


def check_saved(manager: ocp.CheckpointManager, step: int | None = None, *, wait: bool = False) -> None:
    """Surface a failed asynchronous save now (one line), not at the next save; `wait` for the one in flight."""
    try:
        manager.wait_until_finished() if wait else manager.check_for_errors()
        if wait:
            crash_point("checkpoint.after_commit", checkpoint_dir_of(manager, step))
    except Exception as e:  # noqa: BLE001
        raise save_error(manager, step, e) from None


def close(manager: ocp.CheckpointManager) -> None:
    """Close, also after a failed save (whose error was reported already): its threads must not outlive the run."""
    try:
        manager.close()
    except Exception as e:  # noqa: BLE001
        log.debug("closing the checkpoint manager: %s", describe(e))


def checkpoint_dir_of(manager: ocp.CheckpointManager, step: int | None):
    return storage.path(str(manager.directory)) / str(step if step is not None else "")


def save_error(manager, step: int | None, error: BaseException, needed: int | None = None) -> CheckpointError:
    """One line: the folder, the OS's words and, for a full disk, the bytes the save needs (`needed`: the arrays'
    size, where known) and those free."""
    cause = root_cause(error)
    full_disk = (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "os_error_code='28'" in str(cause)
    hint = (
        "free some space or point --output_dir at a bigger disk"
        if full_disk
        else "check that the directory is writable"
    )
    at = f"at step {step} " if step is not None else ""
    # tensorstore's full-disk errors carry only an error code, deep in a long line: say it in words
    what = describe(cause)
    if full_disk and "No space left" not in what:
        what = f"No space left on device ({what})"
    if full_disk:
        what = f"{what}; {storage.space_note(manager.directory, needed)}"
    return CheckpointError(f"saving the checkpoint {at}in {manager.directory} failed: {what}; {hint}")


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of a chain (orbax wraps OS errors in its own), preferring an OSError."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return next((e for e in seen if isinstance(e, OSError)), seen[-1])


def describe(error: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    text = str(error).strip().splitlines()
    if not text:
        return type(error).__name__
    line = text[0] if len(text[0]) <= 400 else f"{text[0][:220]} ... {text[0][-160:]}"  # the OS error is at the end
    return f"{type(error).__name__}: {line}"


def check_format(run_config: dict, run_dir) -> None:
    """Refuse, in one line, checkpoints written with another parameter layout."""
    found = run_config.get("checkpoint_format", 1)
    if found != FORMAT:
        raise CheckpointError(
            f"{run_dir} holds checkpoints of format {found} (spmdlm 0.1: one parameter per layer); this version "
            f"stacks layers (format {FORMAT}) and cannot resume or export them: export them with spmdlm 0.1 and "
            "continue with --model_name_or_path, or start afresh with --overwrite_output_dir"
        )


# -- restore ---------------------------------------------------------------------------------------------------------
def abstract_of(state):
    """Shapes, dtypes and shardings of a (possibly already sharded) state: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def restore(manager: ocp.CheckpointManager, step: int | None, state, data_iterator=None, *, model_only=False):
    """Restore into `state`'s shardings (so a run may resume on another mesh) and verify; returns (state, step).

    `state` is the (model, optimizer) state, or with `model_only` just the model's. Raises CheckpointError (one
    line) if the checkpoint cannot be read or does not match its fingerprints.
    """
    step = resolve_step(manager, step)
    layout = nnx.to_pure_dict(abstract_of(state))
    target = stack_layers(layout)  # checkpoints hold stacked layers, whichever layout `state` has
    if model_only:
        items = {"model": ocp.args.StandardRestore(target)}
    else:
        items = {"model": ocp.args.StandardRestore(target[0]), "optimizer": ocp.args.StandardRestore(target[1])}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    items["config"] = ocp.args.JsonRestore()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint fails in many ways (tensorstore, json, grain)
        raise CheckpointError(f"the checkpoint at step {step} cannot be read ({describe(root_cause(e))})") from None
    arrays = {k: restored[k] for k in ("model", "optimizer") if k in items}
    verify(arrays, (restored["config"] or {}).get("fingerprints"), step)
    pure = arrays["model"] if model_only else {0: arrays["model"], 1: arrays["optimizer"]}
    nnx.replace_by_pure_dict(state, unstack_layers(pure, layout))
    return state, step


def verify(arrays: dict[str, Any], saved: dict[str, int] | None, step: int) -> None:
    if not saved:
        raise CheckpointError(f"the checkpoint at step {step} has no fingerprints (its config item is damaged)")
    checksums, bad = fingerprint(arrays)
    if bad:
        raise CheckpointError(f"the checkpoint at step {step} holds NaN or infinity (in {bad[0]})")
    wrong = [k for k, v in checksums.items() if saved.get(k) != v]
    if wrong:
        raise CheckpointError(
            f"the checkpoint at step {step} does not match its fingerprints ({len(wrong)} "
            f"arrays differ, first {wrong[0]})"
        )


def restore_newest_good(
    manager: ocp.CheckpointManager, state, data_iterator=None, *, move_aside: bool = True, **kwargs
):
    """Restore the newest checkpoint that reads and verifies; each newer one that does not is reported in one line
    and (with `move_aside`) moved to OUTPUT_DIR/damaged_checkpoints. Returns (state, step).

    A reader (no `move_aside`: export, evaluate, generate) of a run that is saving meanwhile takes the newest
    committed checkpoint; one that the run deletes while it is read (--save_total_limit) is no damage: the newest
    committed one is listed again and read instead."""
    failures, tried = [], set()
    steps = all_complete_steps(manager, move_aside=move_aside)
    for _ in range(MAX_VANISHED + len(steps)):
        untried = sorted(set(steps) - tried, reverse=True)
        if not untried:
            break
        step = untried[0]
        tried.add(step)
        try:
            return restore(manager, step, state, data_iterator, **kwargs)
        except CheckpointError as e:
            if not move_aside and vanished(manager, step):
                log.warning(
                    "the checkpoint at step %d was deleted while it was read (the run saving in %s keeps "
                    "--save_total_limit checkpoints); reading the newest committed one instead",
                    step,
                    storage.path(str(manager.directory)).parent,
                )
                manager.reload()
                steps = list(manager.all_steps())
                continue
            failures.append(e)
            where = set_aside(manager, step) if move_aside else None
            log.warning(
                "%s; %s", e, f"moved it to {where}, trying the previous one" if where else "trying the previous one"
            )
    if move_aside:  # training: the damaged ones were moved aside, and the run may start afresh
        raise CheckpointError(
            f"no checkpoint in {manager.directory} can be restored (damaged ones are in "
            f"{storage.path(str(manager.directory)).parent / DAMAGED_DIR}); start afresh with "
            "--overwrite_output_dir"
        )
    # export, generate and evaluate read only: nothing moved, and the cause is often a model other than
    # run_config.json's. The newest's cause, cut short: each one's whole cause is in its warning line above.
    newest = f" ({shortened(str(failures[0]), CAUSE_CHARS)})" if failures else ""
    raise CheckpointError(
        f"no checkpoint in {manager.directory} can be restored into the model its run_config.json "
        f"describes{newest}; check that the checkpoints are this run's"
    )


MAX_VANISHED = 20  # checkpoints deleted under a reader, one after the other, before it gives up
VANISH_WAIT_SECONDS = 2.0  # a deletion in progress (its files first, the folder last) ends within this


def vanished(manager: ocp.CheckpointManager, step: int) -> bool:
    """Whether the step folder a restore failed on was deleted meanwhile by the run saving in that output dir (its
    --save_total_limit; another process holds its lock): gone now, or going within VANISH_WAIT_SECONDS."""
    if not run_is_saving(manager):
        return False
    folder = storage.path(str(manager.directory)) / str(step)
    deadline = time.monotonic() + VANISH_WAIT_SECONDS
    while folder.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run_is_saving(manager: ocp.CheckpointManager) -> bool:
    """Another process, a training run, holds the output dir's lock: it may be writing or deleting checkpoints."""
    return storage.held_by_another(storage.path(str(manager.directory)).parent / storage.RUN_LOCK_NAME)


CAUSE_CHARS = 70  # of a cause repeated in a closing error line (tensorstore's name whole files and byte ranges)


def shortened(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


TMP_MARK = ".orbax-checkpoint-tmp"  # a local step being written: <step>.orbax-checkpoint-tmp..., renamed on commit


def all_complete_steps(manager: ocp.CheckpointManager, *, move_aside: bool) -> list[int]:
    """Steps orbax lists (committed); a numbered step folder it does not list (emptied, its metadata lost) is set
    aside. A reader (no `move_aside`) of a run that is saving (it holds the lock) says in one line that a newer one
    is being written: a step folder committed since the listing is listed again, and one orbax does not list, being
    written (a temporary folder; in a bucket, one without its commit mark) or deleted (--save_total_limit), is
    not damage."""
    steps = list(manager.all_steps())
    root = storage.path(str(manager.directory))
    folders = sorted(root.iterdir()) if root.is_dir() else []
    if any(f.name.isdigit() and int(f.name) not in steps for f in folders):
        manager.reload()  # committed since the manager listed them (a rename, or its commit mark, came meanwhile)
        steps = list(manager.all_steps())
    saving = not move_aside and run_is_saving(manager)
    writing = [int(f.name.split(".")[0]) for f in folders if TMP_MARK in f.name and f.name.split(".")[0].isdigit()]
    for folder in folders:
        if not folder.name.isdigit() or int(folder.name) in steps:
            continue
        if saving:  # the run writes it now (a bucket: no commit mark yet), or deletes it (--save_total_limit)
            if int(folder.name) > max(steps, default=-1):
                writing.append(int(folder.name))
            else:
                log.info("the checkpoint at step %s is being deleted by the run saving; skipping it", folder.name)
            continue
        where = set_aside(manager, int(folder.name)) if move_aside else None
        log.warning(
            "the checkpoint at step %s is incomplete or damaged%s",
            folder.name,
            f"; moved it to {where}" if where else "; skipping it",
        )
    writing = [step for step in writing if step > max(steps, default=-1)]
    if writing and saving:
        newest = max(steps, default=None)
        log.warning(
            "a newer checkpoint (step %d) is being written by the run saving in %s; %s",
            max(writing),
            root.parent,
            f"reading the newest committed one (step {newest})" if newest is not None else "none is committed yet",
        )
    if not steps:
        raise CheckpointError(f"no checkpoints in {manager.directory}; train first or point at another output dir")
    return steps


def set_aside(manager: ocp.CheckpointManager, step: int, why: str = "") -> Path | None:
    """Move a damaged step folder out of the manager's sight, to OUTPUT_DIR/damaged_checkpoints/<step>-<time>[-why]
    (a diverged one: why="diverged"; process 0 moves; every process waits for it)."""
    source = storage.path(str(manager.directory)) / str(step)
    name = f"{step}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-{why}" if why else "")
    target = source.parent.parent / DAMAGED_DIR / name
    if jax.process_index() == 0 and source.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.move(source, target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    manager.reload()
    return target


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = manager.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoints in {manager.directory}; train first or point at another output dir")
    if step is None:
        return max(steps)
    if step not in steps:
        raise CheckpointError(
            f"no checkpoint at step {step} in {manager.directory}; available: {', '.join(map(str, sorted(steps)))}"
        )
    return step
