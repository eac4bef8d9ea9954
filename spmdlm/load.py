"""Any model spmdlm can evaluate, as one `LoadedModel`: a training run (its newest good checkpoint or a given step),
an export, or a transformers directory of one of the families (e.g. a released gpt2 or roberta-base on disk).

    loaded = load_model("runs/gpt2-tiny", make_mesh("data=-1"))            # newest good checkpoint of a run
    loaded = load_model("runs/gpt2-tiny/checkpoints/500", mesh)           # that step
    loaded = load_model("runs/gpt2-tiny/hf", mesh)                        # an export, or any transformers dir

The model is sharded on `mesh` as training shards it; it computes in float32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdlm import checkpoint as ckpt
from spmdlm import hf_export, storage
from spmdlm.checkpoint import checkpoint_dir
from spmdlm.data.tokenization import from_checkpoint, load_tokenizer, tokenizer_layout
from spmdlm.engine.optim import evaluation_needs_optimizer, optimization_of_run
from spmdlm.engine.state import build_train_state
from spmdlm.engine.step import model_for_evaluation, with_average
from spmdlm.errors import ArgumentError, ConfigError, ExportError
from spmdlm.families import checked_config, get_family
from spmdlm.families.base import Family
from spmdlm.hf_export import MARKER, load_hf
from spmdlm.mesh import make_mesh
from spmdlm.models.hf_config import HFConfig

RUN_CONFIG = "run_config.json"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    family: Family
    model: nnx.Module  # sharded on `mesh`
    config: HFConfig
    tokenizer: Any  # a tokenizers.Tokenizer
    mesh: Mesh
    kind: str  # "checkpoint" (of a training run), "export" (spmdlm's) or "transformers" (any other HF directory)
    step: int | None = None  # a checkpoint's step


def load_model(
    path: str | Path, mesh: Mesh, *, step: int | None = None, tokenizer: str | Path | None = None
) -> LoadedModel:
    """`path`: a run's --output_dir (newest good checkpoint, or `step`), one checkpoint of it (RUN/checkpoints/N),
    an export or a transformers directory (config.json and weights). `tokenizer`: a tokenizer.json or directory
    instead of the model's own."""
    where = storage.path(path, "--model_name_or_path")
    run_dir, step = _run_and_step(where, step)
    if run_dir is not None:
        model, config, tokenizer_dir, step = load_run(run_dir, step, mesh)  # the parameters the run evaluated
        return LoadedModel(
            get_family(config.model_type),
            model,
            config,
            load_tokenizer(tokenizer or tokenizer_dir or run_dir),
            mesh,
            "checkpoint",
            step,
        )
    if step is not None:
        raise ArgumentError(f"--step applies to a training run's checkpoints; {where} is a transformers directory")
    if not (where / "config.json").is_file():
        export = where / "hf"  # a run folder without its run_config.json: its export is the model to give
        pointer = f"; its export {export} is one" if (export / "config.json").is_file() else ""
        raise ConfigError(
            f"{where}: no spmdlm run ({RUN_CONFIG}), checkpoint (RUN/checkpoints/N) or transformers "
            f"directory (config.json) there; give one of those{pointer}"
        )
    model, config = load_hf(where, mesh=mesh)
    kind = "export" if (where / MARKER).is_file() else "transformers"
    return LoadedModel(get_family(config.model_type), model, config, load_tokenizer(tokenizer or where), mesh, kind)


def _run_and_step(where, step: int | None):
    """(the run's output dir, the step) when `where` is a run or one of its checkpoints, else (None, step)."""
    if (where / RUN_CONFIG).is_file():
        return where, step
    run_dir = where.parent.parent
    if where.parent.name == checkpoint_dir(run_dir).name and where.name.isdigit() and (run_dir / RUN_CONFIG).is_file():
        if step is not None and step != int(where.name):
            raise ArgumentError(f"--step {step} contradicts the checkpoint {where} (step {where.name}); give one")
        return run_dir, int(where.name)
    return None, step


