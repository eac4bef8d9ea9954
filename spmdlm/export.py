"""Transformers interop: our NNX models <-> transformers checkpoints (config.json + model.safetensors + tokenizer).

Each architecture has one table of (HF name, our parameter path, layout change). `{i}`-style fields expand over
layers. Tied weights are written once (transformers re-ties them on load). Tensors are moved one at a time, so
neither direction holds more than one extra copy of the parameters on the host.

    python -m spmdlm.export --checkpoint OUTPUT_DIR [--step N] --out HF_DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmdlm.models import ARCHITECTURES, get_architecture
from spmdlm.models.config import ConfigError, HFConfig

# -- layout changes: (ours -> HF, HF -> ours given our shape) --------------------------------------------------------
Layout = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, tuple], np.ndarray]]
SAME: Layout = (lambda x: x, lambda x, shape: x.reshape(shape))
FLAT_OUT: Layout = (lambda x: x.reshape(x.shape[0], -1), lambda x, shape: x.reshape(shape))  # (d, 3, h) <-> (d, 3h)
FLAT: Layout = (lambda x: x.reshape(-1), lambda x, shape: x.reshape(shape))  # (3, h) <-> (3h,)
LINEAR: Layout = (lambda x: np.ascontiguousarray(x.T), lambda x, shape: np.ascontiguousarray(x.T).reshape(shape))


@dataclasses.dataclass(frozen=True)
class Table:
    rules: tuple[tuple[str, str, Layout], ...]  # (HF name, our path, layout); {i} etc. expand over layers
    layer_counts: Callable[[HFConfig], dict[str, int]]
    hf_prefix: str = ""  # the base model's prefix, absent in checkpoints saved from the bare base model
    ignore: tuple[str, ...] = ()  # regexes of HF tensors we do not need (tied copies, buffers)

    def expand(self, config: HFConfig) -> Iterator[tuple[str, str, Layout]]:
        counts = self.layer_counts(config)
        for hf, ours, layout in self.rules:
            fields = set(re.findall(r"{(\w+)}", hf))
            if not fields:
                yield hf, ours, layout
                continue
            (field,) = fields
            for index in range(counts[field]):
                yield hf.format(**{field: index}), ours.format(**{field: index}), layout


GPT2_TABLE = Table(
    rules=(
        ("transformer.wte.weight", "wte.embedding", SAME),
        ("transformer.wpe.weight", "wpe.embedding", SAME),
        ("transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.scale", SAME),
        ("transformer.h.{i}.ln_1.bias", "h.{i}.ln_1.bias", SAME),
        ("transformer.h.{i}.attn.c_attn.weight", "h.{i}.attn.qkv.kernel", FLAT_OUT),  # Conv1D is (in, out)
        ("transformer.h.{i}.attn.c_attn.bias", "h.{i}.attn.qkv.bias", FLAT),
        ("transformer.h.{i}.attn.c_proj.weight", "h.{i}.attn.out.kernel", SAME),
        ("transformer.h.{i}.attn.c_proj.bias", "h.{i}.attn.out.bias", SAME),
        ("transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.scale", SAME),
        ("transformer.h.{i}.ln_2.bias", "h.{i}.ln_2.bias", SAME),
        ("transformer.h.{i}.mlp.c_fc.weight", "h.{i}.mlp.wi.kernel", SAME),
        ("transformer.h.{i}.mlp.c_fc.bias", "h.{i}.mlp.wi.bias", SAME),
        ("transformer.h.{i}.mlp.c_proj.weight", "h.{i}.mlp.wo.kernel", SAME),
        ("transformer.h.{i}.mlp.c_proj.bias", "h.{i}.mlp.wo.bias", SAME),
        ("transformer.ln_f.weight", "ln_f.scale", SAME),
        ("transformer.ln_f.bias", "ln_f.bias", SAME),
    ),
    layer_counts=lambda c: {"i": c.n_layer},
    hf_prefix="transformer.",
    ignore=(r"^lm_head\.weight$", r"\.attn\.(masked_)?bias$"),
)

TABLES: dict[str, Table] = {"gpt2": GPT2_TABLE}


def _check_gpt2(values: dict) -> None:
    unsupported = {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "add_cross_attention": True}
    for key, bad in unsupported.items():
        if values.get(key) == bad:
            raise ConfigError(f"GPT-2 config with {key}={bad} is not supported")


CONFIG_CHECKS: dict[str, Callable[[dict], None]] = {"gpt2": _check_gpt2}


# -- T5 v1.1 (torch Linear weights are (out, in): LINEAR); {i} counts encoder blocks, {j} decoder blocks -----------
def _t5_attention_rules(hf: str, ours: str) -> tuple[tuple[str, str, Layout], ...]:
    return tuple((f"{hf}.{a}.weight", f"{ours}.{b}.kernel", LINEAR)
                 for a, b in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out")))


def _t5_mlp_rules(hf: str, ours: str) -> tuple[tuple[str, str, Layout], ...]:
    dense = tuple((f"{hf}.DenseReluDense.{w}.weight", f"{ours}.mlp.{w}.kernel", LINEAR) for w in ("wi_0", "wi_1", "wo"))
    return (*dense, (f"{hf}.layer_norm.weight", f"{ours}.mlp_norm.scale", SAME))


T5_TABLE = Table(
    rules=(
        ("shared.weight", "shared.embedding", SAME),
        ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
         "encoder.block.0.relative_attention_bias.embedding", SAME),
        ("encoder.block.{i}.layer.0.layer_norm.weight", "encoder.block.{i}.self_attention_norm.scale", SAME),
        *_t5_attention_rules("encoder.block.{i}.layer.0.SelfAttention", "encoder.block.{i}.self_attention"),
        *_t5_mlp_rules("encoder.block.{i}.layer.1", "encoder.block.{i}"),
        ("encoder.final_layer_norm.weight", "encoder.final_layer_norm.scale", SAME),
        ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
         "decoder.block.0.relative_attention_bias.embedding", SAME),
        ("decoder.block.{j}.layer.0.layer_norm.weight", "decoder.block.{j}.self_attention_norm.scale", SAME),
        *_t5_attention_rules("decoder.block.{j}.layer.0.SelfAttention", "decoder.block.{j}.self_attention"),
        ("decoder.block.{j}.layer.1.layer_norm.weight", "decoder.block.{j}.cross_attention_norm.scale", SAME),
        *_t5_attention_rules("decoder.block.{j}.layer.1.EncDecAttention", "decoder.block.{j}.cross_attention"),
        *_t5_mlp_rules("decoder.block.{j}.layer.2", "decoder.block.{j}"),
        ("decoder.final_layer_norm.weight", "decoder.final_layer_norm.scale", SAME),
        ("lm_head.weight", "lm_head.kernel", LINEAR),  # untied in v1.1: written and read separately from shared
    ),
    layer_counts=lambda c: {"i": c.num_layers, "j": c.num_decoder_layers},
    ignore=(r"^(encoder|decoder)\.embed_tokens\.weight$",  # tied copies of shared
            r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$"),  # unused by HF too
)
TABLES["t5"] = T5_TABLE


def _check_t5(values: dict) -> None:
    from spmdlm.models.t5 import dense_activation, hf_scales_decoder_outputs

    proj = values.get("feed_forward_proj", "relu")  # transformers' default
    if dense_activation(proj) is None:
        raise ConfigError(f"T5 feed_forward_proj {proj!r} is not supported; only gated ones such as 'gated-gelu' "
                          "(T5 v1.1, Flan-T5) are")
    if hf_scales_decoder_outputs(values):
        raise ConfigError("T5 with a tied, d_model**-0.5-scaled LM head (original T5) is not supported; only T5 v1.1 "
                          "(tie_word_embeddings false or scale_decoder_outputs false) is")


CONFIG_CHECKS["t5"] = _check_t5


class ExportError(ValueError):
    """A transformers directory or checkpoint that cannot be converted."""


# -- config --------------------------------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> HFConfig:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{path}: no config.json; pass a directory written by save_pretrained or save_hf")
    values = json.loads(config_path.read_text())
    model_type = values.get("model_type")
    if model_type not in ARCHITECTURES or model_type not in TABLES:
        found = ", ".join(values.get("architectures") or []) or "no architectures listed"
        raise ConfigError(f"{path} holds a {model_type!r} model ({found}); supported model types: "
                          f"{', '.join(t for t in ARCHITECTURES if t in TABLES)}")
    CONFIG_CHECKS.get(model_type, lambda v: None)(values)
    return get_architecture(model_type).config_class.from_dict(values)


def hf_config_dict(config: HFConfig) -> dict:
    import transformers

    return {**config.to_hf_dict(), "dtype": "float32", "transformers_version": transformers.__version__}


def generation_config_dict(config: HFConfig) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {"_from_model_config": True, **{k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}}


# -- parameters ----------------------------------------------------------------------------------------------------


def _param_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Our parameters by dotted path, e.g. 'h.0.attn.qkv.kernel'."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            out[".".join(str(p) for p in path)] = var
    return out


def _to_host(x: jax.Array) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def hf_tensors(model: nnx.Module, release: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy tensor) for every parameter, gathered to the host one at a time.

    `release` frees each device buffer once it is on the host, so that an export holds one copy of the
    parameters in all (on CPU, device and host memory are the same memory).
    """
    config = model.config
    table = TABLES[config.model_type]
    variables = _param_variables(model)
    mapped = set()
    for hf, ours, (to_hf, _) in table.expand(config):
        mapped.add(ours)
        value = variables[ours].get_value()
        host = _to_host(value)
        if release:
            value.delete()
        yield hf, to_hf(host)
    unmapped = sorted(set(variables) - mapped)
    if unmapped:
        raise ExportError(f"{config.model_type} export table misses parameters: {', '.join(unmapped[:5])}")


