"""The GPT-2 family: causal LM on blocks of `--block_size` tokens, transformers' `GPT2LMHeadModel`."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.objectives.clm import BLOCK_SIZE, CausalLM
from spmdlm.data.tokenization import TokenizerSpec, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.base import Family, Generation, forward_single_stack
from spmdlm.families.gpt2.hf import TABLE, check_hf_config
from spmdlm.families.gpt2.model import GPT2Config, GPT2LMHeadModel
from spmdlm.flops import attention_matmuls, dense


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
        required=("eos",),  # the document separator; a checkpoint's tokenizer names its own (special_tokens)
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
