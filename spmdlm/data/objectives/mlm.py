"""RoBERTa masked LM (BERT-style 80/10/10 masking) in numpy, vectorised over a batch.

A record of `record_length` = max_seq_length - 2 content ids is framed as `<s> content </s>` and padded to
max_seq_length. Each content token that is not a special id is chosen with probability mlm_probability; of the
chosen, 80% become <mask>, 10% a uniformly random non-special id and 10% stay as they are. `labels` hold the
original id at chosen positions and IGNORE_INDEX elsewhere.

Grouped mode (default): every record is full content, so nothing is padded. line_by_line: a record is one line
truncated to record_length and right-padded with pad_id; the leading non-pad tokens are its content.

Segments (batch fields SEGMENT_FIELDS: segment_ids 1, 2, ... per segment of a row, 0 on padding; positions from 0
within each segment; a query attends to its own segment only):
- packing (with line_by_line): records of max_seq_length tokens already hold several framed lines `<s> ids </s>`
  (spmdlm.data.records, "packed_lines"), padded; each line is a segment, opened by its <s>;
- document_attention "isolated" (grouped): a segment ends with its document's separator (EOS); the framing <s>
  belongs to the first segment, the closing </s> to the last. "joined" (the default) adds no fields.

Differences from the HF script (`run_mlm_flax.py` + DataCollatorForLanguageModeling):
- every random choice uses the `rng` passed in (keyed by (seed, global example index) in the pipeline), not the
  global np.random, so any example can be recomputed alone;
- chosen positions are tracked as a boolean mask, never by `labels > 0`-style value tests, so a real id 0 is kept;
- shapes are always [max_seq_length]: line_by_line does not pad batches to a multiple of 16 (and recompile);
- random replacements are never special ids (HF drew from the whole vocabulary, <mask> and <pad> included);
- grouped records are framed `<s> ... </s>` each, instead of being cut from already framed lines.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from spmdlm.data.objectives import (
    DOCUMENT_ATTENTION,
    DOCUMENT_ATTENTION_MODES,
    IGNORE_INDEX,
    MAX_SEQ_LENGTH,
    MLM_PROBABILITY,
    SEGMENT_FIELDS,
    Flag,
    Framed,
    Vectorised,
    after,
    segments,
)

LINE_BY_LINE = Flag(
    "line_by_line", bool, False, "MLM: one example per non-empty line (truncated, padded) instead of blocks"
)
PAD_TO_MAX_LENGTH = Flag(
    "pad_to_max_length", bool, False, "accepted for compatibility (examples always have fixed shapes)", resume=False
)
PACKING = Flag(
    "packing",
    bool,
    False,
    "MLM with --line_by_line: pack several lines into each example of "
    "--max_seq_length tokens (best-fit decreasing at preparation), each line its own segment (attention "
    "and positions stay within it), instead of padding every line to full length",
)

MASK_FRACTION = 0.8  # of the chosen tokens: become <mask>
RANDOM_FRACTION = 0.1  # become a random non-special id; the remaining 0.1 stay unchanged


def layout_problem(line_by_line: bool, packing: bool, document_attention: str) -> str | None:
    """What is wrong with this combination of record layout flags, in one line (None: nothing)."""
    if document_attention not in DOCUMENT_ATTENTION_MODES:
        return f"--document_attention {document_attention!r} must be one of {', '.join(DOCUMENT_ATTENTION_MODES)}"
    if packing and not line_by_line:
        return (
            "--packing packs --line_by_line lines into full examples: add --line_by_line (grouped blocks are "
            "full already; to keep their documents apart use --document_attention isolated)"
        )
    if line_by_line and not packing and document_attention == "isolated":  # packed lines are isolated already
        return (
            "--document_attention isolated applies to grouped blocks; a --line_by_line example holds one line: "
            "use --packing to put several lines, each its own segment, in one example"
        )
    return None


@dataclasses.dataclass(frozen=True)
class MaskedLM(Vectorised, Framed):
    FLAGS = (MAX_SEQ_LENGTH, MLM_PROBABILITY, LINE_BY_LINE, PAD_TO_MAX_LENGTH, PACKING, DOCUMENT_ATTENTION)
    max_seq_length: int
    bos_id: int
    eos_id: int
    pad_id: int
    mask_id: int
    special_ids: tuple[int, ...]  # every special id of the tokenizer: never chosen, never a random replacement
    vocab_size: int  # len(tokenizer): random replacements come from [0, vocab_size) minus special_ids
    mlm_probability: float = 0.15
    line_by_line: bool = False
    packing: bool = False  # with line_by_line: records are packed framed lines (their segments)
    document_attention: str = "joined"  # grouped records: "isolated" makes each document a segment

    def __post_init__(self):
        # Plain ints keep the objective hashable and cheap to pickle into data workers.
        object.__setattr__(self, "special_ids", tuple(sorted({int(i) for i in self.special_ids})))
        if self.max_seq_length < 3:
            raise ValueError(f"max_seq_length {self.max_seq_length} leaves no room for content: raise --max_seq_length")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability {self.mlm_probability} must be in (0, 1): fix --mlm_probability")
        for role in ("bos_id", "eos_id", "pad_id", "mask_id"):
            if getattr(self, role) not in self.special_ids:
                raise ValueError(f"{role} {getattr(self, role)} is not among special_ids {self.special_ids}")
        if not all(0 <= i < self.vocab_size for i in self.special_ids):
            raise ValueError(f"special_ids {self.special_ids} must lie in [0, vocab_size={self.vocab_size})")
        if self.vocab_size <= len(self.special_ids):
            raise ValueError(f"vocab_size {self.vocab_size} leaves no non-special id to draw random replacements from")
        if problem := layout_problem(self.line_by_line, self.packing, self.document_attention):
            raise ValueError(problem)

    @property
    def record_length(self) -> int:
        return self.max_seq_length if self.packing else self.max_seq_length - 2  # packed records are framed already

    @property
    def segmented(self) -> bool:
        """Whether examples carry SEGMENT_FIELDS."""
        return self.packing or self.document_attention == "isolated"

    @property
    def label_capacity(self) -> int | None:
        """Labelled positions per example the loss plans for: the chosen count is Binomial(content, p), so mean + 6
        standard deviations (rounded up to a multiple of 8) is exceeded about once in 10^9 examples, and a batch
        that does exceed it takes the exact all-positions path (engine/step.py). None when it saves little."""
        n, p = self.record_length, self.mlm_probability
        capacity = 8 * math.ceil((n * p + 6 * math.sqrt(n * p * (1 - p))) / 8)
        return capacity if capacity <= 0.75 * self.max_seq_length else None

    @property
    def preparation(self) -> str:
        """How records are cut from the corpus (spmdlm.data.records.MODES)."""
        return "packed_lines" if self.packing else "lines" if self.line_by_line else "stream"

    def _random_non_special(self, uniform: np.ndarray) -> np.ndarray:
        """Ids uniform over [0, vocab_size) minus special_ids, one per uniform in [0, 1), without materialising
        the vocabulary.

        Take the r-th non-special id: it is r plus the number of specials below it, and special s_k (sorted) lies
        below it exactly when the s_k - k non-special ids before s_k number <= r.
        """
        r = (uniform * (self.vocab_size - len(self.special_ids))).astype(np.int64)
        non_special_before = self._specials - np.arange(len(self._specials))
        return (r + np.searchsorted(non_special_before, r, side="right")).astype(np.int32)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        # Three uniforms per position (chosen?, 80/10/10, which random id), whatever the content length: the rng
        # stream has a fixed layout.
        return rng.random((3, self.max_seq_length))

    def apply(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        if records.shape[1:] != (self.record_length,):
            raise ValueError(f"MLM record has shape {records.shape[1:]}, expected ({self.record_length},)")
        if self.packing:
            return self._packed(records, draws)
        rows, length = np.arange(len(records)), self.max_seq_length
        n_content = np.full(len(records), self.record_length)
        if self.line_by_line:
            is_pad = records == self.pad_id
            n_content = np.where(is_pad.any(axis=1), is_pad.argmax(axis=1), self.record_length)

        position = np.arange(length)
        is_content = (position >= 1) & (position <= n_content[:, None])
        input_ids = np.full((len(records), length), self.pad_id, dtype=np.int32)
        input_ids[:, 1 : self.record_length + 1] = records
        input_ids = np.where(is_content, input_ids, self.pad_id).astype(np.int32)
        input_ids[:, 0] = self.bos_id
        input_ids[rows, n_content + 1] = self.eos_id
        attention_mask = (position < n_content[:, None] + 2).astype(np.int32)
        maskable = is_content & ~np.isin(input_ids, self._specials)  # separators inside stay put
        masked, labels = self._mask(input_ids, maskable, draws)
        example = {"input_ids": masked, "attention_mask": attention_mask, "labels": labels}
        if self.document_attention == "isolated":  # grouped: every position is real; a segment ends at its separator
            separators = is_content & (input_ids == self.eos_id)
            starts = after(separators)
            starts[:, -1] = False  # the closing </s> belongs to the last segment
            example.update(zip(SEGMENT_FIELDS, segments(starts)))
        return example

    def _packed(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        """Records of packed framed lines: each <s> opens a segment; pad is padding."""
        input_ids = records.astype(np.int32)
        valid = input_ids != self.pad_id
        masked, labels = self._mask(input_ids, valid & ~np.isin(input_ids, self._specials), draws)
        example = {"input_ids": masked, "attention_mask": valid.astype(np.int32), "labels": labels}
        example.update(zip(SEGMENT_FIELDS, segments(input_ids == self.bos_id, valid)))
        return example

    def _mask(self, input_ids: np.ndarray, maskable: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) after 80/10/10 masking of the maskable positions chosen by the draws."""
        chosen = maskable & (draws[:, 0] < self.mlm_probability)
        decision = draws[:, 1]  # one draw splits chosen tokens 80/10/10
        to_mask = chosen & (decision < MASK_FRACTION)
        to_random = chosen & (decision >= MASK_FRACTION) & (decision < MASK_FRACTION + RANDOM_FRACTION)
        labels = np.where(chosen, input_ids, IGNORE_INDEX).astype(np.int32)
        input_ids = np.where(to_random, self._random_non_special(draws[:, 2]), input_ids)
        input_ids = np.where(to_mask, self.mask_id, input_ids).astype(np.int32)
        return input_ids, labels

    def example_spec(self):
        shape = (self.max_seq_length,)
        fields = ("input_ids", "attention_mask", "labels") + (SEGMENT_FIELDS if self.segmented else ())
        return {name: (shape, np.int32) for name in fields}