def save_hf(model: nnx.Module, config: HFConfig, out_dir: str | Path, tokenizer=None, *,
            release: bool = False) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files (process 0 writes).

    With `release`, the model's parameters are freed as they are copied out (the model is unusable after).
    """
    from safetensors.numpy import save_file

    tensors = dict(hf_tensors(model, release))  # every process joins the gathers; only process 0 writes
    out = Path(out_dir)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config_dict(config), indent=2))
    if tokenizer is not None:
        from spmdlm.data.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, out, config.model_type, model_max_length=config.max_length)
    return out


def export_state(graphdef, state, config: HFConfig, out_dir: str | Path, tokenizer=None) -> Path:
    """The end-of-training export; frees the parameters as it goes (the run is over)."""
    model, _ = nnx.merge(graphdef, state)
    return save_hf(model, config, out_dir, tokenizer=tokenizer, release=True)


def _open_safetensors(path: Path):
    from safetensors import safe_open

    file = path / "model.safetensors"
    if not file.is_file():
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.index.json"))
        hint = f" (found {', '.join(other)}: re-save with save_pretrained(safe_serialization=True))" if other else ""
        raise ExportError(f"{path}: no model.safetensors{hint}")
    return safe_open(str(file), framework="numpy")


def _fill_params(model: nnx.Module, path: Path, mesh=None) -> None:
    """Load the HF tensors at `path` into `model`'s parameters, each placed with the parameter's sharding."""
    config = model.config
    table = TABLES[config.model_type]
    variables = _param_variables(model)
    with _open_safetensors(path) as f:
        names = set(f.keys())
        alias = {n: n for n in names} | {table.hf_prefix + n: n for n in names if not n.startswith(table.hf_prefix)}
        expected = list(table.expand(config))
        missing = [hf for hf, _, _ in expected if hf not in alias]
        if missing:
            raise ExportError(f"{path}: missing tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        used = {alias[hf] for hf, _, _ in expected}
        unexpected = [n for n in sorted(names - used) if not any(re.search(p, n) for p in table.ignore)]
        if unexpected:
            raise ExportError(f"{path}: tensors this {config.model_type} model has no place for: "
                              f"{', '.join(unexpected[:4])}")
        for hf, ours, (_, from_hf) in expected:
            var = variables[ours]
            value = from_hf(f.get_tensor(alias[hf]).astype(np.float32), tuple(var.shape))
            var.set_value(jax.device_put(value, _sharding_of(var, mesh)))


def _sharding_of(var: nnx.Variable, mesh):
    """Where a loaded tensor goes: the parameter's current placement, or its annotated spec on `mesh`."""
    if mesh is not None:
        return NamedSharding(mesh, var.get_metadata().get("out_sharding") or PartitionSpec())
    current = getattr(var.get_value(), "sharding", None)
    return current if isinstance(current, jax.sharding.Sharding) else None


