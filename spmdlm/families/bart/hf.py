"""BART and transformers: the rename table onto `BartForConditionalGeneration` and the configs we refuse."""

from __future__ import annotations

from spmdlm.errors import ConfigError
from spmdlm.families.base import (
    LINEAR,
    ROW,
    SAME,
    Table,
)


# torch Linear weights are (out, in): LINEAR. {i} counts encoder layers, {j} decoder layers.
def _linear_rules(hf: str, ours: str):
    return ((f"{hf}.weight", f"{ours}.kernel", LINEAR), (f"{hf}.bias", f"{ours}.bias", SAME))


def _norm_rules(hf: str, ours: str):
    return ((f"{hf}.weight", f"{ours}.scale", SAME), (f"{hf}.bias", f"{ours}.bias", SAME))


def _stack_rules(stack: str, index: str, is_decoder: bool):
    hf, ours = f"model.{stack}.layers.{{{index}}}", f"{stack}.layers.layers"
    attention = lambda name: tuple(
        rule
        for a, b in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "out"))
        for rule in _linear_rules(f"{hf}.{name}.{a}_proj", f"{ours}.{name}.{b}")
    )
    return (
        (f"model.{stack}.embed_positions.weight", f"{stack}.embed_positions.embedding", SAME),
        *_norm_rules(f"model.{stack}.layernorm_embedding", f"{stack}.layernorm_embedding"),
        *attention("self_attn"),
        *_norm_rules(f"{hf}.self_attn_layer_norm", f"{ours}.self_attn_layer_norm"),
        *(
            (
                *attention("encoder_attn"),
                *_norm_rules(f"{hf}.encoder_attn_layer_norm", f"{ours}.encoder_attn_layer_norm"),
            )
            if is_decoder
            else ()
        ),
        *_linear_rules(f"{hf}.fc1", f"{ours}.mlp.wi"),
        *_linear_rules(f"{hf}.fc2", f"{ours}.mlp.wo"),
        *_norm_rules(f"{hf}.final_layer_norm", f"{ours}.final_layer_norm"),
    )


TABLE = Table(
    rules=(
        ("model.shared.weight", "shared.embedding", SAME),
        *_stack_rules("encoder", "i", is_decoder=False),
        *_stack_rules("decoder", "j", is_decoder=True),
        ("final_logits_bias", "final_logits_bias", ROW),  # a (1, vocab) buffer in HF
    ),
    layer_counts=lambda c: {"i": c.encoder_layers, "j": c.decoder_layers},
    hf_prefix="model.",  # BartPreTrainedModel.base_model_prefix
    # tied copies of model.shared; fairseq version buffers (transformers ignores them too)
    ignore=(
        r"^lm_head\.weight$",
        r"^(model\.)?(encoder|decoder)\.embed_tokens\.weight$",
        r"^(model\.)?(encoder|decoder)\.version$",
    ),
    optional=(r"^final_logits_bias$",),  # absent from BartModel checkpoints (facebook/bart-*): zeros
)


def check_hf_config(values: dict) -> None:
    # Keys of older (fairseq-converted) BART configs that mean another architecture; transformers ignores them.
    unsupported = {
        "normalize_before": True,
        "add_final_layer_norm": True,
        "static_position_embeddings": True,
        "normalize_embedding": False,
        "add_bias_logits": True,
    }
    for key, bad in unsupported.items():
        if values.get(key) == bad:
            raise ConfigError(
                f"BART config with {key}={str(bad).lower()} (mBART/Marian-style) is not supported; "
                "only the post-LayerNorm BART of facebook/bart-* is"
            )
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if values.get(key):
            raise ConfigError(f"BART {key} {values[key]} is not supported; set it to 0")
