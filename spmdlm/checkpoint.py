"""Orbax checkpoints of everything a run needs to continue exactly: model, optimizer, step, data iterator, config.

Layout: OUTPUT_DIR/checkpoints/<step>/{model, optimizer, data, config}: pure dicts of the model's and the
optimizer's NNX state (its step counter included), the Grain iterator position, and the run's arguments as JSON.
Model and optimizer are separate items so an export can restore the parameters alone.
Every process takes part in save and restore (orbax coordinates the writes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

log = logging.getLogger(__name__)


ITEMS = ("model", "optimizer", "data", "config")
# 2: scanned layers (stacked parameters). Checkpoints of format 1 (spmdlm 0.1, one parameter per layer) cannot be
# restored into the stacked state; their run_config.json has no "checkpoint_format".
FORMAT = 2


class CheckpointError(ValueError):
    """No checkpoint where one was expected, or a step that does not exist."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir).absolute() / "checkpoints"


def make_manager(output_dir: str | Path, *, save_interval_steps: int = 1, max_to_keep: int | None = None,
                 async_save: bool = True, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save, read_only=read_only, create=not read_only,
    )
    return ocp.CheckpointManager(
        checkpoint_dir(output_dir), options=options, item_names=ITEMS,
        item_handlers={"data": grain.checkpoint.CheckpointHandler()} if not read_only else None,
    )


def save(manager: ocp.CheckpointManager, step: int, state, data_iterator, run_config: dict[str, Any],
         force: bool = False) -> bool:
    model, optimizer = nnx.to_pure_dict(state).values()
    args = ocp.args.Composite(
        model=ocp.args.StandardSave(model),
        optimizer=ocp.args.StandardSave(optimizer),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave(run_config),
    )
    return manager.save(step, args=args, force=force)


def check_format(run_config: dict, run_dir) -> None:
    """Refuse, in one line, checkpoints written with another parameter layout."""
    found = run_config.get("checkpoint_format", 1)
    if found != FORMAT:
        raise CheckpointError(
            f"{run_dir} holds checkpoints of format {found} (spmdlm 0.1: one parameter per layer); this version "
            f"stacks layers (format {FORMAT}) and cannot resume or export them: export them with spmdlm 0.1 and "
            "continue with --model_name_or_path, or start afresh with --overwrite_output_dir")


def abstract_of(state):
    """Shapes, dtypes and shardings of a (possibly already sharded) state: the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def restore(manager: ocp.CheckpointManager, step: int | None, state, data_iterator=None, *, model_only=False):
    """Restore into `state`'s shardings (so a run may resume on another mesh); returns (state, step).

    `state` is the (model, optimizer) state, or with `model_only` just the model's.
    """
    step = resolve_step(manager, step)
    target = nnx.to_pure_dict(abstract_of(state))
    if model_only:
        items = {"model": ocp.args.StandardRestore(target)}
    else:
        items = {"model": ocp.args.StandardRestore(target[0]), "optimizer": ocp.args.StandardRestore(target[1])}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    pure = restored["model"] if model_only else {0: restored["model"], 1: restored["optimizer"]}
    nnx.replace_by_pure_dict(state, pure)
    return state, step


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = manager.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoints in {manager.directory}; train first or point at another output dir")
    if step is None:
        return max(steps)
    if step not in steps:
        raise CheckpointError(f"no checkpoint at step {step} in {manager.directory}; available: "
                              f"{', '.join(map(str, sorted(steps)))}")
    return step
