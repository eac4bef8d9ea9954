"""Pretraining objectives as pure numpy functions `(record, rng) -> example`, and `batch(records, seed, indices)`.

A record is a 1-D int32 array of `record_length` token ids cut from the tokenized corpus (documents joined by the
objective's separator). An example is a dict of fixed-shape arrays that the model's loss consumes. `labels` equal to
IGNORE_INDEX carry no loss. Every random choice uses the `np.random.Generator` passed in, never global state. The
pipeline calls `batch`, whose row i is exactly `self(records[i], example_rng(seed, indices[i]))`: a counter-based
generator keyed by the seed and the global example index, so any example can be recomputed from (seed, index) alone,
by whichever host or batch. Objectives vectorise `batch` over rows where it pays, drawing each row's randomness from
its own generator first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from spmdlm.bounds import Bounds

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Flag:
    """A command-line flag an objective takes (`python -m spmdlm.launch` and `spmdlm.prepare` build theirs from
    these declarations). A numeric flag declares its `bounds`; another's `check` returns True for a valid value and
    `rule` says what a valid value is."""

    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], bool] = lambda value: True
    rule: str = ""
    resume: bool = True  # a run resumes only with the value it started with
    bounds: Bounds | None = None  # a numeric flag's valid values (spmdlm/bounds.py: finite, and within these)

    def of(self, values: Mapping[str, Any]) -> Any:
        """The flag's value among the objective flags given (RunArgs.objective), or its default."""
        return values.get(self.name, self.default)


AT_LEAST_ONE = Bounds(1)
OPEN_UNIT = Bounds(0, 1, above=True, below=True, hint="a fraction of the tokens")


# Flags several objectives share.
MAX_SEQ_LENGTH = Flag(
    "max_seq_length",
    int,
    None,
    "encoder length for RoBERTa/ModernBERT/T5/BART (default: RoBERTa, ModernBERT and BART the model's positions up "
    "to 512, 1024 and 1024, T5 512)",
    bounds=AT_LEAST_ONE,
)
MLM_PROBABILITY = Flag(
    "mlm_probability",
    float,
    None,
    "MLM masking rate / T5 noise density (default 0.15; ModernBERT 0.3, its recipe's); BART: the HF script's name "
    "for --mask_ratio",
    bounds=OPEN_UNIT,
)
DOCUMENT_ATTENTION = Flag(
    "document_attention",
    str,
    "joined",
    "records cut from the document stream: 'joined' lets "
    "every token attend across the documents a record holds (GPT-2's practice, the default); "
    "'isolated' makes each document a segment of its own: attention, positions and (T5, BART) "
    "the corruption stay within it",
    lambda value: value in DOCUMENT_ATTENTION_MODES,
    "must be joined or isolated",
)
DOCUMENT_ATTENTION_MODES = ("joined", "isolated")

# The batch fields of segmented (packed or isolated) examples: segment ids count from 1 per row and 0 marks padding;
# positions count from 0 within each segment. A query sees only keys of its own segment (docs/packing.md).
SEGMENT_FIELDS = ("segment_ids", "positions")
DECODER_SEGMENT_FIELDS = ("decoder_segment_ids", "decoder_positions")


class Objective:
    """What the pipeline, the train step and the benchmarks need to know about an objective: subclasses set
    `record_length` and implement `__call__` and `example_spec`."""

    FLAGS: ClassVar[tuple[Flag, ...]] = ()  # its command-line flags; the first sets the example length
    # How records are cut from the corpus (spmdlm.data.records.MODES): documents joined into a stream of records.
    preparation: ClassVar[str] = "stream"
    # An objective that labels few positions (MLM) says how many per example the loss should plan for; the LM head
    # then runs on those positions only (see engine/step.py: loss_sums).
    label_capacity: ClassVar[int | None] = None
    # Label ids the reported loss and accuracy leave out (BART's special tokens, as the HF script counts); trained on.
    unscored_label_ids: ClassVar[tuple[int, ...]] = ()
    # Grain prefetch threads of its training iterator (spmdlm.data.pipeline): one pays where the batch's numpy work
    # releases the GIL (gathers, whole-batch arrays); none where it is many small calls that hold it
    read_threads: ClassVar[int] = 1
    record_length: int  # tokens per prepared record

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batch(self, records: np.ndarray, seed: int, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """The examples of `records` (n, record_length), row i keyed by the global example index indices[i]."""
        return stack([self(record, rng) for record, rng in zip(records, row_rngs(seed, indices))])

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


@functools.lru_cache(maxsize=64)
def _philox_key(seed: int) -> np.ndarray:
    return np.random.Philox(seed).state["state"]["key"]


def row_rngs(seed: int, indices: Sequence[int]) -> Iterator[np.random.Generator]:
    """The generator of each global example index in turn: Philox keyed by the seed, its counter starting at the
    index (the stream Grain's `random_map` gives element `index`). One generator, reset per row (a third of the cost
    of a new one): use each before taking the next."""
    bit_generator = np.random.Philox(key=_philox_key(seed))
    rng, state = np.random.Generator(bit_generator), bit_generator.state
    for index in indices:
        state["state"]["counter"] = np.array([0, 0, 0, index], dtype=np.uint64)
        state.update(buffer_pos=4, has_uint32=0)  # nothing left over from the previous row
        bit_generator.state = state
        yield rng


def example_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of global example `index` (see `row_rngs`)."""
    return next(row_rngs(seed, [index]))


def row_draws(seed: int, indices: Sequence[int], draw: Callable[[np.random.Generator], np.ndarray]) -> np.ndarray:
    """`draw(example_rng(seed, index))` of every row, stacked: the randomness of a vectorised batch."""
    return np.stack([draw(rng) for rng in row_rngs(seed, indices)])


def stack(examples: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([example[name] for example in examples]) for name in examples[0]}


class Vectorised(Objective):
    """An objective computed for a whole batch at once: `draw(rng)` takes one row's randomness from its generator
    (a fixed-shape array), `apply(records, draws)` makes the examples of all rows with numpy over the batch. One
    example is the batch of one row, so `__call__` and `batch` cannot disagree."""

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def apply(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        rows = self.apply(np.asarray(record)[None], self.draw(rng)[None])
        return {name: row[0] for name, row in rows.items()}

    def batch(self, records: np.ndarray, seed: int, indices: Sequence[int]) -> dict[str, np.ndarray]:
        return self.apply(np.asarray(records), row_draws(seed, indices, self.draw))


def segments(starts: np.ndarray, valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions), int32 [rows, T], of rows whose segments begin where `starts` (bool [rows, T]) is
    True; position 0 always begins one. Segment ids count from 1; where `valid` is False (padding) both are 0."""
    starts = np.asarray(starts, dtype=bool).copy()
    starts[:, 0] = True
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.arange(starts.shape[1], dtype=np.int32)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1).astype(np.int32)
    if valid is not None:
        segment_ids, positions = np.where(valid, segment_ids, 0), np.where(valid, positions, 0)
    return segment_ids.astype(np.int32), positions.astype(np.int32)


def after(marks: np.ndarray) -> np.ndarray:
    """bool [rows, T]: True right after each True of `marks` (a segment begins after its separator)."""
    out = np.zeros_like(marks, dtype=bool)
    out[:, 1:] = marks[:, :-1]
    return out


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
