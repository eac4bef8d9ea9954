"""The GPT-2 family: causal LM on blocks of `--block_size` tokens, transformers' `GPT2LMHeadModel`."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.objectives.clm import BLOCK_SIZE, CausalLM
from spmdlm.data.tokenization import TokenizerSpec, special_token_ids
from spmdlm.errors import ArgumentError, ConfigError
from spmdlm.families.base import FLAT, FLAT_OUT, SAME, Family, Generation, Table, forward_single_stack
from spmdlm.flops import attention_matmuls, dense
from spmdlm.models.gpt2 import GPT2Config, GPT2LMHeadModel

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


def block_size(flags, config) -> int:
    return BLOCK_SIZE.of(flags) or min(1024, config.n_positions)


def check_lengths(flags, config) -> None:
    if block_size(flags, config) > config.n_positions:
        raise ArgumentError(
            f"--block_size {block_size(flags, config)} is longer than the model's n_positions "
            f"{config.n_positions}; lower --block_size or use a config with more positions"
        )


def build_objective(flags, config, tokenizer):
    return CausalLM(
        block_size(flags, config),
        eos_id=special_token_ids(tokenizer, FAMILY.tokenizer)["eos"],
        document_attention=DOCUMENT_ATTENTION.of(flags),
    )


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part (see spmdlm/flops.py for the conventions)."""
    seq, d, n_layer, vocab = lengths["input"], config.n_embd, config.n_layer, config.vocab_size
    ff = config.n_inner or 4 * d
    per_layer_dense = dense(d, 3 * d) + dense(d, d) + dense(d, ff) + dense(ff, d)
    per_layer_attention = attention_matmuls(seq, d) / (1 if full_causal_square else 2)  # causal: half
    return {
        "dense": seq * n_layer * per_layer_dense,
        "attention": seq * n_layer * per_layer_attention,
        "lm_head": seq * dense(d, vocab),
    }


FAMILY = Family(
    name="gpt2",
    config_class=GPT2Config,
    model_class=GPT2LMHeadModel,
    hf_auto_class="AutoModelForCausalLM",
    table=TABLE,
    objective_class=CausalLM,
    tokenizer=TokenizerSpec(
        kind="bpe",
        specials={"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>", "pad": None, "mask": None},
        trained_order=("<|endoftext|>",),
        hf_class="GPT2TokenizerFast",
    ),
    default_preset="gpt2",
    quickstart=dict(
        config_name="gpt2-tiny",
        block_size=128,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        weight_decay=0.01,
        adam_beta2=0.98,
        max_steps=400,
        sample_prompts="def main(|import os",
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_single_stack,
    generation=Generation.DECODER_ONLY,
    check_hf_config=check_hf_config,
)
