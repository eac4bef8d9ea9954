"""GPT-2 and transformers: the rename table onto `GPT2LMHeadModel` and the configs we refuse."""

from __future__ import annotations

from spmdlm.errors import ConfigError
from spmdlm.families.base import FLAT, FLAT_OUT, SAME, Table

TABLE = Table(
    rules=(
        ("transformer.wte.weight", "wte.embedding", SAME),
        ("transformer.wpe.weight", "wpe.embedding", SAME),
        ("transformer.h.{i}.ln_1.weight", "h.layers.ln_1.scale", SAME),
        ("transformer.h.{i}.ln_1.bias", "h.layers.ln_1.bias", SAME),
        ("transformer.h.{i}.attn.c_attn.weight", "h.layers.attn.qkv.kernel", FLAT_OUT),  # Conv1D is (in, out)
        ("transformer.h.{i}.attn.c_attn.bias", "h.layers.attn.qkv.bias", FLAT),
        ("transformer.h.{i}.attn.c_proj.weight", "h.layers.attn.out.kernel", SAME),
        ("transformer.h.{i}.attn.c_proj.bias", "h.layers.attn.out.bias", SAME),
        ("transformer.h.{i}.ln_2.weight", "h.layers.ln_2.scale", SAME),
        ("transformer.h.{i}.ln_2.bias", "h.layers.ln_2.bias", SAME),
        ("transformer.h.{i}.mlp.c_fc.weight", "h.layers.mlp.wi.kernel", SAME),
        ("transformer.h.{i}.mlp.c_fc.bias", "h.layers.mlp.wi.bias", SAME),
        ("transformer.h.{i}.mlp.c_proj.weight", "h.layers.mlp.wo.kernel", SAME),
        ("transformer.h.{i}.mlp.c_proj.bias", "h.layers.mlp.wo.bias", SAME),
        ("transformer.ln_f.weight", "ln_f.scale", SAME),
        ("transformer.ln_f.bias", "ln_f.bias", SAME),
    ),
    layer_counts=lambda c: {"i": c.n_layer},
    hf_prefix="transformer.",
    ignore=(r"^lm_head\.weight$", r"\.attn\.(masked_)?bias$"),  # tied copy; causal-mask buffers
)


def check_hf_config(values: dict) -> None:
    unsupported = {
        "scale_attn_by_inverse_layer_idx": True,
        "reorder_and_upcast_attn": True,
        "add_cross_attention": True,
    }
    for key, bad in unsupported.items():
        if values.get(key) == bad:
            raise ConfigError(f"GPT-2 config with {key}={bad} is not supported")
