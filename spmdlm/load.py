"""Any model spmdlm can evaluate, as one `LoadedModel`: a training run (its newest good checkpoint or a given step),
an export, or a transformers directory of one of the families (e.g. a released gpt2 or roberta-base on disk).

    loaded = load_model("runs/gpt2-tiny", make_mesh("data=-1"))            # newest good checkpoint of a run
    loaded = load_model("runs/gpt2-tiny/checkpoints/500", mesh)           # that step
    loaded = load_model("runs/gpt2-tiny/hf", mesh)                        # an export, or any transformers dir

The model is sharded on `mesh` as training shards it; it computes in float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from spmdlm import storage
from spmdlm.checkpoint import checkpoint_dir
from spmdlm.data.tokenization import load_tokenizer
from spmdlm.errors import ArgumentError, ConfigError
from spmdlm.export import MARKER, load_hf, load_run
from spmdlm.families import get_family
from spmdlm.families.base import Family
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
        raise ConfigError(
            f"{where}: no spmdlm run ({RUN_CONFIG}), checkpoint (RUN/checkpoints/N) or transformers "
            "directory (config.json) there; give one of those"
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
