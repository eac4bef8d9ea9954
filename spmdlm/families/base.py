"""What a model family is: everything the launcher, loop, export, FLOPs, generation and benchmarks need to know about
one model, declared in one `Family` object.

A family is one `Family` (named FAMILY) in one file of this package, or in any installed package that registers it
under the `spmdlm.families` entry-point group (see spmdlm/families/__init__.py). Nothing outside the family files
and the models names a family; see docs/architecture.md ("Adding a model").
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdlm.data.objectives import DECODER_SEGMENT_FIELDS, SEGMENT_FIELDS, Flag, Objective
from spmdlm.data.tokenization import TokenizerSpec
from spmdlm.errors import ArgumentError
from spmdlm.models.attention import set_attention
from spmdlm.models.hf_config import HFConfig
from spmdlm.models.kv_cache import Cache
from spmdlm.models.seq2seq import Packing

# -- transformers rename tables ------------------------------------------------------------------------------------
# A layout change is (ours -> HF, HF -> ours given our per-layer shape).
Layout = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, tuple], np.ndarray]]
SAME: Layout = (lambda x: x, lambda x, shape: x.reshape(shape))
FLAT_OUT: Layout = (lambda x: x.reshape(x.shape[0], -1), lambda x, shape: x.reshape(shape))  # (d, 3, h) <-> (d, 3h)
FLAT: Layout = (lambda x: x.reshape(-1), lambda x, shape: x.reshape(shape))  # (3, h) <-> (3h,)
LINEAR: Layout = (lambda x: np.ascontiguousarray(x.T), lambda x, shape: np.ascontiguousarray(x.T).reshape(shape))
ROW: Layout = (lambda x: x.reshape(1, -1), lambda x, shape: x.reshape(shape))  # (V,) <-> (1, V), BART's logits bias


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One HF tensor <-> one of our parameters; `layer` indexes the stacked (scanned) axis, None if unstacked."""

    hf: str
    ours: str
    layout: Layout
    layer: int | None


@dataclasses.dataclass(frozen=True)
class Table:
    """(HF name, our parameter path, layout) rules. A `{i}` field in the HF name runs over the layers of a stack:
    our parameter is then stacked (scanned layers) and the rule maps its slice i."""

    rules: tuple[tuple[str, str, Layout], ...]
    layer_counts: Callable[[Any], dict[str, int]]
    hf_prefix: str = ""  # the base model's prefix, absent in checkpoints saved from the bare base model
    ignore: tuple[str, ...] = ()  # regexes of HF tensors we do not need (tied copies, buffers)
    optional: tuple[str, ...] = ()  # regexes of HF tensors a checkpoint may lack (then zeros, as transformers does)
    # (regex of an HF tensor, what a checkpoint without it holds and what to do): the refusal says it, not "missing"
    absent_means: tuple[tuple[str, str], ...] = ()

    def expand(self, config) -> Iterator[TensorRule]:
        counts = self.layer_counts(config)
        for hf, ours, layout in self.rules:
            fields = set(re.findall(r"{(\w+)}", hf))
            if not fields:
                yield TensorRule(hf, ours, layout, None)
                continue
            (field,) = fields
            for index in range(counts[field]):
                yield TensorRule(hf.format(**{field: index}), ours, layout, index)


# RoBERTa and BART: byte-level BPE whose texts are framed <s> ... </s>, the same specials at the same ids (0-4). These
# are the defaults of a tokenizer spmdlm trains; a checkpoint's tokenizer says its own (spmdlm.data.special_tokens).
_FRAMED_SPECIALS = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
MASKED_LM_NEEDS = ("bos", "eos", "pad", "mask")  # framing, padding and masking; no unk (byte-level BPE needs none)
FRAMED_BPE_TOKENIZER = TokenizerSpec(
    kind="bpe",
    specials=_FRAMED_SPECIALS,
    trained_order=tuple(_FRAMED_SPECIALS.values()),
    frames_with_bos=True,
    required=MASKED_LM_NEEDS,
)


# -- lengths ---------------------------------------------------------------------------------------------------------
def check_framed_length(length: int, limit: int, positions: str) -> None:
    """--max_seq_length of an encoder that frames its input as <s> ... </s>, against the positions it has."""
    if length > limit:
        raise ArgumentError(
            f"--max_seq_length {length} is longer than the model's {positions}; lower "
            "--max_seq_length or use a config with more positions"
        )
    if length < 3:
        raise ArgumentError(f"--max_seq_length {length} leaves no room between <s> and </s>; raise it")


# -- what the shared train/eval step calls ----------------------------------------------------------------------------
Batch = dict[str, jax.Array]
Forward = Callable[..., jax.Array]  # (model, batch, rngs, *, features_only) -> logits, or the features the head reads


def packing_fields(batch: Batch, names: tuple[str, ...]) -> dict[str, jax.Array]:
    """The packed-row fields (segment ids, positions) a batch has: only packed or isolated batches carry them, and
    only models that take them are given them."""
    return {name: batch[name] for name in names if name in batch}


def forward_single_stack(model, batch: Batch, rngs: nnx.Rngs | None = None, *, features_only: bool = False):
    """Decoder-only and encoder-only models: `model(input_ids, attention_mask=..., segment_ids=..., positions=...)`."""
    return model(
        batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        rngs=rngs,
        features_only=features_only,
        **packing_fields(batch, SEGMENT_FIELDS),
    )