# -- a training run's checkpoint: the model it evaluated, and its export --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Weights:
    """Which parameters of a run's checkpoints to load (python -m spmdlm.export --weights, --average_last,
    --average_steps): `kind` "raw", those the run evaluated (step.model_for_evaluation), or "ema", their average
    (--ema_decay); with `average_last` N or `average_steps`, the mean of those checkpoints' (each of `kind`)."""

    kind: str = "raw"
    average_last: int = 0
    average_steps: tuple[int, ...] = ()

    def steps_of(self, manager, step: int | None) -> list[int] | None:
        """The checkpoints to average, oldest first (None: one checkpoint, `step` or the newest good one)."""
        if self.average_last < 0:
            raise ArgumentError(f"--average_last {self.average_last}: give a number of checkpoints, e.g. 3")
        if not self.average_last and not self.average_steps:
            return None
        if step is not None:
            raise ArgumentError("--step names one checkpoint; --average_last/--average_steps name several: give one")
        saved = sorted(ckpt.all_complete_steps(manager, move_aside=False))
        if self.average_steps:
            missing = [s for s in self.average_steps if s not in saved]
            if missing:
                raise ExportError(f"--average_steps: no checkpoint at step {missing[0]}; saved: {saved}")
            return sorted(set(self.average_steps))
        if self.average_last > len(saved):
            raise ExportError(f"--average_last {self.average_last}: the run has {len(saved)} checkpoints ({saved})")
        return saved[-self.average_last :]

    def describe(self, steps: list[int], ema_decay: float | None) -> str:
        """What the export holds, in the words of its card."""
        what = (
            f"the exponential moving average of the parameters (--ema_decay {ema_decay:g})"
            if self.kind == "ema"
            else "the parameters"
        )
        if len(steps) == 1:
            return f"{what} of the checkpoint at step {steps[0]}"
        return f"the mean of {what} of the {len(steps)} checkpoints at steps {', '.join(map(str, steps))}"


def open_run(run_dir: str | Path, hint: str) -> tuple[dict, HFConfig, str | Path | None]:
    """(run_config.json, the model's config, the tokenizer it trained with) of a training run's --output_dir;
    `hint` ends the error when `run_dir` holds no run."""
    run_dir = storage.path(run_dir, "--checkpoint")
    run_config_path = run_dir / "run_config.json"
    if not run_config_path.is_file():
        raise ckpt.CheckpointError(f"{run_dir}: no run_config.json, so no spmdlm run here; {hint}")
    try:
        run_config = json.loads(run_config_path.read_text())
    except json.JSONDecodeError as e:
        raise ckpt.CheckpointError(f"{run_config_path} is not valid JSON ({e})") from None
    ckpt.check_format(run_config, run_dir)
    config = checked_config(run_config.get("model_config") or {}, None, str(run_config_path))
    # The tokenizer the run trained with: saved beside its checkpoints (an older run's: --tokenizer_name, else the
    # --model_name_or_path it started from).
    given = [run_dir, run_config.get("tokenizer_name"), run_config.get("model_name_or_path")]
    tokenizer_dir = next(
        (p for p in given if p and (storage.path(p).is_file() or tokenizer_layout(storage.path(p)))), None
    )
    return run_config, config, tokenizer_dir


def load_run(run_dir: str | Path, step: int | None, mesh, *, hint: str = "pass the --output_dir of a training run"):
    """(model, config, tokenizer directory, step) of a training run's newest good checkpoint (a complete one; a
    damaged newer one is reported and left in place), or `step`. `hint` ends the error when `run_dir` holds no run."""
    model, config, tokenizer_dir, steps, _ = load_weights(run_dir, step, mesh, Weights(), hint=hint)
    return model, config, tokenizer_dir, steps[-1]


def load_weights(
    run_dir, step: int | None, mesh, weights: Weights, *, hint: str = "pass a training run's --output_dir"
):
    """(model, config, tokenizer directory, the steps it comes from, what it holds in words) of a training run's
    checkpoints as `weights` chooses: one checkpoint's (`step`, or the newest good one), or the mean of several."""
    run_config, config, tokenizer_dir = open_run(run_dir, hint)
    optim = optimization_of_run(run_config)
    if weights.kind == "ema" and optim.ema_decay is None:
        raise ExportError(f"--weights ema: the run {run_dir} kept no average of its parameters (--ema_decay)")
    family = get_family(config.model_type)
    manager = ckpt.make_manager(storage.path(run_dir), read_only=True)
    load_one = lambda at: _evaluation_model(manager, at, family, config, mesh, optim, weights.kind == "ema")
    steps = weights.steps_of(manager, step)
    if steps is None:
        model, at = load_one(step)
        steps = [at]
    else:
        model = _mean_model(load_one(steps[0])[0], steps[1:], lambda at: load_one(at)[0])
    return model, config, tokenizer_dir, steps, weights.describe(steps, optim.ema_decay)


