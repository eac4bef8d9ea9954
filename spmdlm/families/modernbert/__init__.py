"""The ModernBERT family: masked LM on `[CLS] … [SEP]` blocks or lines at a 30% masking rate (the recipe's), as
transformers' `ModernBertForMaskedLM` (model.py: config and network; hf.py: the rename table and the refusals;
presets/: its --config_name presets). docs/modernbert.md says where we follow transformers and where not.
"""

from __future__ import annotations

from spmdlm.data.objectives import MAX_SEQ_LENGTH
from spmdlm.data.objectives.mlm import MaskedLM
from spmdlm.data.tokenization import TokenizerSpec
from spmdlm.families.base import MASKED_LM_NEEDS, Family, Generation, check_framed_length, forward_single_stack
from spmdlm.families.modernbert.hf import TABLE, check_hf_config
from spmdlm.families.modernbert.model import ModernBertConfig, ModernBertForMaskedLM
from spmdlm.families.roberta import check_layout, masked_lm
from spmdlm.flops import attention_matmuls, dense

MLM_PROBABILITY = 0.3  # ModernBERT's pretraining masked 30% of the tokens (--mlm_probability overrides it)
DEFAULT_LENGTH = 1024  # the length of its main pretraining phase, where the config's positions allow

# The released tokenizer (a BPE over bytes, OLMo's vocabulary) keeps these five after its 50280 pieces, in this
# order; a tokenizer we train puts them first (ids 0-4), so the tiny preset's special ids are 1-3. A checkpoint's
# tokenizer says its own (its cls/sep frame the texts, e.g. <s> ... </s>: spmdlm.data.special_tokens).
TOKENIZER = TokenizerSpec(
    kind="bpe",
    specials={"bos": "[CLS]", "eos": "[SEP]", "unk": "[UNK]", "pad": "[PAD]", "mask": "[MASK]"},
    trained_order=("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"),
    frames_with_bos=True,
    required=MASKED_LM_NEEDS,
)


def max_seq_length(flags, config) -> int:
    return MAX_SEQ_LENGTH.of(flags) or min(DEFAULT_LENGTH, config.max_length)


def check_lengths(flags, config) -> None:
    check_framed_length(
        max_seq_length(flags, config), config.max_length, f"max_position_embeddings {config.max_length}"
    )
    check_layout(flags)


def build_objective(flags, config, tokenizer) -> MaskedLM:
    return masked_lm(flags, tokenizer, TOKENIZER, max_seq_length(flags, config), mlm_probability=MLM_PROBABILITY)


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part. A sliding-window layer's useful keys are its window (at most
    local_attention + 1 of them); the einsums compute every key (`full_causal_square`, the name kept for all
    families: what a dense implementation multiplies)."""
    seq, d, ff = lengths["input"], config.hidden_size, config.intermediate_size
    sliding = sum(kind == "sliding_attention" for kind in config.layer_types)
    window = seq if full_causal_square else min(seq, config.local_attention // 2 * 2 + 1)
    keys = (config.num_hidden_layers - sliding) * seq + sliding * window
    return {
        "dense": seq * config.num_hidden_layers * (4 * dense(d, d) + dense(d, 2 * ff) + dense(ff, d)),
        "attention": seq * attention_matmuls(keys, d),
        "lm_head": seq * (dense(d, d) + dense(d, config.vocab_size)),
    }


FAMILY = Family(
    name="modernbert",
    config_class=ModernBertConfig,
    model_class=ModernBertForMaskedLM,
    hf_auto_class="AutoModelForMaskedLM",
    table=TABLE,
    tokenizer=TOKENIZER,
    objective_class=MaskedLM,
    default_preset="modernbert-base",
    quickstart=dict(
        config_name="modernbert-tiny",
        max_seq_length=128,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        adam_beta2=0.98,
        max_steps=400,
        sample_prompts="import[MASK]|def[MASK](self):",
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_single_stack,
    generation=Generation.FILL_MASK,
    check_hf_config=check_hf_config,
)