def forward_encoder_decoder(model, batch: Batch, rngs: nnx.Rngs | None = None, *, features_only: bool = False):
    """Encoder-decoders: the encoder's inputs and the decoder's (teacher-forced) inputs, and their segments."""
    return model(
        batch["input_ids"],
        batch["decoder_input_ids"],
        attention_mask=batch.get("attention_mask"),
        decoder_attention_mask=batch.get("decoder_attention_mask"),
        packing=Packing(**packing_fields(batch, SEGMENT_FIELDS + DECODER_SEGMENT_FIELDS)),
        rngs=rngs,
        features_only=features_only,
    )


# -- what generation calls --------------------------------------------------------------------------------------------
class Generation(enum.Enum):
    """What a family's model can be asked for at inference (spmdlm/generate), and through which protocol."""

    NONE = "none"  # training only
    DECODER_ONLY = "decoder_only"  # text continuation: DecoderOnlyGenerator
    ENCODER_DECODER = "encoder_decoder"  # text from an encoded input: EncoderDecoderGenerator
    FILL_MASK = "fill_mask"  # candidates for <mask> tokens: the plain forward pass


class DecoderOnlyGenerator(Protocol):
    """A decoder-only model that generates: a left-padded prompt, then one token at a time, through a KV cache."""

    def init_cache(self, batch: int, slots: int) -> Cache:
        """An empty cache of `slots` tokens for `batch` rows."""
        ...

    def extend(
        self, input_ids: jax.Array, cache: Cache, attention_mask: jax.Array | None = None
    ) -> tuple[jax.Array, Cache]:
        """The next tokens [B, T] (the prompt's mask the first time) -> logits [B, T, V] and the cache."""
        ...


class EncoderDecoderGenerator(Protocol):
    """An encoder-decoder that generates: the input encoded once, then decoder tokens through a KV cache."""

    def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array: ...

    def init_cache(self, encoded: jax.Array, attention_mask: jax.Array, slots: int) -> Cache:
        """An empty decoder cache of `slots` tokens holding the cross-attention keys and values of `encoded`."""
        ...

    def extend(self, decoder_input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """The next decoder tokens [B, T] -> logits [B, T, V] and the cache."""
        ...


# -- the family ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # = the HF model_type
    config_class: type  # a frozen dataclass with HF config names (spmdlm.models.hf_config.HFConfig)
    model_class: type  # the NNX module: (config, *, rngs, dtype, remat, scan_unroll)
    hf_auto_class: str  # the transformers Auto class that loads the export (named in docs and the model card)
    table: Table  # the rename table onto the transformers model (export and --model_name_or_path)
    tokenizer: TokenizerSpec  # the tokenizer it trains (kind) and the special tokens it needs
    objective_class: type[Objective]  # its objective: the flags (FLAGS) the launcher and prepare take for it
    default_preset: str  # --config_name when none is given with --train_file
    quickstart: dict[str, Any]  # flags of the embedded quick start (python -m spmdlm.launch --model_type NAME)
    # (objective flags by name, config): before any data is read; raises ArgumentError
    check_lengths: Callable[[Mapping[str, Any], HFConfig], None]
    build_objective: Callable[[Mapping[str, Any], HFConfig, Any], Objective]  # (objective flags, config, tokenizer)
    forward_flops: Callable[..., dict[str, float]]  # (config, sequence lengths, full_causal_square) -> by part
    forward: Forward  # how the shared train and eval step call the model on a batch
    generation: Generation  # what spmdlm.generate may ask of the model
    check_hf_config: Callable[[dict], None] = lambda values: None  # refuses HF configs we cannot reproduce
    # Other model types released with this architecture (e.g. xlm-roberta): model_type -> its transformers class.
    # Their checkpoints load as they ship, and the export keeps their own model_type and class.
    released_as: dict[str, str] = dataclasses.field(default_factory=dict)
    # Released model types close to this one that it cannot reproduce: model_type -> why (a one-line refusal)
    refused_types: dict[str, str] = dataclasses.field(default_factory=dict)
    presets: dict[str, dict] = dataclasses.field(default_factory=dict)  # its own --config_name presets, by name

    @property
    def flags(self) -> tuple[Flag, ...]:
        """The objective flags that apply; the first sets the example length."""
        return self.objective_class.FLAGS

    @property
    def resume_keys(self) -> tuple[str, ...]:
        """Objective flags that must match to resume."""
        return tuple(flag.name for flag in self.flags if flag.resume)

    @property
    def is_encoder_decoder(self) -> bool:
        return getattr(self.config_class, "is_encoder_decoder", False)

    def make_model(
        self,
        config,
        *,
        rngs,
        dtype=jnp.float32,
        remat: str = "dots",
        scan_unroll: int | bool = 1,
        attention: str = "xla",
    ):
        """The model; `attention` chooses how its shared attention layers compute (attention.set_attention)."""
        model = self.model_class(config, rngs=rngs, dtype=dtype, remat=remat, scan_unroll=scan_unroll)
        return set_attention(model, attention)

    def train_flops_per_step(
        self, config, objective: Objective, global_batch: int, *, full_causal_square: bool = False
    ) -> float:
        """Model FLOPs of one optimizer step over a global batch: 3 x forward matmul FLOPs (remat excluded; the
        conventions are in spmdlm/flops.py). `full_causal_square` also counts the masked half of causal attention,
        which a dense implementation computes (for cross-checks against what XLA runs; MFU uses the default)."""
        parts = self.forward_flops(config, objective.sequence_lengths(), full_causal_square=full_causal_square)
        return 3.0 * global_batch * sum(parts.values())
