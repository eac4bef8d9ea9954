"""Transformers interop: our NNX models <-> transformers checkpoints (config.json + model.safetensors + tokenizer).

Each family has one table of (HF name, our parameter path, layout change) in its family file. `{i}`-style fields
expand over layers: our parameter is then stacked (scanned layers) and the rule maps its slice i. Tied weights are
written once (transformers re-ties them on load). Tensors are moved one parameter at a time, so neither direction
holds more than one extra copy of the parameters on the host.

Its command line, `python -m spmdlm.export --checkpoint OUTPUT_DIR [--step N] --out HF_DIR`, is spmdlm/cli/export.py.

Every directory may be a gs:// path (spmdlm/storage.py): an export to a bucket is written locally, then uploaded.
"""

from __future__ import annotations

import collections
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import SafetensorError
from safetensors.numpy import save_file

from spmdlm import storage
from spmdlm.crashpoints import crash_point
from spmdlm.data.tokenization import save_tokenizer, special_tokens_of
from spmdlm.errors import ConfigError, ExportError
from spmdlm.families import get_family, load_pretrained_config
from spmdlm.families.base import Family, Generation
from spmdlm.hf_weights import CheckpointTensors
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.stack import restack
from spmdlm.storage import no_space, remove_stale_temps

# -- config --------------------------------------------------------------------------------------------------------


def hf_config_dict(config: HFConfig) -> dict:
    # From package metadata: importing transformers where torch is absent prints "PyTorch was not found".
    try:
        version = {"transformers_version": importlib.metadata.version("transformers")}
    except importlib.metadata.PackageNotFoundError:
        version = {}
    return {**config.to_hf_dict(), "dtype": "float32", **version}


GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id")


def generation_config_dict(config: HFConfig) -> dict:
    values = {k: getattr(config, k, None) for k in GENERATION_IDS}
    return {"_from_model_config": True, **{k: v for k, v in values.items() if v is not None}}


