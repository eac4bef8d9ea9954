"""Model configs: frozen dataclasses whose fields carry Hugging Face config names, so config.json maps 1:1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="HFConfig")


def _presets_dir() -> Path:
    """The presets: `spmdlm/presets` in an installed wheel, the repository's `models/` in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "presets"
    return installed if installed.is_dir() else package.parent / "models"


PRESETS_DIR = _presets_dir()


class ConfigError(ValueError):
    """A model config that cannot be found or used."""


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


def read_config_source(config_name: str) -> dict[str, Any]:
    """`config_name` is a preset name (models/NAME.json), a JSON file, or a directory with config.json."""
    from spmdlm import storage

    given = storage.path(config_name, "--config_name")  # a gs:// JSON file or directory is read from the bucket
    candidates = [given, given / "config.json"] + ([] if storage.is_url(config_name) else
                                                   [PRESETS_DIR / f"{config_name}.json"])
    for path in candidates:
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"--config_name {config_name}: {path} is not valid JSON ({e})") from None
    presets = ", ".join(preset_names())
    raise ConfigError(
        f"--config_name {config_name!r}: no such preset, JSON file or directory with config.json (presets: {presets})"
    )


def preset_names(model_type: str | None = None) -> list[str]:
    """Names of the shipped presets, all or those of one model type."""
    names = []
    for path in sorted(PRESETS_DIR.glob("*.json")):
        if model_type is None or json.loads(path.read_text()).get("model_type") == model_type:
            names.append(path.stem)
    return names
