"""Per-family fixtures for tests/test_families.py: adding a model family adds an entry here, not test code.

Each entry gives random transformers models of odd shapes (built offline), a batch for them, and the launcher flags
of a short run on a small corpus. Batches use the keyword names that both transformers' and our models take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transformers
from conftest import STDLIB_JSON  # noqa: F401  (defined in conftest.py; still importable from here)

# The families whose model code a generic path (the engine's sharding, the chunked loss, evaluation, generation
# with the cache) can meet in a way no other family's does. Llama is left out there: Qwen3 is the Llama network
# with options on (QK-norm, sliding-window layers; spmdlm/families/qwen3), so Qwen3's tiny config runs every line
# of Llama's model and more. Llama keeps its own parity, learning, resume, export and golden-sharding tests.
ENGINE_FAMILIES = ("gpt2", "roberta", "t5", "bart", "modernbert", "qwen3")
# The attention implementations (xla einsums, dot_product, splash) are one shared call given q, k, v and a mask;
# what differs by family is the mask and the bias. These four make every mask a family builds: causal with padding,
# GQA and sliding windows (Qwen3), bidirectional with local windows and padding (ModernBERT), cross-attention with
# a causal decoder and a padded bidirectional encoder (BART: GPT-2's and RoBERTa's masks), and T5's
# relative-position bias (its self-attention keeps the einsums under splash).
ATTENTION_FAMILIES = ("qwen3", "modernbert", "bart", "t5")


@dataclasses.dataclass(frozen=True)
class FamilyFixture:
    hf_model_class: type  # the transformers model class
    hf_config_class: type
    configs: dict[str, dict[str, Any]]  # odd HF configs by name
    make_batch: Callable[..., dict[str, np.ndarray]]  # (HF config kwargs, rng, length=...) -> batch
    output_mask: str  # the batch key whose zeros mark logits nobody reads (padded query positions)
    tiny_config: dict[str, Any]  # a model small enough for runs of a few steps (our config names)
    run_flags: tuple[str, ...]  # launcher flags of a short run (lengths, optimizer) besides mesh/steps/output
    prepare_hf: Callable[[Any], None] = lambda model: None  # fix-ups after init (e.g. T5's untied head)


def _padded(ids: np.ndarray, pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A mask with right padding in row 1 and left padding in row 2; pad ids written where the model needs them."""
    mask = np.ones(ids.shape, dtype=np.int64)
    mask[1, ids.shape[1] * 2 // 3 :] = 0
    mask[2, : ids.shape[1] // 4] = 0
    if pad_id is not None:
        ids = np.where(mask == 1, ids, pad_id)
    return ids, mask


def _gpt2_batch(config: dict, rng: np.random.Generator, length: int = 20) -> dict[str, np.ndarray]:
    ids, mask = _padded(rng.integers(0, config["vocab_size"], (4, length)))
    return {"input_ids": ids, "attention_mask": mask}


def _roberta_batch(config: dict, rng: np.random.Generator, length: int = 20) -> dict[str, np.ndarray]:
    # RoBERTa derives positions from the pad id, so padding must be real pad tokens (right padding only, as
    # tokenizers produce); token types exercised when the config has several.
    ids = rng.integers(3, config["vocab_size"], (4, length))
    mask = np.ones(ids.shape, dtype=np.int64)
    mask[1, length * 2 // 3 :] = 0
    mask[3, length // 4 :] = 0
    ids = np.where(mask == 1, ids, 1)
    types = rng.integers(0, config.get("type_vocab_size", 2), ids.shape)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _seq2seq_batch(config: dict, rng: np.random.Generator, length: int | None = None) -> dict[str, np.ndarray]:
    """Encoder and decoder `length` tokens long (default 23 and 11)."""
    vocab = config["vocab_size"]
    ids, mask = _padded(rng.integers(3, vocab, (4, length or 23)))
    dec, dec_mask = _padded(rng.integers(3, vocab, (4, length or 11)))
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec, "decoder_attention_mask": dec_mask}


def _modernbert_batch(config: dict, rng: np.random.Generator, length: int = 20) -> dict[str, np.ndarray]:
    """Padding on both sides, written as the pad id (transformers counts positions from 0 in every row)."""
    ids, mask = _padded(rng.integers(3, config["vocab_size"], (4, length)), config.get("pad_token_id", 0))
    return {"input_ids": ids, "attention_mask": mask}


def _modernbert_config(**kwargs):
    """Special ids inside the small vocabularies; eager attention (transformers' flash kernels need a GPU)."""
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    config = transformers.ModernBertConfig(**{**ids, **kwargs})
    config._attn_implementation = "eager"
    return config


def _untie_t5_head(model) -> None:
    """A random HF T5 is tied unless it gets its own lm_head; v1.1 norms are non-trivial gains."""
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * model.config.d_model**-0.5)


def _perturb_bart_logits_bias(model) -> None:
    """final_logits_bias is a buffer, not a parameter: give it values so a dropped or misplaced bias shows."""
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)


FIXTURES: dict[str, FamilyFixture] = {
    "gpt2": FamilyFixture(
        hf_model_class=transformers.GPT2LMHeadModel,
        hf_config_class=transformers.GPT2Config,
        configs={
            "odd-heads": dict(vocab_size=101, n_positions=40, n_embd=48, n_layer=2, n_head=3, layer_norm_epsilon=1e-6),
            "vocab-not-8": dict(vocab_size=257, n_positions=64, n_embd=40, n_layer=3, n_head=5, n_inner=72),
            "exact-gelu": dict(
                vocab_size=128,
                n_positions=128,
                n_embd=32,
                n_layer=1,
                n_head=2,
                layer_norm_epsilon=1e-4,
                activation_function="gelu",
            ),
        },
        make_batch=_gpt2_batch,
        output_mask="attention_mask",
        tiny_config=dict(
            model_type="gpt2",
            vocab_size=512,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        run_flags=("--block_size", "32", "--learning_rate", "3e-3"),
    ),
    "roberta": FamilyFixture(
        hf_model_class=transformers.RobertaForMaskedLM,
        hf_config_class=transformers.RobertaConfig,
        configs={
            "odd-heads": dict(
                vocab_size=103,
                hidden_size=36,
                num_hidden_layers=3,
                num_attention_heads=3,
                intermediate_size=50,
                max_position_embeddings=40,
                type_vocab_size=2,
            ),
            "vocab-not-8": dict(
                vocab_size=259,
                hidden_size=40,
                num_hidden_layers=2,
                num_attention_heads=5,
                intermediate_size=64,
                max_position_embeddings=30,
                layer_norm_eps=1e-12,
            ),
            "long-positions": dict(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=48,
                max_position_embeddings=130,
                layer_norm_eps=1e-5,
            ),
        },
        make_batch=_roberta_batch,
        output_mask="attention_mask",
        tiny_config=dict(
            model_type="roberta",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=66,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
        ),
        run_flags=("--max_seq_length", "32", "--learning_rate", "3e-3"),
    ),
    "t5": FamilyFixture(
        hf_model_class=transformers.T5ForConditionalGeneration,
        hf_config_class=lambda **kw: transformers.T5Config(
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, **kw
        ),
        configs={
            "odd-heads": dict(
                vocab_size=103,
                d_model=36,
                d_kv=12,
                d_ff=40,
                num_layers=2,
                num_decoder_layers=3,
                num_heads=3,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=20,
            ),
            "base-buckets": dict(
                vocab_size=212,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=3,
                num_decoder_layers=1,
                num_heads=4,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
            ),
        },
        make_batch=_seq2seq_batch,
        output_mask="decoder_attention_mask",
        tiny_config=dict(
            model_type="t5",
            vocab_size=512,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
        ),
        run_flags=("--max_seq_length", "32", "--adafactor", "--learning_rate", "1e-2", "--weight_decay", "0.001"),
        prepare_hf=_untie_t5_head,
    ),
    "bart": FamilyFixture(
        hf_model_class=transformers.BartForConditionalGeneration,
        hf_config_class=transformers.BartConfig,
        configs={
            "odd-heads": dict(
                vocab_size=103,
                d_model=60,
                encoder_layers=3,
                decoder_layers=2,
                encoder_attention_heads=5,
                decoder_attention_heads=3,
                encoder_ffn_dim=72,
                decoder_ffn_dim=88,
                max_position_embeddings=40,
            ),
            "scaled-embedding": dict(
                vocab_size=259,
                d_model=48,
                encoder_layers=1,
                decoder_layers=3,
                encoder_attention_heads=6,
                decoder_attention_heads=4,
                encoder_ffn_dim=100,
                decoder_ffn_dim=52,
                max_position_embeddings=33,
                scale_embedding=True,
            ),
            "relu": dict(
                vocab_size=64,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=2,
                decoder_attention_heads=4,
                encoder_ffn_dim=48,
                decoder_ffn_dim=40,
                max_position_embeddings=24,
                activation_function="relu",
                scale_embedding=True,
            ),
        },
        make_batch=_seq2seq_batch,
        output_mask="decoder_attention_mask",
        tiny_config=dict(
            model_type="bart",
            vocab_size=512,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
        ),
        run_flags=("--max_seq_length", "32", "--learning_rate", "3e-3"),
        prepare_hf=_perturb_bart_logits_bias,
    ),
    "modernbert": FamilyFixture(
        hf_model_class=transformers.ModernBertForMaskedLM,
        hf_config_class=_modernbert_config,
        configs={
            # 20 tokens, windows of 8 and 6: local layers see part of the row; global ones every 3 and 2 layers
            "local-global": dict(
                vocab_size=101,
                hidden_size=48,
                intermediate_size=40,
                num_hidden_layers=5,
                num_attention_heads=3,
                global_attn_every_n_layers=3,
                local_attention=8,
                global_rope_theta=1000.0,
                local_rope_theta=50.0,
            ),
            "biases": dict(
                vocab_size=67,
                hidden_size=32,
                intermediate_size=56,
                num_hidden_layers=4,
                num_attention_heads=2,
                global_attn_every_n_layers=2,
                local_attention=6,
                norm_bias=True,
                attention_bias=True,
                mlp_bias=True,
                classifier_bias=True,
                hidden_activation="gelu_pytorch_tanh",
                classifier_activation="silu",
                norm_eps=1e-6,
            ),
            "global-no-decoder-bias": dict(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                global_attn_every_n_layers=1,
                decoder_bias=False,
            ),
        },
        make_batch=_modernbert_batch,
        output_mask="attention_mask",
        tiny_config=dict(
            model_type="modernbert",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            global_attn_every_n_layers=3,
            local_attention=16,
            max_position_embeddings=128,
            pad_token_id=3,
            bos_token_id=1,
            eos_token_id=2,
        ),
        run_flags=("--max_seq_length", "32", "--learning_rate", "3e-3"),
    ),
    "llama": FamilyFixture(
        hf_model_class=transformers.LlamaForCausalLM,
        hf_config_class=transformers.LlamaConfig,
        configs={
            "gqa-llama3-biases": dict(
                vocab_size=101,
                hidden_size=48,
                intermediate_size=72,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=64,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=16,
                ),
            ),
            "tied-mha": dict(
                vocab_size=257,
                hidden_size=40,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=5,
                max_position_embeddings=32,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
            ),
        },
        make_batch=_gpt2_batch,
        output_mask="attention_mask",
        tiny_config=dict(
            model_type="llama",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        run_flags=("--block_size", "32", "--learning_rate", "3e-3"),
    ),
    "qwen3": FamilyFixture(
        hf_model_class=transformers.Qwen3ForCausalLM,
        hf_config_class=transformers.Qwen3Config,
        configs={
            "window-gqa": dict(
                vocab_size=103,
                hidden_size=40,
                intermediate_size=56,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=12,
                max_position_embeddings=64,
                use_sliding_window=True,
                sliding_window=6,
                max_window_layers=1,
                rope_theta=1000.0,
            ),
            "tied-biases": dict(
                vocab_size=128,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=24,
                max_position_embeddings=40,
                attention_bias=True,
                tie_word_embeddings=True,
            ),
        },
        make_batch=_gpt2_batch,
        output_mask="attention_mask",
        tiny_config=dict(
            model_type="qwen3",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        run_flags=("--block_size", "32", "--learning_rate", "3e-3"),
    ),
}
