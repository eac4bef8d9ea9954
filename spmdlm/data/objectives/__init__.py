"""Pretraining objectives as pure numpy functions `(record, rng) -> example`.

A record is a 1-D int32 array of `record_length` token ids cut from the tokenized corpus (documents joined by the
objective's separator). An example is a dict of fixed-shape arrays that the model's loss consumes. `labels` equal to
IGNORE_INDEX carry no loss. Every random choice uses the `np.random.Generator` passed in (Grain derives it from the
seed and the global example index), never global state, so any example can be recomputed from (seed, index) alone.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np

IGNORE_INDEX = -100


class Objective(Protocol):
    """What the pipeline, the train step and the benchmarks need to know about an objective."""

    record_length: int  # tokens per prepared record
    # Optional `label_capacity: int | None`: an objective that labels few positions (MLM) says how many per example
    # the loss should plan for; the LM head then runs on those positions only (see train/step.py: loss_sums).

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]: ...

    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of every field of one example (for padding eval batches and synthetic benchmarks)."""
        ...


def padding_example(objective: Objective) -> dict[str, np.ndarray]:
    """An example that carries no loss: fills eval batches up to a whole batch without biasing the means."""
    out = {}
    for name, (shape, dtype) in objective.example_spec().items():
        fill = IGNORE_INDEX if name == "labels" else 0
        out[name] = np.full(shape, fill, dtype=dtype)
    return out


class Framed:
    """For objectives whose examples are `<s> content </s>` (RoBERTa, BART): records leave room for the two frame
    tokens, and `special_ids` (a field of the subclass) are kept as a sorted array for vectorised checks."""

    @property
    def record_length(self) -> int:
        return self.max_seq_length - 2  # room for <s> and </s>

    @functools.cached_property
    def _specials(self) -> np.ndarray:
        return np.asarray(self.special_ids, dtype=np.int32)