def token_id_files(config: HFConfig, tokenizer=None) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of an export. Over a checkpoint (special_tokens.from_checkpoint) their
    token ids are the checkpoint's as it gave them, an EOS list as a list, a key it lacked left out, and its
    generation_config.json whole; a role the run's tokenizer changed (--tokenizer_name, which said so) takes the
    new id. Otherwise the ids of `config` (the tokenizer's, spmdlm.train.stages.vocabulary)."""
    ours = hf_config_dict(config)
    tokens = special_tokens_of(tokenizer) if tokenizer is not None else None
    source = tokens.checkpoint if tokens is not None else None
    if source is None:
        return ours, generation_config_dict(config)
    kept = lambda k: not k.endswith("_token_id") or k in source.config
    written = {k: source.config.get(k, v) for k, v in ours.items() if kept(k)}
    written.update({k: v for k, v in source.config.items() if k not in written})
    framed = get_family(config.model_type).tokenizer.frames_with_bos  # ModernBERT's cls/sep ids are its bos/eos
    also = {"bos": "cls_token_id", "eos": "sep_token_id"} if framed else {}
    for role, new in source.changed.items():
        for key in (f"{role}_token_id", also.get(role)):
            if key and (key in ours or key in source.config):
                written[key] = new
    if source.generation is None:
        ids = {k: written.get(k) for k in GENERATION_IDS}
        return written, {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    generation = dict(source.generation)
    generation.update({f"{role}_token_id": new for role, new in source.changed.items()})
    return written, generation


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
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def hf_tensors(model: nnx.Module, release: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy tensor) for every parameter, gathered to the host one parameter at a time.

    `release` frees each device buffer once it is on the host, so that an export holds one copy of the
    parameters in all (on CPU, device and host memory are the same memory).
    """
    config = model.config
    variables = _param_variables(model)
    rules = list(get_family(config.model_type).table.expand(config))
    unmapped = sorted(set(variables) - {rule.ours for rule in rules})
    if unmapped:
        raise ExportError(f"{config.model_type} export table misses parameters: {', '.join(unmapped[:5])}")
    last_use = {rule.ours: i for i, rule in enumerate(rules)}
    host: dict[str, np.ndarray] = {}
    for i, rule in enumerate(rules):
        if rule.ours not in host:
            value = variables[rule.ours].get_value()
            host[rule.ours] = _to_host(value)
            if release:
                value.delete()
        array = host[rule.ours] if rule.layer is None else host[rule.ours][rule.layer]
        yield rule.hf, rule.layout[0](array)
        if last_use[rule.ours] == i:
            del host[rule.ours]  # a stacked parameter stays on the host until its last layer is out


MARKER = "spmdlm_export.json"  # written last: an export directory without it is incomplete
EXPORT_FILES = frozenset(
    {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "spiece.model",
        "README.md",
        MARKER,
    }
)  # README.md: the model card (train/publish.py)


def export_complete(out) -> bool:
    """Whether `out` holds a whole export: its marker, and every file the marker lists at its recorded size (a name
    outside `out`: not one of its files, so not whole)."""
    marker = out / MARKER
    try:
        files = json.loads(marker.read_text())["files"]
        return all(storage.inside(name) and storage.size(out / name) == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_files(folder: Path, tensors: dict, config: HFConfig, tokenizer) -> None:
    """Every file of the export into `folder`, the marker (file names and sizes) last."""
    config_values, generation = token_id_files(config, tokenizer)
    (folder / "config.json").write_text(json.dumps(config_values, indent=2, allow_nan=False))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a 0600 temporary file: give it the mode a new file gets, as config.json has
    # (copied rather than computed from os.umask, which can only be read by setting it, racing other threads).
    shutil.copymode(folder / "config.json", folder / "model.safetensors")
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2, allow_nan=False))
    if tokenizer is not None:
        family = get_family(config.model_type)
        decoder = family.generation is Generation.DECODER_ONLY
        save_tokenizer(tokenizer, folder, family, model_max_length=config.max_length, pad_with_eos=decoder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    crash_point("export.before_marker", folder / MARKER)
    (folder / MARKER).write_text(json.dumps({"format": "spmdlm-export", "files": files}, indent=2) + "\n")


def only_an_export(out: Path) -> bool:
    """`out` is absent, empty or holds only files an export writes (complete or not): it may be replaced whole."""
    return not out.exists() or (
        out.is_dir() and not os.path.ismount(out) and {p.name for p in out.iterdir()} <= EXPORT_FILES
    )


def _publish(tmp: Path, out: Path, whole: bool) -> None:
    """Put the finished files of `tmp` at `out` (storage.swap_in): `whole`, by renaming the directory (a previous
    export moved aside first, removed after); else (`out` holds other files too) file by file, the old marker removed
    first and the new one moved last. Either way `out` has a marker only over a whole export."""
    if not storage.swap_in(tmp, out, last=MARKER, whole=whole):
        raise ExportError(f"--out {out} got another export while this one was written; export again to replace it")


def save_hf(model: nnx.Module, config: HFConfig, out_dir: str | Path, tokenizer=None, *, release: bool = False) -> Path:
    """Write config.json, model.safetensors, generation_config.json, tokenizer files and, last, the marker
    spmdlm_export.json (process 0 writes). The files are written into a temporary sibling directory that is then
    renamed into place, so an interrupted export leaves no directory that looks complete; a bucket's are uploaded,
    the marker last.

    With `release`, the model's parameters are freed as they are copied out (the model is unusable after).
    """
    tensors = dict(hf_tensors(model, release))  # every process joins the gathers; only process 0 writes
    out = storage.path(out_dir, "--out")
    if jax.process_index() != 0:
        return out
    host = socket.gethostname()
    remote = storage.is_remote(out)
    if remote:
        tmp = Path(tempfile.mkdtemp(prefix="spmdlm-upload-")) / "hf"
    else:
        local = Path(out).absolute()
        whole = only_an_export(local)
        parent = local.parent if whole else local
        prefix = f".{local.name}" if whole else ".export"
        try:
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(parent, glob.escape(prefix), host)
            if whole:
                remove_stale_temps(parent, f"{glob.escape(prefix)}.old", host)
        except OSError as e:
            raise ExportError(
                f"cannot write the export in {parent}: {e.strerror or e}; choose a writable --out"
            ) from None
        tmp = parent / f"{prefix}.tmp-{host}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        _write_files(tmp, tensors, config, tokenizer)
        if remote:  # the old marker first, the new one last: a bucket's export is whole whenever it has a marker
            storage.remove(out / MARKER)
            for file in sorted(tmp.iterdir(), key=lambda p: p.name == MARKER):
                storage.upload(file, out / file.name)
        else:
            _publish(tmp, local, whole)
        crash_point("export.after_swap", out)
    except (OSError, SafetensorError, RuntimeError) as e:
        if not no_space(e):
            raise
        needed = sum(int(t.nbytes) for t in tensors.values())
        raise ExportError(
            f"cannot write the export {out}: no space left on device ({storage.space_note(out, needed)}); free some "
            "space or choose another --out"
        ) from None
    finally:
        shutil.rmtree(tmp.parent if remote else tmp, ignore_errors=True)
    return out


def export_state(graphdef, state, config: HFConfig, out_dir: str | Path, tokenizer=None) -> Path:
    """The end-of-training export; frees the parameters as it goes (the run is over)."""
    model, _ = nnx.merge(graphdef, state)
    return save_hf(restack(model), config, out_dir, tokenizer=tokenizer, release=True)  # stacked: the tables' layout


def _param_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters' shapes for `config`, by path, from an abstract model (nothing allocated)."""
    model = nnx.eval_shape(lambda: get_family(config.model_type).make_model(config, rngs=nnx.Rngs(0)))
    return {path: tuple(var.shape) for path, var in _param_variables(model).items()}


def _rule_shape(shapes: dict, rule) -> tuple[int, ...]:
    shape = shapes[rule.ours]
    return shape if rule.layer is None else shape[1:]


def matched_rules(tensors: CheckpointTensors, config: HFConfig):
    """The family table's rules for `config`, checked against a checkpoint's tensors (every tensor there, none left
    over, each of the size `config` gives it) without reading them: -> (rules, HF name -> name in the file, absent
    optional tensors, our parameter shapes)."""
    path = tensors.path
    table = get_family(config.model_type).table
    names = tensors.names()
    alias = {n: n for n in names} | {table.hf_prefix + n: n for n in names if not n.startswith(table.hf_prefix)}
    rules = list(table.expand(config))
    absent = {rule.hf for rule in rules if rule.hf not in alias}
    missing = sorted(n for n in absent if not any(re.search(p, n) for p in table.optional))
    for pattern, meaning in table.absent_means:
        if any(re.search(pattern, n) for n in missing):
            raise ExportError(f"{path}: this {config.model_type} checkpoint {meaning}")
    if missing:
        raise ExportError(f"{path}: missing tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    used = {alias[rule.hf] for rule in rules if rule.hf not in absent}
    unexpected = [n for n in sorted(names - used) if not any(re.search(p, n) for p in table.ignore)]
    if unexpected:
        raise ExportError(
            f"{path}: tensors this {config.model_type} model has no place for: {', '.join(unexpected[:4])}"
        )
    shapes = _param_shapes(config)
    for rule in rules:
        if rule.hf not in absent:
            found, needed = tensors.shape(alias[rule.hf]), _rule_shape(shapes, rule)
            if np.prod(found) != np.prod(needed):  # the layouts only transpose and reshape
                raise ExportError(
                    f"{path}: tensor {alias[rule.hf]} has shape {list(found)}, but the model of its "
                    f"config.json needs {int(np.prod(needed))} values ({list(needed)} here); the "
                    "weights and config.json are of different models"
                )
    return rules, alias, absent, shapes


def check_checkpoint(path: str | Path, config: HFConfig) -> None:
    """Every check of a checkpoint's weights against its config that needs no tensor read (matched_rules)."""
    with CheckpointTensors(storage.path(path, "--model_name_or_path")) as tensors:
        matched_rules(tensors, config)


def check_vocab_size(path: str | Path, config: HFConfig) -> None:
    """config.json's vocab_size against the rows of the checkpoint's embeddings (read from the files' headers): an
    edited vocab_size is named as such, before the tokenizer is checked against it."""
    table, shapes = get_family(config.model_type).table, _param_shapes(config)
    with CheckpointTensors(storage.path(path, "--model_name_or_path")) as tensors:
        names = tensors.names()
        rows = []  # of each embedding that config.json's vocab_size sizes (positions of that size are not told apart)
        for rule in table.expand(config):
            name = rule.hf if rule.hf in names else rule.hf.removeprefix(table.hf_prefix)
            if rule.ours.endswith(".embedding") and _rule_shape(shapes, rule)[0] == config.vocab_size and name in names:
                rows.append(tensors.shape(name)[0])
    if rows and config.vocab_size not in rows:
        raise ConfigError(
            f"{path}: config.json's vocab_size ({config.vocab_size}) does not match the checkpoint's embedding "
            f"({rows[0]} rows); set it back to {rows[0]} (to add tokens, extend the tokenizer and pass it as "
            "--tokenizer_name: the embedding grows)"
        )


def grown(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`value` grown to `shape` along its one longer axis (an extended vocabulary), the new rows the mean of the old
    ones, as transformers' resize_token_embeddings initialises them."""
    if value.shape == tuple(shape):
        return value
    (axis,) = [i for i, (a, b) in enumerate(zip(value.shape, shape)) if a != b]
    extra = list(value.shape)
    extra[axis] = shape[axis] - value.shape[axis]
    mean = value.mean(axis=axis, keepdims=True, dtype=np.float64).astype(value.dtype)
    return np.concatenate([value, np.broadcast_to(mean, extra)], axis=axis)


def _fill_params(model: nnx.Module, path: Path, mesh=None, source_config: HFConfig | None = None) -> None:
    """Load the HF tensors at `path` into `model`'s parameters, each placed with the parameter's sharding.

    Per-layer HF tensors fill the slices of our stacked parameters; each parameter is placed once it is whole.
    `source_config`: the checkpoint's own config where the model's vocabulary extends it (rows appended, `grown`).
    """
    variables, per_layer = _param_variables(model), collections.defaultdict(list)
    for key, var in variables.items():  # layers that own their arrays (--scan_unroll per_layer): fill as stacked
        stacked, found = re.subn(r"\.layers\.\d+\.", ".layers.", key, count=1)
        if found:
            per_layer[stacked].append(var)
    with CheckpointTensors(path) as tensors:
        rules, alias, absent, source_shapes = matched_rules(tensors, source_config or model.config)
        last_use = {rule.ours: i for i, rule in enumerate(rules)}
        pending: dict[str, np.ndarray] = {}
        for i, rule in enumerate(rules):
            layers = per_layer.get(rule.ours)
            var = variables[rule.ours] if layers is None else layers[0]
            shape = tuple(var.shape) if layers is None else (len(layers), *var.shape)
            target = shape if rule.layer is None else shape[1:]
            if rule.hf in absent:  # an optional tensor, e.g. BART's final_logits_bias in a BartModel checkpoint
                value = np.zeros(target, np.float32)
            else:
                value = grown(rule.layout[1](tensors.get(alias[rule.hf]), _rule_shape(source_shapes, rule)), target)
            if rule.layer is None:
                pending[rule.ours] = value
            else:
                pending.setdefault(rule.ours, np.empty(shape, np.float32))[rule.layer] = value
            if last_use[rule.ours] == i:
                value = pending.pop(rule.ours)
                for layer, owner in enumerate(layers or [var]):
                    part = value if layers is None else value[layer]
                    owner.set_value(jax.device_put(part, _sharding_of(owner, mesh)))


def _sharding_of(var: nnx.Variable, mesh):
    """Where a loaded tensor goes: the parameter's current placement, or its annotated spec on `mesh`."""
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec(*(var.get_metadata().get("out_sharding") or ())))
    current = getattr(var.get_value(), "sharding", None)
    return current if isinstance(current, jax.sharding.Sharding) else None


def load_hf(path: str | Path, *, mesh=None, dtype=None, config: HFConfig | None = None) -> tuple[nnx.Module, HFConfig]:
    """An NNX model with the weights of a transformers checkpoint, sharded on `mesh` (or the current mesh).
    `config`: the model's, where its vocabulary extends the checkpoint's (the rows appended, `grown`)."""
    path = storage.path(path, "--model_name_or_path")
    source = load_pretrained_config(path)
    config = config or source
    family = get_family(config.model_type)
    mesh = mesh if mesh is not None else _current_mesh()
    build = lambda: family.make_model(config, rngs=nnx.Rngs(0), dtype=dtype or jnp.float32)
    if mesh is not None:
        with jax.set_mesh(mesh):
            model = nnx.eval_shape(build)  # no random init: every parameter is replaced below
            _fill_params(model, path, mesh, source_config=source)
    else:
        model = nnx.eval_shape(build)
        _fill_params(model, path, source_config=source)
    return model, config


def _current_mesh():
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def load_hf_into_state(path: str | Path, graphdef, state, source_config: HFConfig | None = None):
    """Put a transformers checkpoint's weights into a freshly initialised (model, optimizer) train state;
    `source_config`: the checkpoint's config where the run's vocabulary extends it."""
    model, optimizer = nnx.merge(graphdef, state)
    _fill_params(model, storage.path(path, "--model_name_or_path"), source_config=source_config)
    return nnx.state((model, optimizer))


# -- what an export needs to be used -----------------------------------------------------------------------------------
TORCH_CPU_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
# The Hub task of what each kind of model is asked for (pipeline_tag, the model-index task, a tag).
TASKS = {
    Generation.FILL_MASK: "fill-mask",
    Generation.DECODER_ONLY: "text-generation",
    Generation.ENCODER_DECODER: "text2text-generation",
    Generation.NONE: "feature-extraction",
}
EXAMPLE_TEXT = "Hello, my name is"


def _mask_of(family: Family) -> str:
    return family.tokenizer.specials.get("mask") or ("<extra_id_0>" if family.tokenizer.num_sentinels else "")


def usage_snippet(family: Family, model_id: str) -> str:
    """Python that loads the export (a local path or a Hub id) and uses it as the family's models are used."""
    auto, mask = family.hf_auto_class, _mask_of(family)
    load = (
        f'model_id = "{model_id}"\ntokenizer = AutoTokenizer.from_pretrained(model_id)\n'
        f"model = {auto}.from_pretrained(model_id)\n"
    )
    if family.generation is Generation.FILL_MASK:
        return (
            f'from transformers import pipeline\n\nmodel_id = "{model_id}"\n'
            f'fill_mask = pipeline("fill-mask", model=model_id)\nprint(fill_mask("{EXAMPLE_TEXT} {mask}."))'
        )
    if family.generation is Generation.DECODER_ONLY:
        prompt = EXAMPLE_TEXT
    elif family.generation is Generation.ENCODER_DECODER:
        prompt = f"{EXAMPLE_TEXT} {mask}." if mask else EXAMPLE_TEXT
    else:  # a model that does not generate: its outputs for a text
        return (
            f"from transformers import {auto}, AutoTokenizer\n\n{load}"
            f'outputs = model(**tokenizer("{EXAMPLE_TEXT}", return_tensors="pt"))'
        )
    return (
        f"from transformers import {auto}, AutoTokenizer\n\n{load}"
        f'inputs = tokenizer("{prompt}", return_tensors="pt")\n'
        "outputs = model.generate(**inputs, max_new_tokens=20, do_sample=False)\n"
        "print(tokenizer.decode(outputs[0], skip_special_tokens=True))"
    )


def without_torch(family: Family, folder) -> str | None:
    """The spmdlm.generate command that uses the export without PyTorch (JAX only), or None: nothing to ask."""
    if family.generation is Generation.NONE:
        return None
    mask = _mask_of(family)
    prompt = f"{EXAMPLE_TEXT} {mask}." if family.generation is not Generation.DECODER_ONLY and mask else EXAMPLE_TEXT
    fill = " --fill_mask" if family.generation is Generation.FILL_MASK else ""
    return f'python -m spmdlm.generate --model_name_or_path {folder} --prompt "{prompt}"{fill}'


def what_it_needs(family: Family, folder) -> str | None:
    """One line for the log of an export where PyTorch is not installed: transformers' side needs it,
    spmdlm.generate does not. None where it is installed: nothing to ask for."""
    if importlib.util.find_spec("torch") is not None:
        return None
    spmdlm_way = without_torch(family, folder)
    return (
        f"transformers' pipelines and {family.hf_auto_class} on {folder} need PyTorch (CPU-only: "
        f"{TORCH_CPU_INSTALL})" + (f"; without it: {spmdlm_way}" if spmdlm_way else "")
    )


def card_path(folder) -> str:
    """An export's path as a model card names it, never an absolute local path (a card is published): relative to the
    working directory when it lies below it (runs/gpt2-tiny-stdlib/hf), else its folder's name and its own; a
    bucket's URL as it is."""
    if storage.is_remote(folder):
        return str(folder)
    path = Path(folder).absolute()
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return f"{path.parent.name}/{path.name}"


def card_usage_lines(family: Family, model_id: str, folder) -> list[str]:
    """The card's "How to use": the snippet, what it needs, and the way without PyTorch."""
    lines = [
        "```python",
        usage_snippet(family, model_id),
        "```",
        "",
        "transformers runs this on PyTorch, which spmdlm does not install; the CPU-only wheel is enough (a "
        "plain `pip install torch` brings several GB of CUDA libraries):",
        "",
        "```bash",
        TORCH_CPU_INSTALL,
        "```",
    ]
    spmdlm_way = without_torch(family, folder)
    if spmdlm_way:
        lines += ["", "Without PyTorch, spmdlm runs the export itself (JAX):", "", "```bash", spmdlm_way, "```"]
    return lines


def write_export_card(out, config: HFConfig, checkpoint: str, what: str) -> None:
    """README.md of an export made by `python -m spmdlm.export`: what it is (`what`: which weights of which
    checkpoints, spmdlm.load.Weights.describe) and how to use it (the training run's own card, with data and
    results, is the one in its OUTPUT_DIR/hf)."""
    from huggingface_hub import ModelCard, ModelCardData

    family, out = get_family(config.model_type), storage.path(out)
    task = TASKS[family.generation]
    data = ModelCardData(library_name="transformers", pipeline_tag=task, tags=[family.name, "spmdlm", task])
    where = card_path(out)
    body = "\n".join(
        [
            f"# {Path(where).name}",
            "",
            f"A {family.name} model (`{family.hf_auto_class}`) exported by `python -m spmdlm.export`: {what}, of "
            f"the spmdlm run `{checkpoint}` (the run's own card, with its data and results, is its "
            "`hf/README.md`).",
            "",
            "## How to use",
            "",
            *card_usage_lines(family, where, where),
            "",
        ]
    )
    storage.write_atomic(out / "README.md", str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")))
