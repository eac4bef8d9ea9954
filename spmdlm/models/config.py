"""Model configs: frozen dataclasses whose fields carry Hugging Face config names, so config.json maps 1:1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C", bound="HFConfig")

PRESETS_DIR = Path(__file__).resolve().parents[2] / "models"


class ConfigError(ValueError):
    """A model config that cannot be found or used."""


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """Base for model configs. Subclasses set `model_type` and `architecture` as ClassVars."""

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
    candidates = [Path(config_name), Path(config_name) / "config.json", PRESETS_DIR / f"{config_name}.json"]
    for path in candidates:
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"--config_name {config_name}: {path} is not valid JSON ({e})") from None
    presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
    raise ConfigError(
        f"--config_name {config_name!r}: no such preset, JSON file or directory with config.json (presets: {presets})"
    )
