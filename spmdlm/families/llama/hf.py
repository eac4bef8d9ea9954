"""The rename table between our Llama/Qwen3 parameters and transformers' `LlamaForCausalLM` /
`Qwen3ForCausalLM`, and the transformers options we refuse (one line each)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from spmdlm.errors import ConfigError
from spmdlm.families.base import LINEAR, SAME, Table, TensorRule
from spmdlm.families.llama.model import LlamaConfig

LAYER = "model.layers.{i}."
STACK = "stacks.{r}.layers."


@dataclasses.dataclass(frozen=True)
class RunsTable(Table):
    """A `Table` whose `{i}` rules run over the layers of several stacks: HF layer `first + j` is slice j of our
    stack r, for each run (kind, first, count) of `config.runs()`. Rules of parameters the config does not have
    (biases, QK-norm, an untied head) are left out."""

    def expand(self, config: LlamaConfig) -> Iterator[TensorRule]:
        for hf, ours, layout in self.rules:
            if not _present(hf, config):
                continue
            if "{i}" not in hf:
                yield TensorRule(hf, ours, layout, None)
                continue
            for r, (_, first, count) in enumerate(config.runs()):
                for j in range(count):
                    yield TensorRule(hf.format(i=first + j), ours.format(r=r), layout, j)


def _present(hf: str, config: LlamaConfig) -> bool:
    if hf.startswith("lm_head"):
        return not config.tie_word_embeddings
    if "_norm." in hf and "self_attn" in hf:
        return config.qk_norm
    if hf.endswith(".bias"):
        return config.attention_bias if "self_attn" in hf else config.mlp_bias
    return True


def _projections(hf_module: str, ours_module: str, names: dict[str, str]) -> tuple:
    return tuple(
        (
            f"{LAYER}{hf_module}.{hf}.{kind}",
            f"{STACK}{ours_module}.{ours}.{'kernel' if kind == 'weight' else kind}",
            layout,
        )
        for hf, ours in names.items()
        for kind, layout in (("weight", LINEAR), ("bias", SAME))
    )


TABLE = RunsTable(
    rules=(
        ("model.embed_tokens.weight", "embed_tokens.embedding", SAME),
        (f"{LAYER}input_layernorm.weight", f"{STACK}input_layernorm.scale", SAME),
        *_projections(
            "self_attn", "self_attn", {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out"}
        ),
        (f"{LAYER}self_attn.q_norm.weight", f"{STACK}self_attn.q_norm.scale", SAME),
        (f"{LAYER}self_attn.k_norm.weight", f"{STACK}self_attn.k_norm.scale", SAME),
        (f"{LAYER}post_attention_layernorm.weight", f"{STACK}post_attention_layernorm.scale", SAME),
        *_projections("mlp", "mlp", {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}),
        ("model.norm.weight", "norm.scale", SAME),
        ("lm_head.weight", "lm_head.kernel", LINEAR),
    ),
    layer_counts=lambda c: {"i": c.num_hidden_layers},
    hf_prefix="model.",
    ignore=(r"^lm_head\.weight$", r"rotary_emb\.inv_freq$"),  # a tied head's copy; RoPE's buffer (older files)
)


def check_hf_config(values: dict) -> None:
    """Refuses the transformers options we do not reproduce (the config class refuses the rest: RoPE types,
    hidden_act, head counts)."""
    if values.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(
            f"pretraining_tp={values['pretraining_tp']} is not supported (it only splits matmuls); set it to 1"
        )
    if values.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor other than 1.0 is not supported: RoPE rotates the whole head")
