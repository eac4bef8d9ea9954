"""Causal LM (GPT-2): a record of block_size + 1 tokens gives inputs x[:-1] and next-token targets x[1:].

With document_attention "isolated", each document of the record is a segment of its own (`segment_ids`,
`positions`). GPT-2's <|endoftext|> is both EOS and BOS, so a segment begins AT each EOS of the inputs: the last token
of a document predicts the EOS within its own segment, and the EOS, opening the next document as GPT-2's generation
starts from it, predicts that document's first token. Every label keeps its loss.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spmdlm.data.objectives import (
    AT_LEAST_ONE,
    DOCUMENT_ATTENTION,
    DOCUMENT_ATTENTION_MODES,
    SEGMENT_FIELDS,
    Flag,
    Objective,
    segments,
)

BLOCK_SIZE = Flag("block_size", int, None, "CLM example length (default: min(1024, n_positions))", bounds=AT_LEAST_ONE)


@dataclasses.dataclass(frozen=True)
class CausalLM(Objective):
    FLAGS = (BLOCK_SIZE, DOCUMENT_ATTENTION)
    block_size: int
    eos_id: int | None = None  # the document separator; needed by "isolated" only
    document_attention: str = "joined"

    def __post_init__(self):
        if self.document_attention not in DOCUMENT_ATTENTION_MODES:
            raise ValueError(f"document_attention {self.document_attention!r} must be joined or isolated")
        if self.document_attention == "isolated" and self.eos_id is None:
            raise ValueError("CLM with document_attention isolated needs the EOS id that separates documents")

    @property
    def record_length(self) -> int:
        # One extra token so every one of the block_size positions has a target: no per-block tail loss.
        return self.block_size + 1

    def __call__(self, record: np.ndarray, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
        del rng  # CLM needs no randomness
        return {name: rows[0] for name, rows in self.batch(np.asarray(record)[None], 0, [0]).items()}

    def batch(self, records: np.ndarray, seed: int, indices) -> dict[str, np.ndarray]:
        del seed, indices
        if records.shape[1:] != (self.record_length,):
            raise ValueError(f"CLM record has shape {records.shape[1:]}, expected ({self.record_length},)")
        records = records.astype(np.int32, copy=False)
        inputs = np.ascontiguousarray(records[:, :-1])
        out = {"input_ids": inputs, "labels": np.ascontiguousarray(records[:, 1:])}
        if self.document_attention == "isolated":
            out.update(zip(SEGMENT_FIELDS, segments(inputs == self.eos_id)))
        return out

    def example_spec(self):
        names = ("input_ids", "labels") + (SEGMENT_FIELDS if self.document_attention == "isolated" else ())
        return {name: ((self.block_size,), np.int32) for name in names}
