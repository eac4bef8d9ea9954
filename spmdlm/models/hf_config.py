"""Model configs: frozen dataclasses whose fields carry Hugging Face config names, so config.json maps 1:1."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from spmdlm import storage
from spmdlm.errors import ConfigError

C = TypeVar("C", bound="HFConfig")
DEFAULT_MODEL_TYPE = "gpt2"  # the family of a config, and so of a run, that names none (and of the quick start)


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """Base for model configs. Subclasses set `model_type` and `architecture` as ClassVars."""

    is_encoder_decoder: ClassVar[bool] = False

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Keep the fields we model; HF's many other keys (torch_dtype, task params, ...) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k in names}
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{cls.model_type} config: {e}") from None

    def replace(self: C, **changes) -> C:
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model_type"] = self.model_type  # type: ignore[attr-defined]
        out["architectures"] = [self.architecture]  # type: ignore[attr-defined]
        return out


def read_config_source(config_name: str, presets: Mapping[str, dict] | None = None) -> dict[str, Any]:
    """`config_name` is a JSON file, a directory with config.json (a resumed run's output dir), or a preset name (a
    key of `presets`: the families')."""
    given = storage.path(config_name, "--config_name")  # a gs:// JSON file or directory is read from the bucket
    for path in (given, given / "config.json"):
        if path.is_file():
            return read_json(path, f"--config_name {config_name}")
    if presets and config_name in presets:
        return copy.deepcopy(dict(presets[config_name]))  # a preset is shared: the caller may change its copy
    names = ", ".join(sorted(presets or ()))
    raise ConfigError(
        f"--config_name {config_name!r}: no such preset, JSON file or directory with config.json (presets: {names})"
    )


def read_pretrained_config(path: str) -> dict[str, Any]:
    """The config.json of a transformers checkpoint directory (--model_name_or_path, an export)."""
    config_path = storage.path(path, "--model_name_or_path") / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{path}: no config.json; pass a directory written by save_pretrained or save_hf")
    return read_json(config_path, str(path))


def read_json(path, what: str) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{what}: {path} does not hold a config (a JSON object)")
    return values
