"""RoBERTa and transformers: the rename table onto `RobertaForMaskedLM` and the configs we refuse."""

from __future__ import annotations

from spmdlm.errors import ConfigError
from spmdlm.families.base import (
    LINEAR,
    SAME,
    Table,
)

_LAYER, _OURS = "roberta.encoder.layer.{i}", "layer.layers"
TABLE = Table(
    rules=(
        ("roberta.embeddings.word_embeddings.weight", "word_embeddings.embedding", SAME),
        ("roberta.embeddings.position_embeddings.weight", "position_embeddings.embedding", SAME),
        ("roberta.embeddings.token_type_embeddings.weight", "token_type_embeddings.embedding", SAME),
        ("roberta.embeddings.LayerNorm.weight", "embeddings_layer_norm.scale", SAME),
        ("roberta.embeddings.LayerNorm.bias", "embeddings_layer_norm.bias", SAME),
        *(
            (f"{_LAYER}.attention.self.{hf}.{w}", f"{_OURS}.self_attn.{ours}.{o}", LINEAR if w == "weight" else SAME)
            for hf, ours in (("query", "query"), ("key", "key"), ("value", "value"))
            for w, o in (("weight", "kernel"), ("bias", "bias"))
        ),
        (f"{_LAYER}.attention.output.dense.weight", f"{_OURS}.self_attn.out.kernel", LINEAR),
        (f"{_LAYER}.attention.output.dense.bias", f"{_OURS}.self_attn.out.bias", SAME),
        (f"{_LAYER}.attention.output.LayerNorm.weight", f"{_OURS}.self_attn_layer_norm.scale", SAME),
        (f"{_LAYER}.attention.output.LayerNorm.bias", f"{_OURS}.self_attn_layer_norm.bias", SAME),
        (f"{_LAYER}.intermediate.dense.weight", f"{_OURS}.mlp.wi.kernel", LINEAR),
        (f"{_LAYER}.intermediate.dense.bias", f"{_OURS}.mlp.wi.bias", SAME),
        (f"{_LAYER}.output.dense.weight", f"{_OURS}.mlp.wo.kernel", LINEAR),
        (f"{_LAYER}.output.dense.bias", f"{_OURS}.mlp.wo.bias", SAME),
        (f"{_LAYER}.output.LayerNorm.weight", f"{_OURS}.final_layer_norm.scale", SAME),
        (f"{_LAYER}.output.LayerNorm.bias", f"{_OURS}.final_layer_norm.bias", SAME),
        ("lm_head.dense.weight", "lm_head_dense.kernel", LINEAR),
        ("lm_head.dense.bias", "lm_head_dense.bias", SAME),
        ("lm_head.layer_norm.weight", "lm_head_layer_norm.scale", SAME),
        ("lm_head.layer_norm.bias", "lm_head_layer_norm.bias", SAME),
        ("lm_head.bias", "lm_head_bias", SAME),
    ),
    layer_counts=lambda c: {"i": c.num_hidden_layers},
    hf_prefix="roberta.",
    # the decoder is tied to the word embeddings (its bias to lm_head.bias); buffers; RobertaModel's pooler
    ignore=(r"^lm_head\.decoder\.(weight|bias)$", r"embeddings\.(position_ids|token_type_ids)$", r"pooler\."),
)


def check_hf_config(values: dict) -> None:
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(
            f"RoBERTa position_embedding_type {values['position_embedding_type']!r} is not supported; "
            "only 'absolute' is"
        )
    if values.get("is_decoder") or values.get("add_cross_attention"):
        raise ConfigError("RoBERTa as a decoder (is_decoder/add_cross_attention) is not supported")
