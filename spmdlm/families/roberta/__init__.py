"""The RoBERTa family: masked LM (80/10/10) on `<s> … </s>` blocks or lines, transformers' `RobertaForMaskedLM`."""

from __future__ import annotations

import dataclasses

from spmdlm.data.objectives import DOCUMENT_ATTENTION, MAX_SEQ_LENGTH, MLM_PROBABILITY
from spmdlm.data.objectives.mlm import LINE_BY_LINE, PACKING, MaskedLM, layout_problem
from spmdlm.data.tokenization import all_special_ids, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.base import (
    FRAMED_BPE_TOKENIZER,
    Family,
    Generation,
    check_framed_length,
    forward_single_stack,
)
from spmdlm.families.roberta.hf import TABLE, check_hf_config
from spmdlm.families.roberta.model import RobertaConfig, RobertaForMaskedLM
from spmdlm.flops import attention_matmuls, dense


def max_seq_length(flags, config) -> int:
    # The HF script crashed on None; its default is the tokenizer's maximum, i.e. the positions minus the offset.
    return MAX_SEQ_LENGTH.of(flags) or min(512, config.max_length)


def check_lengths(flags, config) -> None:
    check_framed_length(
        max_seq_length(flags, config),
        config.max_length,
        f"{config.max_length} positions (max_position_embeddings {config.max_position_embeddings} "
        "minus RoBERTa's padding offset)",
    )
    check_layout(flags)


def check_layout(flags) -> None:
    """The MLM record layout flags, before any data is read (build_objective checks the same again)."""
    if problem := layout_problem(LINE_BY_LINE.of(flags), PACKING.of(flags), DOCUMENT_ATTENTION.of(flags)):
        raise ArgumentError(problem)


def build_objective(flags, config, tokenizer):
    return masked_lm(flags, tokenizer, FAMILY.tokenizer, max_seq_length(flags, config), mlm_probability=0.15)


def masked_lm(flags, tokenizer, spec, length: int, *, mlm_probability: float) -> MaskedLM:
    """The MLM objective of a framed encoder (`spec`: its TokenizerSpec) at `length` tokens; `mlm_probability` is
    the family's default masking rate, which --mlm_probability overrides."""
    ids = special_token_ids(tokenizer, spec)  # one-line error if the mask token or another is missing
    try:
        return MaskedLM(
            length,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"],
            mask_id=ids["mask"],
            special_ids=all_special_ids(tokenizer, spec),
            vocab_size=tokenizer.get_vocab_size(),
            mlm_probability=MLM_PROBABILITY.of(flags) or mlm_probability,
            line_by_line=LINE_BY_LINE.of(flags),
            packing=PACKING.of(flags),
            document_attention=DOCUMENT_ATTENTION.of(flags),
        )
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part: bidirectional attention, the MLM head's dense and decoder."""
    seq, d, ff = lengths["input"], config.hidden_size, config.intermediate_size
    per_layer_dense = 4 * dense(d, d) + dense(d, ff) + dense(ff, d)
    return {
        "dense": seq * config.num_hidden_layers * per_layer_dense,
        "attention": seq * config.num_hidden_layers * attention_matmuls(seq, d),
        "lm_head": seq * (dense(d, d) + dense(d, config.vocab_size)),
    }


FAMILY = Family(
    name="roberta",
    config_class=RobertaConfig,
    model_class=RobertaForMaskedLM,
    hf_auto_class="AutoModelForMaskedLM",
    table=TABLE,
    tokenizer=dataclasses.replace(FRAMED_BPE_TOKENIZER, hf_class="RobertaTokenizerFast"),
    objective_class=MaskedLM,
    default_preset="roberta-base",
    quickstart=dict(
        config_name="roberta-tiny",
        max_seq_length=128,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        adam_beta2=0.98,
        max_steps=400,
        sample_prompts="import<mask>|def<mask>(self):",
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_single_stack,
    generation=Generation.FILL_MASK,
    check_hf_config=check_hf_config,
    released_as={"xlm-roberta": "XLMRobertaForMaskedLM", "camembert": "CamembertForMaskedLM"},
)
