"""Causal LM (GPT-2): a record of block_size + 1 tokens gives inputs x[:-1] and next-token targets x[1:]."""

from __future__ import annotations

import dataclasses

import numpy as np

from spmdlm.data.objectives import Flag, Objective, at_least_one

BLOCK_SIZE = Flag("block_size", int, None, "CLM example length (default: min(1024, n_positions))", at_least_one,
                  "must be at least 1")


@dataclasses.dataclass(frozen=True)
class CausalLM(Objective):
    FLAGS = (BLOCK_SIZE,)
    block_size: int

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
        return {"input_ids": np.ascontiguousarray(records[:, :-1]), "labels": np.ascontiguousarray(records[:, 1:])}

    def example_spec(self):
        return {"input_ids": ((self.block_size,), np.int32), "labels": ((self.block_size,), np.int32)}