def _mean_model(model: nnx.Module, others: list[int], load_one) -> nnx.Module:
    """`model` holding the mean of its parameters and those of the checkpoints at `others` (each `load_one(step)`'s
    model), summed in float32 one checkpoint at a time: two copies of the parameters at most."""
    total = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model, nnx.Param))
    for step in others:
        total = jax.tree.map(jnp.add, total, nnx.state(load_one(step), nnx.Param))
    count = len(others) + 1
    nnx.update(model, jax.tree.map(lambda t, p: (t / count).astype(p.dtype), total, nnx.state(model, nnx.Param)))
    return model


def _evaluation_model(manager, step: int | None, family, config, mesh, optim, ema: bool) -> tuple[nnx.Module, int]:
    """(the checkpoint's model holding the parameters the run evaluated and exported (step.model_for_evaluation), or
    with `ema` their average, its step): restored with its optimizer state where those are read from it
    (schedule-free AdamW's average, the --ema_decay average)."""
    restore = (
        (lambda target, **kw: ckpt.restore_newest_good(manager, target, move_aside=False, **kw))
        if step is None
        else (lambda target, **kw: ckpt.restore(manager, step, target, **kw))
    )
    with jax.set_mesh(mesh):
        if ema or evaluation_needs_optimizer(optim):
            graphdef, abstract = build_train_state(family, config, mesh, optim=optim, abstract=True)
            state, step = restore(abstract)
            return model_for_evaluation(graphdef, with_average(graphdef, state) if ema else state, optim)[0], step
        graphdef, abstract = nnx.get_abstract_model(lambda: family.make_model(config, rngs=nnx.Rngs(0)), mesh)
        state, step = restore(abstract, model_only=True)
        return nnx.merge(graphdef, state), step


def _started_from(run_dir):
    """The transformers checkpoint a run continued (its --model_name_or_path), where it is still there; else None."""
    try:
        path = json.loads((storage.path(run_dir) / RUN_CONFIG).read_text()).get("model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    folder = storage.path(path) if isinstance(path, str) and path else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    step: int | None = None,
    mesh_spec: str = "data=-1",
    overwrite: bool = False,
    weights: Weights = Weights(),
) -> Path:
    """A run's checkpoint (`step`, or the newest good one; or the mean of several: `weights`) as a transformers
    directory `out` with a card that says which weights it holds and from which steps."""
    out = storage.path(out, "--out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory")
    # an interrupted export (its files, no marker) may be written over: it is not anyone's data
    unfinished = (
        not storage.is_remote(out) and hf_export.only_an_export(Path(out)) and not hf_export.export_complete(out)
    )
    if out.exists() and any(out.iterdir()) and not overwrite and not unfinished:
        raise ExportError(f"--out {out} exists and is not empty; choose another directory or pass --overwrite")
    model, config, tokenizer_dir, _, what = load_weights(checkpoint, step, make_mesh(mesh_spec), weights)
    family = get_family(config.model_type)
    tokenizer = load_tokenizer(tokenizer_dir, family) if tokenizer_dir else None
    started_from = _started_from(checkpoint)
    if tokenizer is not None and started_from is not None:  # its special tokens' ids as the run's own export has them
        own = load_tokenizer(started_from, family) if tokenizer_layout(started_from) else None
        tokenizer = from_checkpoint(tokenizer, started_from, family, own=own)
    hf_export.save_hf(model, config, out, tokenizer=tokenizer, release=True)
    if jax.process_index() == 0:
        hf_export.write_export_card(out, config, str(checkpoint), what)
        needs = hf_export.what_it_needs(get_family(config.model_type), out)  # None: PyTorch is installed
        if needs:
            print(needs)
    return out
