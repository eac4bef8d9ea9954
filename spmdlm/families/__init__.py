"""The family registry: every model family by model_type, and the one way to resolve a model config.

Families come from two places: the modules of this package (every module here except `base` holds one `FAMILY`),
and any installed package that names a `Family` under the `spmdlm.families` entry-point group, e.g. in its
pyproject.toml:

    [project.entry-points."spmdlm.families"]
    opt = "my_package.family:FAMILY"

so a new model is added without forking spmdlm (docs/architecture.md, "Adding a model"). A family's presets are the
JSON files in the `presets/` folder of the package that holds its FAMILY (`spmdlm/families/<name>/presets/*.json`),
besides any it declares in `Family.presets`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spmdlm.data.objectives import Flag, Objective
from spmdlm.data.tokenization import train_tokenizer
from spmdlm.errors import ConfigError
from spmdlm.families.base import Family
from spmdlm.models.hf_config import (
    DEFAULT_MODEL_TYPE,
    HFConfig,
    read_config_source,
    read_json,
    read_pretrained_config,
)

ENTRY_POINT_GROUP = "spmdlm.families"


@functools.cache
def families() -> dict[str, Family]:
    """model_type -> Family: this package's, then the entry points' (loaded once, on first use), each with the
    presets of its `presets/` folder added."""
    found: dict[str, tuple[Family, str, str]] = {}  # name -> (family, where it was found, the module holding it)

    def add(family, source: str, module: str) -> None:
        if not isinstance(family, Family):
            raise ConfigError(f"model family {source} is a {type(family).__name__}, not a spmdlm Family")
        if family.name in found:
            raise ConfigError(
                f"two model families are named {family.name!r}: {found[family.name][1]} and {source}; "
                "uninstall or rename one"
            )
        found[family.name] = (family, source, module)

    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        name = f"{__name__}.{module}"
        add(importlib.import_module(name).FAMILY, name, name)
    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        source = f"entry point {entry.name} = {entry.value}"
        try:
            family = entry.load()
        except Exception as e:  # a broken plugin: say which, not a traceback from deep inside importlib
            raise ConfigError(f"model family {source} failed to load: {type(e).__name__}: {e}") from None
        add(family, source, entry.module)
    owners: dict[str, str] = {}  # preset name -> its family: a name is one family's only
    known = {}
    for name, (family, _, module) in found.items():
        presets = {**preset_files(module, name), **family.presets}
        for preset in presets:
            if owners.setdefault(preset, name) != name:
                raise ConfigError(
                    f"model families {owners[preset]} and {name} both have a preset {preset!r}; rename one"
                )
        known[name] = dataclasses.replace(family, presets=presets)
    return known


def family_names() -> list[str]:
    """The families' names (model types) in the registry's order, without loading any family: this package's
    folders, then the entry points' names (each the name of its family; tests/test_command_line.py checks that the
    list equals `families()`)."""
    own = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")
    plugins = sorted(entry.name for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return own + plugins


def objective_words(family: Family) -> str:
    """What a family is trained for, in words: its objective's class name split (CausalLM: causal LM)."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z0-9]*|[a-z0-9]+", family.objective_class.__name__)
    return " ".join(word if len(word) > 1 and word.isupper() else word.lower() for word in words)


def summary() -> str:
    """Every family with what it is trained for, as --help and the model card list them: `bart (denoising), gpt2
    (causal LM), ...`."""
    return ", ".join(f"{name} ({objective_words(family)})" for name, family in families().items())


def preset_files(module: str, model_type: str) -> dict[str, dict]:
    """The JSON presets in the `presets/` folder of `module`'s package, each a config of `model_type`."""
    folder = Path(sys.modules[module].__file__).parent / "presets"
    presets = {path.stem: read_json(path, f"preset {path}") for path in sorted(folder.glob("*.json"))}
    for name, values in presets.items():
        if values.get("model_type", model_type) != model_type:
            raise ConfigError(
                f"preset {folder / name}.json is a {values['model_type']!r} config in the {model_type} family's "
                "folder; move it to its family's presets/"
            )
    return presets


