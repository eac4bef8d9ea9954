"""The Qwen3 family: the Llama family (`spmdlm/families/llama`) with a per-head RMSNorm of queries and keys
(QK-norm) and, when `use_sliding_window` is set, sliding-window attention in the layers `layer_types` marks
(by default those from `max_window_layers` on), as transformers' `Qwen3ForCausalLM`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from spmdlm.errors import ConfigError
from spmdlm.families.llama import FAMILY as LLAMA
from spmdlm.families.llama.hf import check_hf_config as check_llama_config
from spmdlm.families.llama.model import FULL, SLIDING, LlamaConfig


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """transformers' `Qwen3Config` names and defaults (no `mlp_bias`: Qwen3's MLP has none)."""

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if not self.use_sliding_window:  # as transformers reads it: no window when windows are off
            object.__setattr__(self, "sliding_window", None)
        if self.layer_types is None:
            windowed = self.use_sliding_window and self.sliding_window is not None
            kinds = [
                SLIDING if windowed and i >= self.max_window_layers else FULL for i in range(self.num_hidden_layers)
            ]
            object.__setattr__(self, "layer_types", tuple(kinds))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {FULL, SLIDING}:
            raise ValueError(f"layer_types must name {self.num_hidden_layers} layers, each {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and not (self.use_sliding_window and self.sliding_window):
            raise ValueError("layer_types has sliding_attention layers but use_sliding_window is off; set it")

    def layer_kinds(self) -> list[str]:
        return list(self.layer_types)

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None

    def to_hf_dict(self):
        out = super().to_hf_dict()
        del out["mlp_bias"]
        out["layer_types"] = list(self.layer_types)
        return out


def check_hf_config(values: dict) -> None:
    check_llama_config(values)
    if values.get("mlp_bias"):
        raise ConfigError("a Qwen3 config with mlp_bias is not Qwen3 (its MLP has no biases); use model_type llama")


FAMILY = dataclasses.replace(
    LLAMA,
    name="qwen3",
    config_class=Qwen3Config,
    default_preset="qwen3-tiny",
    quickstart={**LLAMA.quickstart, "config_name": "qwen3-tiny"},
    check_hf_config=check_hf_config,
)
