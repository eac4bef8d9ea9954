"""T5 v1.1 and transformers: the rename table onto `T5ForConditionalGeneration` and the configs we refuse."""

from __future__ import annotations

from spmdlm.errors import ConfigError
from spmdlm.families.base import LINEAR, SAME, Table
from spmdlm.families.t5.model import dense_activation, hf_scales_decoder_outputs

# A T5 or mT5 that transformers 5 created and saved: its head is shared's, so the file has no lm_head.weight.
TIED_HEAD = (
    "has its lm_head tied to shared (no lm_head.weight: transformers 5 ties the head of a T5 or mT5 it created, "
    "whatever config.json says); spmdlm's T5 is T5 v1.1, whose head is its own (as google/t5-v1_1-* and "
    "google/mt5-* ship): give it one before saving, model.lm_head.weight = "
    "torch.nn.Parameter(model.shared.weight.detach().clone())"
)


# torch Linear weights are (out, in): LINEAR. {i} counts encoder blocks, {j} decoder blocks.
def _attention_rules(hf: str, ours: str):
    return tuple(
        (f"{hf}.{a}.weight", f"{ours}.{b}.kernel", LINEAR)
        for a, b in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out"))
    )


def _mlp_rules(hf: str, ours: str):
    dense_rules = tuple(
        (f"{hf}.DenseReluDense.{w}.weight", f"{ours}.mlp.{w}.kernel", LINEAR) for w in ("wi_0", "wi_1", "wo")
    )
    return (*dense_rules, (f"{hf}.layer_norm.weight", f"{ours}.mlp_norm.scale", SAME))


def _stack_rules(stack: str, index: str, is_decoder: bool):
    block, ours = f"{stack}.block.{{{index}}}.layer", f"{stack}.block.layers"
    rules = [
        # HF keeps the stack's relative-position table in block 0; ours belongs to the stack
        (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            f"{stack}.relative_attention_bias.embedding",
            SAME,
        ),
        (f"{block}.0.layer_norm.weight", f"{ours}.self_attention_norm.scale", SAME),
        *_attention_rules(f"{block}.0.SelfAttention", f"{ours}.self_attention"),
    ]
    if is_decoder:
        rules += [
            (f"{block}.1.layer_norm.weight", f"{ours}.cross_attention_norm.scale", SAME),
            *_attention_rules(f"{block}.1.EncDecAttention", f"{ours}.cross_attention"),
        ]
    rules += _mlp_rules(f"{block}.{2 if is_decoder else 1}", ours)
    rules.append((f"{stack}.final_layer_norm.weight", f"{stack}.final_layer_norm.scale", SAME))
    return tuple(rules)


TABLE = Table(
    rules=(
        ("shared.weight", "shared.embedding", SAME),
        *_stack_rules("encoder", "i", is_decoder=False),
        *_stack_rules("decoder", "j", is_decoder=True),
        # Untied in v1.1: written and read separately from shared. transformers 5 forces T5Config.tie_word_embeddings
        # (and MT5Config's) to True whatever config.json says (for T5 it then only decides the output scaling): it
        # ties lm_head to shared unless the checkpoint holds an lm_head.weight that differs (TIED_HEAD otherwise).
        ("lm_head.weight", "lm_head.kernel", LINEAR),
    ),
    layer_counts=lambda c: {"i": c.num_layers, "j": c.num_decoder_layers},
    ignore=(
        r"^(encoder|decoder)\.embed_tokens\.weight$",  # tied copies of shared
        r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
    ),  # unused by HF too
    absent_means=((r"^lm_head\.weight$", TIED_HEAD),),
)


def check_hf_config(values: dict) -> None:
    # A key the file leaves out means what transformers reads: its default (relu; a tied, scaled head).
    proj = values.get("feed_forward_proj", "relu")
    if dense_activation(proj) is None:
        given = "" if "feed_forward_proj" in values else " (absent: transformers' default)"
        raise ConfigError(
            f"T5 feed_forward_proj {proj!r}{given} is not supported; only gated ones such as "
            '\'gated-gelu\' (T5 v1.1, Flan-T5) are: set "feed_forward_proj": "gated-gelu"'
        )
    if hf_scales_decoder_outputs(values):
        raise ConfigError(
            "T5 with a tied, d_model**-0.5-scaled LM head (original T5; transformers' default when "
            "tie_word_embeddings is absent) is not supported; only T5 v1.1 (tie_word_embeddings false "
            "or scale_decoder_outputs false) is"
        )
