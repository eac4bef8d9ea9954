"""The T5 v1.1 family: span corruption with sentinels, Adafactor in the quick start, `T5ForConditionalGeneration`."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION, MAX_SEQ_LENGTH, MLM_PROBABILITY
from spmdlm.data.tokenization import TokenizerSpec, sentinel_ids, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.base import Family, Generation, forward_encoder_decoder
from spmdlm.families.t5.hf import TABLE, check_hf_config
from spmdlm.families.t5.model import T5Config, T5ForConditionalGeneration
from spmdlm.families.t5.objective import MEAN_NOISE_SPAN_LENGTH, SpanCorruption
from spmdlm.flops import attention_matmuls, dense

NUM_SENTINELS = 100
DEFAULT_LENGTH = 512  # relative positions have no model maximum: the T5 recipes' length


def _span_corruption(flags, sentinels, eos_id: int, decoder_start_id: int):
    try:
        return SpanCorruption(
            inputs_length=MAX_SEQ_LENGTH.of(flags) or DEFAULT_LENGTH,
            sentinel_ids=tuple(int(s) for s in sentinels),
            eos_id=eos_id,
            noise_density=MLM_PROBABILITY.of(flags) or 0.15,
            mean_noise_span_length=MEAN_NOISE_SPAN_LENGTH.of(flags),
            decoder_start_id=decoder_start_id,
            document_attention=DOCUMENT_ATTENTION.of(flags),
        )
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def check_lengths(flags, config) -> None:
    # The lengths, and that the 100 sentinels cover every span, before any data is read (placeholder ids).
    _span_corruption(flags, range(NUM_SENTINELS), eos_id=1, decoder_start_id=0)


def build_objective(flags, config, tokenizer):
    return _span_corruption(
        flags,
        sentinel_ids(tokenizer),
        special_token_ids(tokenizer, FAMILY.tokenizer)["eos"],
        config.decoder_start_token_id,
    )


def forward_flops(config, lengths: dict[str, int], full_causal_square: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs of one example by part.

    Encoder: bidirectional self-attention and FFN per encoder token. Decoder: causal self-attention, cross-attention
    (q and o per decoder token; k and v project the encoder output once per decoder layer, i.e. per encoder token;
    scores/values over all encoder tokens) and FFN per decoder token; the LM head per decoder token.
    """
    encoder_len, decoder_len = lengths["input"], lengths["decoder"]
    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    inner = config.num_heads * config.d_kv
    n_enc = config.num_layers
    n_dec = getattr(config, "num_decoder_layers", None) or n_enc
    ffn = 3 * dense(d, ff)  # gated: wi_0, wi_1 (d→ff) and wo (ff→d)
    qkvo = 3 * dense(d, inner) + dense(inner, d)
    encoder = encoder_len * n_enc * (qkvo + attention_matmuls(encoder_len, inner) + ffn)
    causal = 1 if full_causal_square else 2
    decoder_self = decoder_len * n_dec * (qkvo + attention_matmuls(decoder_len, inner) / causal)
    cross = n_dec * (
        decoder_len * (dense(d, inner) + dense(inner, d) + attention_matmuls(encoder_len, inner))
        + encoder_len * 2 * dense(d, inner)
    )
    return {
        "encoder": encoder,
        "decoder_self_attention": decoder_self,
        "cross_attention": cross,
        "decoder_ffn": decoder_len * n_dec * ffn,
        "lm_head": decoder_len * dense(d, vocab),
    }


FAMILY = Family(
    name="t5",
    config_class=T5Config,
    model_class=T5ForConditionalGeneration,
    hf_auto_class="AutoModelForSeq2SeqLM",
    table=TABLE,
    objective_class=SpanCorruption,
    tokenizer=TokenizerSpec(
        kind="unigram",
        specials={"pad": "<pad>", "eos": "</s>", "unk": "<unk>", "bos": None, "mask": None},
        trained_order=("<pad>", "</s>", "<unk>"),
        num_sentinels=NUM_SENTINELS,
    ),
    default_preset="t5-v1_1-base",
    quickstart=dict(
        config_name="t5-v1_1-tiny",
        max_seq_length=128,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        adafactor=True,
        weight_decay=0.001,
        max_steps=300,
        sample_prompts="def <extra_id_0>(self):|import <extra_id_0>",
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_encoder_decoder,
    generation=Generation.ENCODER_DECODER,
    check_hf_config=check_hf_config,
    released_as={"mt5": "MT5ForConditionalGeneration"},  # T5 v1.1 on a multilingual vocabulary
    refused_types={
        "umt5": "UMT5 gives every layer its own relative position bias, where T5 (and spmdlm's T5) has one per stack "
        "in its first layer; spmdlm cannot reproduce it (T5 v1.1 and mT5 checkpoints load)"
    },
)
