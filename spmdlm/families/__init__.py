"""The family registry: every model family by model_type, and the one way to resolve a model config.

Families come from two places: the modules of this package (every module here except `base` holds one `FAMILY`),
and any installed package that names a `Family` under the `spmdlm.families` entry-point group, e.g. in its
pyproject.toml:

    [project.entry-points."spmdlm.families"]
    opt = "my_package.family:FAMILY"

so a new model is added without forking spmdlm (docs/architecture.md, "Adding a model").
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
from collections.abc import Mapping
from typing import Any

from spmdlm.data.objectives import Flag, Objective
from spmdlm.data.tokenization import train_tokenizer
from spmdlm.errors import ConfigError
from spmdlm.families.base import Family
from spmdlm.models.hf_config import HFConfig, preset_names, read_config_source, read_pretrained_config
from spmdlm.run_args.choices import DEFAULT_MODEL_TYPE, FamilyChoices

ENTRY_POINT_GROUP = "spmdlm.families"


@functools.cache
def families() -> dict[str, Family]:
    """model_type -> Family: this package's, then the entry points' (loaded once, on first use)."""
    found: dict[str, tuple[Family, str]] = {}

    def add(family, source: str) -> None:
        if not isinstance(family, Family):
            raise ConfigError(f"model family {source} is a {type(family).__name__}, not a spmdlm Family")
        if family.name in found:
            raise ConfigError(
                f"two model families are named {family.name!r}: {found[family.name][1]} and {source}; "
                "uninstall or rename one"
            )
        found[family.name] = (family, source)

    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        add(importlib.import_module(f"{__name__}.{module}").FAMILY, f"spmdlm.families.{module}")
    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        source = f"entry point {entry.name} = {entry.value}"
        try:
            family = entry.load()
        except Exception as e:  # a broken plugin: say which, not a traceback from deep inside importlib
            raise ConfigError(f"model family {source} failed to load: {type(e).__name__}: {e}") from None
        add(family, source)
    return {name: family for name, (family, _) in found.items()}


def get_family(model_type: str | None) -> Family:
    known = families()
    if model_type not in known:
        raise ConfigError(f"model_type {model_type!r} is not supported; choose one of {', '.join(known)}")
    return known[model_type]


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
    """The families' own presets (shipped presets are files: spmdlm.models.hf_config.preset_names)."""
    return {name: values for family in families().values() for name, values in family.presets.items()}


def family_choices() -> FamilyChoices:
    """What the launcher's parser needs to know of the families."""
    known = families()
    return FamilyChoices(
        objective_flags(),
        {name: tuple(flag.name for flag in f.flags) for name, f in known.items()},
        {name: f.quickstart for name, f in known.items()},
        tuple(preset_names()) + tuple(sorted(all_presets())),
        {name: f.default_preset for name, f in known.items()},
    )


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
    if model_type not in families():
        found = ", ".join(values.get("architectures") or []) or "no architectures listed"
        raise ConfigError(
            f"{source} holds a {model_type!r} model ({found}); supported model types: {', '.join(families())}"
        )
    family = families()[model_type]
    family.check_hf_config(values)
    values = {**values, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return family.config_class.from_dict(values)


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
