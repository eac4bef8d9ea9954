"""Pretraining objectives as pure numpy functions `(record, rng) -> example`.

A record is a 1-D int32 array of `record_length` token ids cut from the tokenized corpus (documents joined by the
objective's separator). An example is a dict of fixed-shape arrays that the model's loss consumes. `labels` equal to
IGNORE_INDEX carry no loss. Every random choice uses the `np.random.Generator` passed in (Grain derives it from the
seed and the global example index), never global state, so any example can be recomputed from (seed, index) alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import numpy as np

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Flag:
    """A command-line flag an objective takes (`python -m spmdlm.launch` and `spmdlm.prepare` build theirs from
    these declarations). `check` returns True for a valid value; `rule` says what a valid value is."""

    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], bool] = lambda value: True
    rule: str = ""
    resume: bool = True  # a run resumes only with the value it started with

    def of(self, args) -> Any:
        """The flag's value in run arguments (their `objective` mapping), or its default."""
        return args.objective.get(self.name, self.default)


def at_least_one(value) -> bool:
    return value is None or value >= 1


def open_unit(value) -> bool:
    return value is None or 0 < value < 1


# Flags several objectives share.
MAX_SEQ_LENGTH = Flag("max_seq_length", int, None, "encoder length for RoBERTa/T5/BART (default: RoBERTa and BART "
                      "the model's positions up to 512 and 1024, T5 512)", at_least_one, "must be at least 1")
MLM_PROBABILITY = Flag("mlm_probability", float, None, "MLM masking rate / T5 noise density (default 0.15); BART: "
                       "the HF script's name for --mask_ratio", open_unit, "must be between 0 and 1")


class Objective:
    """What the pipeline, the train step and the benchmarks need to know about an objective: subclasses set
    `record_length` and implement `__call__` and `example_spec`."""

    FLAGS: ClassVar[tuple[Flag, ...]] = ()  # its command-line flags; the first sets the example length
    # How records are cut from the corpus (spmdlm.data.records.MODES): documents joined into a stream of records.
    preparation: ClassVar[str] = "stream"
    # An objective that labels few positions (MLM) says how many per example the loss should plan for; the LM head
    # then runs on those positions only (see train/step.py: loss_sums).
    label_capacity: ClassVar[int | None] = None
    # Label ids the reported loss and accuracy leave out (BART's special tokens, as the HF script counts); trained on.
    unscored_label_ids: ClassVar[tuple[int, ...]] = ()
    record_length: int  # tokens per prepared record

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of every field of one example (for padding eval batches and synthetic benchmarks)."""
        raise NotImplementedError

    def sequence_lengths(self) -> dict[str, int]:
        """Tokens of one example per model input: {"input": L} and, for encoder-decoders, {"decoder": L'}."""
        spec = self.example_spec()
        lengths = {"input": spec["input_ids"][0][0]}
        if "decoder_input_ids" in spec:
            lengths["decoder"] = spec["decoder_input_ids"][0][0]
        return lengths


def padding_example(objective: Objective) -> dict[str, np.ndarray]:
    """An example that carries no loss: fills eval batches up to a whole batch without biasing the means."""
    out = {}
    for name, (shape, dtype) in objective.example_spec().items():
        fill = IGNORE_INDEX if name == "labels" else 0
        out[name] = np.full(shape, fill, dtype=dtype)
    return out


class Framed(Objective):
    """For objectives whose examples are `<s> content </s>` (RoBERTa, BART): records leave room for the two frame
    tokens, and `special_ids` (a field of the subclass) are kept as a sorted array for vectorised checks."""

    @property
    def record_length(self) -> int:
        return self.max_seq_length - 2  # room for <s> and </s>

    @functools.cached_property
    def _specials(self) -> np.ndarray:
        return np.asarray(self.special_ids, dtype=np.int32)
