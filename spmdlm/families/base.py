"""What a model family is: everything the launcher, loop, export, FLOPs and benchmarks need to know about one model.

A family (gpt2, t5, roberta, bart) is one `Family` object in one file of this package. Nothing outside those files
branches on `model_type`; see docs/architecture.md ("Adding a model").
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

if TYPE_CHECKING:
    from spmdlm.config import RunArgs
    from spmdlm.data.objectives import Objective
    from spmdlm.models.config import HFConfig

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


# -- tokenizers ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer a family trains and the special tokens it relies on."""

    kind: str  # "bpe" (byte-level BPE) or "unigram" (SentencePiece-style, T5)
    specials: dict[str, str | None]  # role (bos/eos/unk/pad/mask) -> token, None where the model has none
    trained_order: tuple[str, ...]  # specials in id order when we train a tokenizer (ids 0, 1, 2, ...)
    hf_class: str | None = None  # tokenizer_config.json class when transformers rebuilds it identically
    num_sentinels: int = 0  # T5's <extra_id_k>
    frames_with_bos: bool = False  # RoBERTa/BART: every text is <s> ... </s>


def check_framed_length(length: int, limit: int, positions: str) -> None:
    """--max_seq_length of an encoder that frames its input as <s> ... </s>, against the positions it has."""
    from spmdlm.config import ArgumentError

    if length > limit:
        raise ArgumentError(f"--max_seq_length {length} is longer than the model's {positions}; lower "
                            "--max_seq_length or use a config with more positions")
    if length < 3:
        raise ArgumentError(f"--max_seq_length {length} leaves no room between <s> and </s>; raise it")


# -- the family ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # = the HF model_type
    config_class: type
    model_class: type
    hf_auto_class: str  # the transformers Auto class that loads the export
    table: Table
    tokenizer: TokenizerSpec
    default_preset: str  # --config_name when none is given with --train_file
    quickstart: dict[str, Any]  # flags of the embedded quick start (python -m spmdlm.launch --model_type NAME)
    check_lengths: Callable[["RunArgs", "HFConfig"], None]  # before any data is read; raises ArgumentError
    build_objective: Callable[["RunArgs", "HFConfig", Any], "Objective"]  # (args, config, tokenizer)
    forward_flops: Callable[..., dict[str, float]]  # (config, sequence lengths, full_causal_square) -> by part
    resume_keys: tuple[str, ...] = ()  # objective flags that must match to resume
    check_hf_config: Callable[[dict], None] = lambda values: None  # refuses HF configs we cannot reproduce
    sequence_flags: tuple[str, ...] = ()  # the objective flags that apply; the first sets the example length

    @property
    def is_encoder_decoder(self) -> bool:
        return getattr(self.config_class, "is_encoder_decoder", False)

    def make_model(self, config, *, rngs, dtype=None, remat: str = "dots", scan_unroll: int | bool = 1):
        import jax.numpy as jnp

        return self.model_class(config, rngs=rngs, dtype=dtype or jnp.float32, remat=remat, scan_unroll=scan_unroll)