def get_family(model_type: str | None) -> Family:
    """The family of a model_type: its own name, or one of the model types its architecture was released as."""
    name = released_types().get(model_type)
    if name is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; choose one of {', '.join(families())}")
    return families()[name]


def released_types() -> dict[str, str]:
    """Every model type spmdlm reads -> the family that reads it."""
    return {
        **{name: name for name in families()},
        **{other: name for name, family in families().items() for other in family.released_as},
    }


@functools.cache
def released_config_class(model_type: str) -> type:
    """The config class of a model type its family was released as: the family's fields, its own model_type and
    transformers class, so the export is the checkpoint's own (an xlm-roberta run exports an XLMRobertaForMaskedLM)."""
    family = get_family(model_type)
    base = family.config_class
    name = "".join(part.capitalize() for part in model_type.split("-")) + base.__name__
    return type(name, (base,), {"model_type": model_type, "architecture": family.released_as[model_type]})


def objective_flags() -> tuple[Flag, ...]:
    """Every family's objective flags, each name once (families share flags by sharing the declaration)."""
    flags: dict[str, Flag] = {}
    for family in families().values():
        for flag in family.flags:
            if flags.setdefault(flag.name, flag) != flag:
                raise ConfigError(
                    f"model family {family.name} declares --{flag.name} differently from another "
                    "family; share one Flag declaration"
                )
    return tuple(flags.values())


def all_presets() -> dict[str, dict]:
    """Every family's presets (`--config_name`), by name."""
    return {name: values for family in families().values() for name, values in family.presets.items()}


def preset_names(model_type: str | None = None) -> list[str]:
    """The presets' names, sorted: all, or those of one model type."""
    chosen = families().values() if model_type is None else [get_family(model_type)]
    return sorted(name for family in chosen for name in family.presets)


# -- the one config resolution ----------------------------------------------------------------------------------------
def load_config(config_name: str, model_type: str | None = None, **overrides) -> HFConfig:
    """A config from a preset name, JSON file or HF config directory; `model_type` in the file wins over the
    argument. The family's checks run on the file's values."""
    values = read_config_source(config_name, all_presets())
    found = values.get("model_type", model_type)
    if model_type and found and found != model_type and model_type in families():
        raise ConfigError(f"--config_name {config_name} is a {found!r} config but --model_type is {model_type!r}")
    return checked_config(values, found or model_type or DEFAULT_MODEL_TYPE, config_name, overrides)


def load_pretrained_config(path: str) -> HFConfig:
    """The config of a transformers checkpoint directory (--model_name_or_path, an export), checked."""
    return checked_config(read_pretrained_config(path), None, str(path))


def checked_config(values: dict, model_type: str | None, source: str, overrides: dict | None = None) -> HFConfig:
    """The family's config of HF config `values` (from `source`, named in errors), after the family's checks."""
    model_type = values.get("model_type", model_type)
    for family in families().values():
        if model_type in family.refused_types:
            raise ConfigError(f"{source} holds a {model_type!r} model: {family.refused_types[model_type]}")
    if model_type not in released_types():
        found = ", ".join(values.get("architectures") or []) or "no architectures listed"
        raise ConfigError(
            f"{source} holds a {model_type!r} model ({found}); supported model types: {', '.join(released_types())}"
        )
    family = get_family(model_type)
    family.check_hf_config(values)
    values = {**values, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    own = family.config_class if model_type == family.name else released_config_class(model_type)
    return own.from_dict(values)


def objective_for_shapes(
    family: Family, config: HFConfig, seq_len: int | None = None, *, flags: Mapping[str, Any] | None = None
) -> Objective:
    """The family's objective at the run's shapes, for synthetic batches (benchmarks, compile checks).

    Built from a small tokenizer trained on a few words: only lengths and special ids matter for shapes. `flags`: the
    run's objective flags (all of them); without them, the defaults with `seq_len` as the family's first
    objective flag (the one that sets the example length).
    """
    words = [" ".join(f"w{i}{j}" for j in range(50)) for i in range(20)]
    tokenizer = train_tokenizer(family, words, min(config.vocab_size, 512))
    if flags is None:
        flags = {family.flags[0].name: seq_len} if seq_len else {}
    return family.build_objective(flags, config, tokenizer)
