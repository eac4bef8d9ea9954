"""OPT as an out-of-tree spmdlm model family: a pre-LayerNorm decoder-only LM built from spmdlm's shared layers.

Mirrors transformers' `OPTForCausalLM` (model_type "opt") in its pre-norm form (facebook/opt-125m, 1.3b, ...):
learned positions read at rows offset by 2 (position t uses row t + 2 of a table of max_position_embeddings + 2
rows), separate q/k/v/out projections with biases, a ReLU MLP fc1/fc2 with biases, pre-LayerNorm blocks, a final
LayerNorm and an LM head tied to the token embedding. No embedding scaling, no dropout on the embeddings (as HF).

Positions are 0..T-1 for every row, as GPT-2's: transformers' OPT derives them from the attention mask
(cumsum(mask) - 1), which gives the same positions to every real token of a right-padded row (or an unpadded one),
not to a left-padded row's. Training batches (CausalLM blocks) have no padding. No KV cache (no generation).

Public names: OPTConfig, OPTForCausalLM, TABLE (the rename table onto OPTForCausalLM's state dict), TINY (the tiny
preset of presets/opt-tiny.json), forward_flops, check_hf_config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.errors import ConfigError
from spmdlm.families.base import LINEAR, SAME, Table
from spmdlm.flops import attention_matmuls, dense
from spmdlm.mesh import constrain
from spmdlm.models.attention import Attention, make_attention_mask, segment_positions
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.layers import MLP, Embed, LayerNorm, dropout
from spmdlm.models.stack import LayerStack

POSITION_OFFSET = 2  # position t reads row t + 2 of embed_positions (a fairseq legacy, as BART's)
LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default, which OPT uses everywhere


@dataclasses.dataclass(frozen=True)
class OPTConfig(HFConfig):
    model_type: ClassVar[str] = "opt"
    architecture: ClassVar[str] = "OPTForCausalLM"

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    activation_function: str = "relu"
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None  # None = hidden_size (HF's default); resolved in __post_init__
    dropout: float = 0.0  # HF's default is 0.1; 0 is the pretraining recipe's setting, as for GPT-2
    attention_dropout: float = 0.0
    layerdrop: float = 0.0
    init_std: float = 0.02
    layer_norm_elementwise_affine: bool = True
    enable_bias: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        refusals = (
            (
                self.hidden_size % self.num_attention_heads != 0,
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}",
            ),
            (not self.do_layer_norm_before, "do_layer_norm_before false (opt-350m's post-LayerNorm) is not supported"),
            (
                self.word_embed_proj_dim != self.hidden_size,
                f"word_embed_proj_dim {self.word_embed_proj_dim} != hidden_size {self.hidden_size} (project_in/out) "
                "is not supported",
            ),
            (
                self.activation_function != "relu",
                f"activation_function {self.activation_function!r} is not supported; OPT here is relu only",
            ),
            (not self.enable_bias, "enable_bias false is not supported"),
            (not self.layer_norm_elementwise_affine, "layer_norm_elementwise_affine false is not supported"),
            (not self.tie_word_embeddings, "an LM head untied from embed_tokens is not supported"),
            (self.layerdrop != 0, f"layerdrop {self.layerdrop} is not supported; set it to 0"),
            (
                self.max_position_embeddings < 1,
                f"max_position_embeddings {self.max_position_embeddings} must be at least 1",
            ),
        )
        for refused, message in refusals:
            if refused:
                raise ValueError(message)

    @property
    def max_length(self) -> int:
        """Longest sequence the model reads (the offset rows are extra)."""
        return self.max_position_embeddings


def check_hf_config(values: dict) -> None:
    """HF config keys that are no fields of ours but change the model: refused."""
    if values.get("_remove_final_layer_norm"):
        raise ConfigError("OPT config with _remove_final_layer_norm true (pre-v4.20 checkpoints) is not supported")


class DecoderLayer(nnx.Module):
    """A pre-LayerNorm OPT layer: x + attn(ln(x)), then x + fc2(relu(fc1(ln(x)))); residual dropout on both.

    Names follow HF's OPTDecoderLayer where the shared layers allow (the MLP's fc1/fc2 are `mlp.wi`/`mlp.wo`)."""

    def __init__(self, config: OPTConfig, *, dtype, rngs: nnx.Rngs):
        d, std = config.hidden_size, config.init_std
        self.self_attn_layer_norm = LayerNorm(d, eps=LAYER_NORM_EPS, rngs=rngs)
        self.self_attn = Attention(
            d,
            config.num_attention_heads,
            d // config.num_attention_heads,
            dropout_rate=config.attention_dropout,
            init_std=std,
            dtype=dtype,
            rngs=rngs,
        )
        self.final_layer_norm = LayerNorm(d, eps=LAYER_NORM_EPS, rngs=rngs)
        self.mlp = MLP(d, config.ffn_dim, activation=config.activation_function, init_std=std, dtype=dtype, rngs=rngs)
        self.dropout_rate = config.dropout

    def __call__(self, x, mask, *, rngs=None, cache=None):
        rate = self.dropout_rate
        h = self.self_attn(self.self_attn_layer_norm(x), mask=mask, rngs=rngs, cache=cache)
        x = x + dropout(h, rate, rngs)
        x = x + dropout(self.mlp(self.final_layer_norm(x), rngs), rate, rngs)
        return constrain(x, "batch", "length", "act_embed")


class OPTForCausalLM(nnx.Module):
    """`model(input_ids, attention_mask=None, rngs=None) -> logits [B, T, V]`; dropout only when rngs are given.

    `attention_mask` is 1 for real tokens, 0 for padding (padded keys are hidden; positions stay 0..T-1)."""

    config_class = OPTConfig

    def __init__(
        self, config: OPTConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, remat: str = "dots", scan_unroll: int | bool = 1
    ):
        self.config = config
        d, std = config.hidden_size, config.init_std
        self.embed_tokens = Embed(config.vocab_size, d, init_std=std, dtype=dtype, rngs=rngs)
        self.embed_positions = Embed(
            config.max_position_embeddings + POSITION_OFFSET,
            d,
            init_std=std,
            dtype=dtype,
            axes=("positions", "embed"),
            rngs=rngs,
        )
        self.layers = LayerStack(
            lambda r: DecoderLayer(config, dtype=dtype, rngs=r),
            config.num_hidden_layers,
            rngs=rngs,
            remat=remat,
            unroll=scan_unroll,
        )
        self.final_layer_norm = LayerNorm(d, eps=LAYER_NORM_EPS, rngs=rngs)

    @property
    def max_length(self) -> int:
        return self.config.max_length

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        features_only: bool = False,
    ) -> jax.Array:
        """Packed rows (`--document_attention isolated`) pass `segment_ids` and `positions` within each segment."""
        length = input_ids.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        if positions is None:
            positions = jnp.arange(length)[None] if segment_ids is None else segment_positions(segment_ids)
        x = constrain(
            self.embed_tokens(input_ids) + self.embed_positions(positions + POSITION_OFFSET),
            "batch",
            "length",
            "act_embed",
        )
        mask = make_attention_mask(attention_mask, causal=True, q_segments=segment_ids, kv_segments=segment_ids)
        x = self.final_layer_norm(self.layers(x, mask, rngs=rngs))
        return x if features_only else self.head(x)

    def head(self, x: jax.Array) -> jax.Array:
        """The final features [..., d] -> logits [..., V] (tied to embed_tokens)."""
        return constrain(self.embed_tokens.attend(x), "batch", "length", "act_vocab")


# -- rename table onto transformers' OPTForCausalLM ----------------------------------------------------------------
# torch Linear weights are (out, in): LINEAR. {i} runs over the decoder layers (our stacked `layers.layers`).
def _linear(hf: str, ours: str):
    return ((f"{hf}.weight", f"{ours}.kernel", LINEAR), (f"{hf}.bias", f"{ours}.bias", SAME))


def _norm(hf: str, ours: str):
    return ((f"{hf}.weight", f"{ours}.scale", SAME), (f"{hf}.bias", f"{ours}.bias", SAME))


_HF_LAYER, _OUR_LAYER = "model.decoder.layers.{i}", "layers.layers"

TABLE = Table(
    rules=(
        ("model.decoder.embed_tokens.weight", "embed_tokens.embedding", SAME),
        ("model.decoder.embed_positions.weight", "embed_positions.embedding", SAME),
        *(
            rule
            for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out"))
            for rule in _linear(f"{_HF_LAYER}.self_attn.{hf}", f"{_OUR_LAYER}.self_attn.{ours}")
        ),
        *_norm(f"{_HF_LAYER}.self_attn_layer_norm", f"{_OUR_LAYER}.self_attn_layer_norm"),
        *_linear(f"{_HF_LAYER}.fc1", f"{_OUR_LAYER}.mlp.wi"),
        *_linear(f"{_HF_LAYER}.fc2", f"{_OUR_LAYER}.mlp.wo"),
        *_norm(f"{_HF_LAYER}.final_layer_norm", f"{_OUR_LAYER}.final_layer_norm"),
        *_norm("model.decoder.final_layer_norm", "final_layer_norm"),
    ),
    layer_counts=lambda c: {"i": c.num_hidden_layers},
    hf_prefix="model.",  # OPTPreTrainedModel.base_model_prefix: a bare OPTModel checkpoint has decoder.* names
    ignore=(r"^lm_head\.weight$",),  # tied copy of embed_tokens (transformers re-ties it on load)
)


# -- size and cost -------------------------------------------------------------------------------------------------
TINY = json.loads((Path(__file__).parent / "presets" / "opt-tiny.json").read_text())  # the family's preset


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part (see spmdlm/flops.py for the conventions)."""
    seq, d, n_layer = lengths["input"], config.hidden_size, config.num_hidden_layers
    per_layer_dense = 4 * dense(d, d) + dense(d, config.ffn_dim) + dense(config.ffn_dim, d)  # q, k, v, out; fc1, fc2
    per_layer_attention = attention_matmuls(seq, d) / (1 if full_causal_square else 2)  # causal: half
    return {
        "dense": seq * n_layer * per_layer_dense,
        "attention": seq * n_layer * per_layer_attention,
        "lm_head": seq * dense(d, config.vocab_size),
    }
