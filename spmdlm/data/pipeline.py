"""Grain pipelines: global example order, per-host slices, and global batches on the mesh.

The global example at index g is `objective(record[shuffle_epoch(g)], rng(seed, g))`: shuffling is reseeded per
epoch and the objective's randomness is keyed by g (Grain's `random_map`). Global batch s is examples
[s·G, (s+1)·G); process p of P reads only the contiguous rows [p·G/P, (p+1)·G/P) of it, which is exactly the part
of the global array its devices hold. So batches depend on (seed, step) alone, not on the number of hosts, and a
restored iterator continues the same sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import grain
import jax
import numpy as np

from spmdlm.data.objectives import Objective, padding_example
from spmdlm.data.records import PreparedSplit, decode_record, record_source
from spmdlm.errors import DataError
from spmdlm.mesh import batch_sharding


class _ApplyObjective(grain.transforms.RandomMap):
    def __init__(self, objective: Objective):
        self.objective = objective

    def random_map(self, record, rng: np.random.Generator):
        return self.objective(decode_record(record), rng)


class _HostRows(grain.MapDataset):
    """This process's rows of every global batch, in order: local index i -> global index."""

    def __init__(self, parent: grain.MapDataset, global_batch: int, process_index: int, process_count: int):
        super().__init__(parent)
        if global_batch % process_count:
            raise ValueError(f"global batch {global_batch} is not divisible by {process_count} processes")
        self._local = global_batch // process_count
        self._global, self._offset = global_batch, process_index * self._local
        self._len = (len(parent) // global_batch) * self._local

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        step, row = divmod(index, self._local)
        return self._parent[step * self._global + self._offset + row]


def global_examples(split: PreparedSplit, objective: Objective, *, seed: int, num_epochs: int,
                    shuffle: bool = True) -> grain.MapDataset:
    ds = grain.MapDataset.source(record_source(split))[: split.num_records]  # --max_train_samples keeps a prefix
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs > 1:
        ds = ds.repeat(num_epochs)  # reseeds the shuffle each epoch
    return ds.random_map(_ApplyObjective(objective), seed=seed)


def train_batches(split: PreparedSplit, objective: Objective, *, seed: int, global_batch: int, num_epochs: int,
                  process_index: int = 0, process_count: int = 1, read_options: grain.ReadOptions | None = None):
    """An iterator (checkpointable with Grain) of this process's part of each global training batch.

    Grain's in-order thread prefetch only: `mp_prefetch` would reorder batches and break batch = f(step).
    `read_options` sets its threads and prefetch buffer (default: Grain's); the batches are the same either way.
    A split of several shard files is read as one sequence: every host opens all shards and reads only its rows.
    """
    ds = global_examples(split, objective, seed=seed, num_epochs=num_epochs)
    ds = _HostRows(ds, global_batch, process_index, process_count)
    return iter(ds.batch(global_batch // process_count, drop_remainder=True).to_iter_dataset(read_options))


def eval_batches(split: PreparedSplit, objective: Objective, *, seed: int, global_batch: int,
                 max_examples: int | None = None, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every validation example once, in file order, the last batch padded with loss-free examples."""
    ds = global_examples(split, objective, seed=seed, num_epochs=1, shuffle=False)
    total = len(ds) if max_examples is None else min(len(ds), max_examples)
    pad = padding_example(objective)
    local = global_batch // process_count
    for start in range(0, total, global_batch):
        rows = range(start + process_index * local, start + (process_index + 1) * local)
        examples = [ds[g] if g < total else pad for g in rows]
        yield {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def to_global(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Assemble the global batch from each process's rows without any host holding all of it."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v) for k, v in batch.items()}


def batch_spec(objective: Objective, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((global_batch, *shape), dtype)
            for k, (shape, dtype) in objective.example_spec().items()}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many steps a run takes, from epochs or max_steps."""

    steps_per_epoch: int
    total_steps: int
    num_epochs: int  # whole epochs of data the iterator must provide


def make_schedule(num_records: int, global_batch: int, num_train_epochs: float, max_steps: int) -> Schedule:
    steps_per_epoch = num_records // global_batch
    if steps_per_epoch == 0:
        raise DataError(
            f"the training set has {num_records} examples, fewer than one global batch of {global_batch}; "
            "lower --per_device_train_batch_size or give more data"
        )
    total = max_steps if max_steps and max_steps > 0 else int(steps_per_epoch * num_train_epochs)
    if total <= 0:
        raise DataError(f"--num_train_epochs {num_train_epochs} gives no training steps; raise it or set --max_steps")
    return Schedule(steps_per_epoch, total, num_epochs=-(-total // steps_per_epoch))
