"""The Llama family: causal LM on blocks of `--block_size` tokens, transformers' `LlamaForCausalLM` (RMSNorm, RoPE,
SwiGLU, grouped-query attention). Qwen3 (`spmdlm/families/qwen3`) is this family with QK-norm and sliding-window
layers. docs/llama.md says where we follow transformers and where not."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.objectives.clm import BLOCK_SIZE, CausalLM
from spmdlm.data.tokenization import TokenizerSpec, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.base import Family, Generation, forward_single_stack
from spmdlm.families.llama.hf import TABLE, check_hf_config
from spmdlm.families.llama.model import LlamaConfig, LlamaForCausalLM
from spmdlm.flops import attention_matmuls, dense

# SmolLM's tokenizer.json: byte-level BPE whose first ids are these specials; <|endoftext|> is BOS, EOS and UNK. That
# is the tokenizer spmdlm trains; a checkpoint's says its own (Llama 3's <|begin_of_text|>/<|end_of_text|>, Llama 2's
# <s>/</s>/<unk>, an instruct Qwen3's EOS <|im_end|> and no BOS: spmdlm.data.special_tokens). The objective needs
# only an EOS, which separates documents.
BYTE_BPE_TOKENIZER = TokenizerSpec(
    kind="bpe",
    specials={"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>", "pad": None, "mask": None},
    trained_order=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    required=("eos",),
)


def block_size(flags, config) -> int:
    return BLOCK_SIZE.of(flags) or min(1024, config.max_position_embeddings)


def check_lengths(flags, config) -> None:
    if block_size(flags, config) > config.max_position_embeddings:
        raise ArgumentError(
            f"--block_size {block_size(flags, config)} is longer than the model's max_position_embeddings "
            f"{config.max_position_embeddings}; lower --block_size or use a config with more positions"
        )


def build_objective(flags, config, tokenizer):
    return CausalLM(
        block_size(flags, config),
        eos_id=special_token_ids(tokenizer, BYTE_BPE_TOKENIZER)["eos"],
        document_attention=DOCUMENT_ATTENTION.of(flags),
    )


def keys_per_query(seq: int, window: int | None, full_causal_square: bool) -> float:
    """The keys one query attends to on average: all `seq` where the full square is computed, else half (causal),
    or the mean of min(t + 1, window) over a sliding window shorter than the sequence."""
    if full_causal_square:
        return seq
    if window is None or window >= seq:
        return seq / 2
    return sum(min(t + 1, window) for t in range(seq)) / seq


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part (see spmdlm/flops.py for the conventions)."""
    seq, d, ff = lengths["input"], config.hidden_size, config.intermediate_size
    inner, kv_inner = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer_dense = dense(d, inner) + 2 * dense(d, kv_inner) + dense(inner, d) + 3 * dense(d, ff)
    attention = sum(
        attention_matmuls(keys_per_query(seq, config.window(kind), full_causal_square), inner)
        for kind in config.layer_kinds()
    )
    return {
        "dense": seq * config.num_hidden_layers * per_layer_dense,
        "attention": seq * attention,
        "lm_head": seq * dense(d, config.vocab_size),
    }


FAMILY = Family(
    name="llama",
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    hf_auto_class="AutoModelForCausalLM",
    table=TABLE,
    objective_class=CausalLM,
    tokenizer=BYTE_BPE_TOKENIZER,
    default_preset="llama-tiny",
    quickstart=dict(
        config_name="llama-tiny",
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
