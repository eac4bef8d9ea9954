"""The BART family: denoising (sentence permutation + text infilling), transformers' `BartForConditionalGeneration`."""

from __future__ import annotations

import dataclasses

from spmdlm.data.objectives import DOCUMENT_ATTENTION, MAX_SEQ_LENGTH, MLM_PROBABILITY
from spmdlm.data.tokenization import all_special_ids, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.bart.hf import TABLE, check_hf_config
from spmdlm.families.bart.model import BartConfig, BartForConditionalGeneration
from spmdlm.families.bart.objective import MASK_RATIO, PERMUTE_SENTENCE_RATIO, POISSON_LAMBDA, Denoising
from spmdlm.families.base import (
    FRAMED_BPE_TOKENIZER,
    Family,
    Generation,
    check_framed_length,
    forward_encoder_decoder,
)
from spmdlm.flops import attention_matmuls, dense


def max_seq_length(flags, config) -> int:
    return MAX_SEQ_LENGTH.of(flags) or min(1024, config.max_position_embeddings)


def mask_ratio(flags) -> float:
    # --mlm_probability is the HF script's name for it; both given and different is a mistake.
    given, mlm_probability = MASK_RATIO.of(flags), MLM_PROBABILITY.of(flags)
    if given is not None and mlm_probability is not None and given != mlm_probability:
        raise ArgumentError(
            f"--mask_ratio {given} and --mlm_probability {mlm_probability} disagree; "
            "for BART they are the same setting: give one"
        )
    return next((r for r in (given, mlm_probability) if r is not None), 0.3)


def check_lengths(flags, config) -> None:
    check_framed_length(
        max_seq_length(flags, config),
        config.max_position_embeddings,
        f"max_position_embeddings {config.max_position_embeddings}",
    )
    mask_ratio(flags)


def build_objective(flags, config, tokenizer):
    ids = special_token_ids(tokenizer, FAMILY.tokenizer)  # one-line error if <mask> or another is missing
    try:
        return Denoising(
            max_seq_length(flags, config),
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"],
            mask_id=ids["mask"],
            decoder_start_id=config.decoder_start_token_id,
            special_ids=all_special_ids(tokenizer, FAMILY.tokenizer),
            permute_sentence_ratio=PERMUTE_SENTENCE_RATIO.of(flags),
            mask_ratio=mask_ratio(flags),
            poisson_lambda=POISSON_LAMBDA.of(flags),
            document_attention=DOCUMENT_ATTENTION.of(flags),
        )
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part.

    Encoder: bidirectional self-attention and FFN per encoder token. Decoder: causal self-attention, cross-attention
    (q and out per decoder token; k and v project the encoder output once per decoder layer, i.e. per encoder token;
    scores/values over all encoder tokens) and FFN per decoder token; the tied LM head per decoder token.
    """
    encoder_len, decoder_len = lengths["input"], lengths["decoder"]
    d, n_enc, n_dec = config.d_model, config.encoder_layers, config.decoder_layers
    qkvo = 4 * dense(d, d)
    ffn = lambda ff: dense(d, ff) + dense(ff, d)
    encoder = encoder_len * n_enc * (qkvo + attention_matmuls(encoder_len, d) + ffn(config.encoder_ffn_dim))
    causal = 1 if full_causal_square else 2
    decoder_self = decoder_len * n_dec * (qkvo + attention_matmuls(decoder_len, d) / causal)
    cross = n_dec * (
        decoder_len * (2 * dense(d, d) + attention_matmuls(encoder_len, d)) + encoder_len * 2 * dense(d, d)
    )
    return {
        "encoder": encoder,
        "decoder_self_attention": decoder_self,
        "cross_attention": cross,
        "decoder_ffn": decoder_len * n_dec * ffn(config.decoder_ffn_dim),
        "lm_head": decoder_len * dense(d, config.vocab_size),
    }


FAMILY = Family(
    name="bart",
    config_class=BartConfig,
    model_class=BartForConditionalGeneration,
    hf_auto_class="AutoModelForSeq2SeqLM",
    table=TABLE,
    tokenizer=dataclasses.replace(FRAMED_BPE_TOKENIZER, hf_class="BartTokenizerFast"),
    objective_class=Denoising,
    default_preset="bart-base",
    quickstart=dict(
        config_name="bart-tiny",
        max_seq_length=128,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.01,
        adam_beta2=0.98,
        max_steps=400,
        sample_prompts="def<mask>(self):|import<mask>",
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_encoder_decoder,
    generation=Generation.ENCODER_DECODER,
    check_hf_config=check_hf_config,
)
