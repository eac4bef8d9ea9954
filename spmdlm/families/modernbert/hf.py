"""ModernBERT <-> transformers' `ModernBertForMaskedLM`: the rename table and the configs we refuse.

transformers numbers the layers 0..N-1; ours are layer 0, then periods of `global_attn_every_n_layers` layers (the
sliding-window ones, then the global one) stacked over the periods, then a stack of the sliding-window layers left
over (model.py). `ModernBertTable.expand` maps each transformers layer to its slot there; the rules are written once
for a layer, and a bias or norm bias the config turns off has no rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from spmdlm.errors import ConfigError
from spmdlm.families.base import FLAT, LINEAR, SAME, Layout, Table, TensorRule
from spmdlm.families.modernbert.model import ModernBertConfig, every_n_layers

# transformers' fused Linear (out, in) of [in, 2|3, out] here: Wqkv's q, k, v and Wi's input and gate halves
FUSED_LINEAR: Layout = (
    lambda x: np.ascontiguousarray(x.reshape(x.shape[0], -1).T),
    lambda x, shape: np.ascontiguousarray(x.T).reshape(shape),
)


def _norm(hf: str, ours: str) -> tuple:
    """The rules of a LayerNorm: its gain, and its bias where `norm_bias` gives it one."""
    return ((f"{hf}.weight", f"{ours}.scale", SAME, None), (f"{hf}.bias", f"{ours}.bias", SAME, "norm_bias"))


# (HF name, ours, layout, the config flag that gives the tensor: None = always there), within a layer
_LAYER_RULES = (
    ("attn.Wqkv.weight", "attn.qkv.kernel", FUSED_LINEAR, None),
    ("attn.Wqkv.bias", "attn.qkv.bias", FLAT, "attention_bias"),
    ("attn.Wo.weight", "attn.out.kernel", LINEAR, None),
    ("attn.Wo.bias", "attn.out.bias", SAME, "attention_bias"),
    ("mlp.Wi.weight", "mlp.Wi.kernel", FUSED_LINEAR, None),
    ("mlp.Wi.bias", "mlp.Wi.bias", FLAT, "mlp_bias"),
    ("mlp.Wo.weight", "mlp.Wo.kernel", LINEAR, None),
    ("mlp.Wo.bias", "mlp.Wo.bias", SAME, "mlp_bias"),
    *_norm("attn_norm", "attn_norm"),
    *_norm("mlp_norm", "mlp_norm"),
)
# ... and outside the layers
_MODEL_RULES = (
    ("model.embeddings.tok_embeddings.weight", "tok_embeddings.embedding", SAME, None),
    *_norm("model.embeddings.norm", "embeddings_norm"),
    *_norm("model.final_norm", "final_norm"),
    ("head.dense.weight", "head_dense.kernel", LINEAR, None),
    ("head.dense.bias", "head_dense.bias", SAME, "classifier_bias"),
    *_norm("head.norm", "head_norm"),
    ("decoder.bias", "decoder_bias", SAME, "decoder_bias"),
)


def layer_slots(config: ModernBertConfig) -> Iterator[tuple[int, str, int | None]]:
    """(transformers' layer index, our layer's module path, its index in that stack or None) of every layer."""
    n = config.global_attn_every_n_layers
    periods, leftover = config.periods
    yield 0, "first_layer", None
    for period in range(periods):
        for j in range(n - 1):
            yield 1 + period * n + j, f"layers.layers.sliding.{j}", period
        yield (period + 1) * n, "layers.layers.full", period
    for t in range(leftover):
        yield 1 + periods * n + t, "tail.layers", t


@dataclasses.dataclass(frozen=True)
class ModernBertTable(Table):
    """The table of one config: the model's rules, then each layer's (layer 0 has no attn_norm)."""

    def expand(self, config: ModernBertConfig) -> Iterator[TensorRule]:
        present = lambda flag: flag is None or getattr(config, flag)
        for hf, ours, layout, flag in _MODEL_RULES:
            if present(flag):
                yield TensorRule(hf, ours, layout, None)
        for hf_layer, path, index in layer_slots(config):
            for hf, ours, layout, flag in _LAYER_RULES:
                if present(flag) and not (hf_layer == 0 and hf.startswith("attn_norm")):
                    yield TensorRule(f"model.layers.{hf_layer}.{hf}", f"{path}.{ours}", layout, index)


TABLE = ModernBertTable(
    rules=(),  # expand writes them for the config
    layer_counts=lambda c: {"i": c.num_hidden_layers},
    hf_prefix="model.",
    ignore=(r"^decoder\.weight$",),  # tied to the token embeddings
)


def rope_types(values: dict) -> Iterator[tuple[str, str]]:
    """(where, type) of every RoPE type a config names: `rope_parameters` or `rope_scaling`, flat or by layer type,
    under the key `rope_type` or the older `type` (a mapping without either is the default RoPE)."""
    kind = lambda part: str(part.get("rope_type", part.get("type", "default")))
    for key in ("rope_parameters", "rope_scaling"):
        given = values.get(key) or {}
        if not isinstance(given, dict):
            yield key, repr(given)
            continue
        yield key, kind(given)
        yield from ((f"{key}.{layer}", kind(part)) for layer, part in given.items() if isinstance(part, dict))


def check_hf_config(values: dict) -> None:
    """Refuses, in one line each, the transformers options we do not reproduce."""
    for where, kind in rope_types(values):
        if kind != "default":
            raise ConfigError(
                f"ModernBERT {where}: rope_type {kind!r} is not supported (ModernBERT supports only the default RoPE "
                f"here, which would train in its place); set its rope_type to 'default' or remove it"
            )
    if values.get("layer_types"):
        try:
            every_n_layers(values["layer_types"])
        except ValueError as e:
            raise ConfigError(f"ModernBERT {e}") from None
    if values.get("tie_word_embeddings") is False:
        raise ConfigError("ModernBERT with an untied decoder (tie_word_embeddings false) is not supported")
