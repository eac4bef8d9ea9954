"""The T5 v1.1 family: span corruption with sentinels, Adafactor in the quick start, `T5ForConditionalGeneration`."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION, MAX_SEQ_LENGTH, MLM_PROBABILITY
from spmdlm.data.objectives.t5 import MEAN_NOISE_SPAN_LENGTH, SpanCorruption
from spmdlm.data.tokenization import TokenizerSpec, sentinel_ids, special_token_ids
from spmdlm.errors import ArgumentError, ConfigError
from spmdlm.families.base import LINEAR, SAME, Family, Generation, Table, forward_encoder_decoder
from spmdlm.flops import attention_matmuls, dense
from spmdlm.models.t5 import T5Config, T5ForConditionalGeneration, dense_activation, hf_scales_decoder_outputs

NUM_SENTINELS = 100
DEFAULT_LENGTH = 512  # relative positions have no model maximum: the T5 recipes' length


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
        # to True whatever config.json says (there it only decides the output scaling), so loading any v1.1 checkpoint,
        # its own save_pretrained output included, warns that it will not tie the two; it then loads them untied.
        ("lm_head.weight", "lm_head.kernel", LINEAR),
    ),
    layer_counts=lambda c: {"i": c.num_layers, "j": c.num_decoder_layers},
    ignore=(
        r"^(encoder|decoder)\.embed_tokens\.weight$",  # tied copies of shared
        r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
    ),  # unused by HF too
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
)
