"""Model registry: model_type -> architecture (config class, NNX module, encoder-decoder or not).

A new model is one file here, one entry below, one export table in `spmdlm.export` and one objective.
"""

from __future__ import annotations

import dataclasses

from spmdlm.models.config import ConfigError, HFConfig, read_config_source
from spmdlm.models.gpt2 import GPT2Config, GPT2LMHeadModel
from spmdlm.models.t5 import T5Config, T5ForConditionalGeneration


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_type: str
    config_class: type[HFConfig]
    model_class: type
    is_encoder_decoder: bool


ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("gpt2", GPT2Config, GPT2LMHeadModel, is_encoder_decoder=False),
    "t5": Architecture("t5", T5Config, T5ForConditionalGeneration, is_encoder_decoder=True),
}


def get_architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"model_type {model_type!r} is not supported; choose one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def load_config(config_name: str, model_type: str | None = None, **overrides) -> HFConfig:
    """A config from a preset name, JSON file or HF directory; `model_type` in the file wins over the argument."""
    values = read_config_source(config_name)
    found = values.get("model_type", model_type)
    if model_type and found and found != model_type and model_type in ARCHITECTURES:
        raise ConfigError(f"--config_name {config_name} is a {found!r} config but --model_type is {model_type!r}")
    arch = get_architecture(found or model_type or "")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return arch.config_class.from_dict(values)