def load_hf(path: str | Path, *, mesh=None, dtype=None) -> tuple[nnx.Module, HFConfig]:
    """An NNX model with the weights of a transformers checkpoint, sharded on `mesh` (or the current mesh)."""
    import jax.numpy as jnp

    path = Path(path)
    config = read_hf_config(path)
    arch = get_architecture(config.model_type)
    mesh = mesh if mesh is not None else _current_mesh()
    build = lambda: arch.model_class(config, rngs=nnx.Rngs(0), dtype=dtype or jnp.float32)
    if mesh is not None:
        with jax.set_mesh(mesh):
            model = nnx.eval_shape(build)  # no random init: every parameter is replaced below
            _fill_params(model, path, mesh)
    else:
        model = nnx.eval_shape(build)
        _fill_params(model, path)
    return model, config


def _current_mesh():
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def load_hf_into_state(path: str | Path, graphdef, state):
    """Put a transformers checkpoint's weights into a freshly initialised (model, optimizer) train state."""
    model, optimizer = nnx.merge(graphdef, state)
    _fill_params(model, Path(path))
    return nnx.state((model, optimizer))


# -- command line --------------------------------------------------------------------------------------------------


def export_checkpoint(checkpoint: str | Path, out: str | Path, step: int | None = None, mesh_spec: str = "data=-1",
                      overwrite: bool = False) -> Path:
    from spmdlm import checkpoint as ckpt
    from spmdlm.data.tokenizer import load_tokenizer
    from spmdlm.mesh import make_mesh

    run_dir, out = Path(checkpoint), Path(out)
    run_config_path = run_dir / "run_config.json"
    if not run_config_path.is_file():
        raise ckpt.CheckpointError(f"{run_dir}: no run_config.json, so no spmdlm run to export; "
                                   "pass the --output_dir of a training run")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty; choose another directory or pass --overwrite")
    run_config = json.loads(run_config_path.read_text())
    manager = ckpt.make_manager(run_dir, read_only=True)
    step = ckpt.resolve_step(manager, step)  # fail before building anything
    model_config = run_config["model_config"]
    arch = get_architecture(model_config["model_type"])
    config = arch.config_class.from_dict(model_config)
    mesh = make_mesh(mesh_spec)
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.get_abstract_model(lambda: arch.model_class(config, rngs=nnx.Rngs(0)), mesh)
        state, _ = ckpt.restore(manager, step, abstract, model_only=True)
    model = nnx.merge(graphdef, state)
    tokenizer_path = run_config.get("tokenizer_name") or run_dir
    tokenizer = load_tokenizer(tokenizer_path) if (Path(tokenizer_path) / "tokenizer.json").exists() or \
        Path(tokenizer_path).is_file() else None
    save_hf(model, config, out, tokenizer=tokenizer, release=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmdlm.export",
                                     description="Export an spmdlm checkpoint to transformers format.")
    parser.add_argument("--checkpoint", required=True, help="the training run's --output_dir")
    parser.add_argument("--out", required=True, help="directory to write config.json, model.safetensors, tokenizer")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--mesh", default="data=-1", help="mesh to restore on (default: all devices, data axis)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    from spmdlm.checkpoint import CheckpointError
    from spmdlm.mesh import MeshError

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.step, args.mesh, args.overwrite)
    except (ExportError, ConfigError, CheckpointError, MeshError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
