"""Grain pipelines: global example order, per-host slices, and global batches on the mesh.

The global example at index g is `objective(record[order(g)], example_rng(seed, g))`: `order` is a permutation of
the records per epoch (seeded by (seed, epoch)) and the objective's randomness is keyed by g. Global batch s is
examples [s·G, (s+1)·G); process p of P reads only the contiguous rows [p·G/P, (p+1)·G/P) of it, which is exactly
the part of the global array its devices hold. So batches depend on (seed, step) alone, not on the number of hosts,
and a restored iterator continues the same sequence.

The Grain elements are batches, not examples: a source whose element s is this host's records of global batch s,
gathered in one read from the memory-mapped token files (spmdlm.data.records.TokenRecords), and a map that applies
the objective to all rows at once (`Objective.batch`). Per-example Grain steps cost more than reading the tokens.
A weighted mixture of corpora (spmdlm.data.mixture) is the same with `MixtureBatches` as the source.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import grain
import jax
import numpy as np

from spmdlm.bounds import MAX_STEPS
from spmdlm.data.batch_ramp import BatchRamp
from spmdlm.data.mixture import SOURCE_STREAM, MixedSplit, MixtureOrder
from spmdlm.data.objectives import Objective, padding_example
from spmdlm.data.records import PreparedSplit, TokenRecords
from spmdlm.errors import DataError
from spmdlm.mesh import batch_sharding


# The objective's prefetch threads (`Objective.read_threads`), a few batches ahead each: measured on 2 cores
# (benchmarks/bench_read.py), one thread doubles CLM and MLM (the gather and numpy release the GIL) and slows BART's
# GIL-bound denoising; Grain's default 16 threads and 500 elements cost more per batch than they save. Batches are
# read in order either way.
def read_options_for(objective: Objective) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=objective.read_threads, prefetch_buffer_size=4 * objective.read_threads)


# What a checkpointed iterator's position counts (run_config.json "data_format"): 1 = examples (spmdlm 0.2),
# 2 = host batches (HostBatches, MixtureBatches). A resume across formats is refused (train/stages/outputs.py).
DATA_FORMAT = 2


class EpochOrder:
    """Global example index -> record index: epoch g // N reads the records in a permutation seeded by
    (seed, *stream, epoch) (`stream`: a mixture source's own; none for one corpus); kept for the last two epochs
    (a batch spans at most two), 4 bytes a record."""

    def __init__(self, num_records: int, seed: int, shuffle: bool = True, stream: tuple[int, ...] = ()):
        self.num_records, self.seed, self.shuffle, self.stream = num_records, seed, shuffle, stream
        self._permutation = functools.lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        order = np.arange(self.num_records, dtype=np.int32 if self.num_records < 2**31 else np.int64)
        np.random.default_rng([self.seed, *self.stream, epoch]).shuffle(order)
        return order

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """Record indices of ascending global example indices."""
        epochs, positions = np.divmod(indices, self.num_records)
        if not self.shuffle:
            return positions
        if epochs[0] == epochs[-1]:  # ascending indices of one epoch: the usual batch
            return self._permutation(int(epochs[0]))[positions]
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            out[rows] = self._permutation(int(epoch))[positions[rows]]
        return out


@dataclasses.dataclass(frozen=True)
class RecordBatch:
    indices: np.ndarray  # int64 [rows]: the global example indices
    records: np.ndarray  # int32 [rows, record_length]


class _HostRows:
    """Element s of a batch source: this process's contiguous rows of global batch s, as global example indices.
    `global_batch`: one size, or a `BatchRamp` (batch s is then examples [start(s), start(s) + B(s)), start(s) the
    examples of the batches before it: each example once across the ramp)."""

    def __init__(
        self,
        num_records: int,
        *,
        global_batch: int | BatchRamp,
        num_epochs: int,
        process_index: int,
        process_count: int,
    ):
        self.ramp = global_batch if isinstance(global_batch, BatchRamp) else BatchRamp.fixed(global_batch)
        for size in self.ramp.sizes:
            if size % process_count:
                raise ValueError(f"global batch {size} is not divisible by {process_count} processes")
        self.process_index, self.process_count = process_index, process_count
        self._len = self.ramp.steps_within(num_records * num_epochs)

    def __len__(self) -> int:
        return self._len

    def indices(self, step: int) -> np.ndarray:
        local = self.ramp.batch_at(step) // self.process_count
        start = self.ramp.examples_before(step) + self.process_index * local
        return start + np.arange(local, dtype=np.int64)


class HostBatches(_HostRows):
    """Grain random-access source: element s is this process's rows of global batch s, read in one gather."""

    def __init__(
        self,
        split: PreparedSplit,
        *,
        seed: int,
        global_batch: int | BatchRamp,
        num_epochs: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
    ):
        self.records = TokenRecords(split)
        self.order = EpochOrder(len(self.records), seed, shuffle)
        super().__init__(
            len(self.records),
            global_batch=global_batch,
            num_epochs=num_epochs,
            process_index=process_index,
            process_count=process_count,
        )

    def __getitem__(self, step: int) -> RecordBatch:
        indices = self.indices(step)
        return RecordBatch(indices, self.records.read(self.order(indices)))


class MixtureBatches(_HostRows):
    """HostBatches of a weighted mixture (spmdlm.data.mixture): global example g is example j of source k
    (`MixtureOrder`), read as record EpochOrder_k(j) of that source; an epoch is the sum of the sources' records."""

    def __init__(
        self,
        mixed: MixedSplit,
        *,
        seed: int,
        global_batch: int | BatchRamp,
        num_epochs: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.sources = [TokenRecords(split) for split in mixed.splits]
        self.orders = [
            EpochOrder(len(records), seed, stream=(SOURCE_STREAM + k,)) for k, records in enumerate(self.sources)
        ]
        self.mixture = MixtureOrder(mixed.weights, seed)
        super().__init__(
            mixed.num_records,
            global_batch=global_batch,
            num_epochs=num_epochs,
            process_index=process_index,
            process_count=process_count,
        )

    def __getitem__(self, step: int) -> RecordBatch:
        indices = self.indices(step)
        sources, within = self.mixture(indices)
        records = np.empty((len(indices), self.sources[0].record_length), dtype=np.int32)
        for k in np.unique(sources):
            rows = sources == k  # ascending global indices give ascending within-source indices
            records[rows] = self.sources[k].read(self.orders[k](within[rows]))
        return RecordBatch(indices, records)


class _ApplyObjective(grain.transforms.Map):
    def __init__(self, objective: Objective, seed: int):
        self.objective, self.seed = objective, seed

    def map(self, batch: RecordBatch) -> dict[str, np.ndarray]:
        return self.objective.batch(batch.records, self.seed, batch.indices)


def train_batches(
    split: PreparedSplit | MixedSplit,
    objective: Objective,
    *,
    seed: int,
    global_batch: int | BatchRamp,
    num_epochs: int,
    process_index: int = 0,
    process_count: int = 1,
    read_options: grain.ReadOptions | None = None,
):
    """An iterator (checkpointable with Grain) of this process's part of each global training batch, of one corpus
    or of a mixture's sources.

    In order: Grain's thread prefetch (`read_options`, default `read_options_for(objective)`) keeps the order, so the
    batches are the same either way; `mp_prefetch` would not. A split of several shard files is read as one
    sequence: every host opens all shards and reads only its rows.
    """
    source_class = MixtureBatches if isinstance(split, MixedSplit) else HostBatches
    source = source_class(
        split,
        seed=seed,
        global_batch=global_batch,
        num_epochs=num_epochs,
        process_index=process_index,
        process_count=process_count,
    )
    ds = grain.MapDataset.source(source).map(_ApplyObjective(objective, seed))
    return iter(ds.to_iter_dataset(read_options or read_options_for(objective)))


def eval_batches(
    split: PreparedSplit,
    objective: Objective,
    *,
    seed: int,
    global_batch: int,
    max_examples: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Every validation example once, in file order, the last batch padded with loss-free examples."""
    records = TokenRecords(split)
    total = len(records) if max_examples is None else min(len(records), max_examples)
    pad = padding_example(objective)
    local = global_batch // process_count
    for start in range(0, total, global_batch):
        indices = start + process_index * local + np.arange(local, dtype=np.int64)
        real = indices[indices < total]
        batch = {name: np.repeat(value[None], local, axis=0) for name, value in pad.items()}
        if len(real):
            for name, rows in objective.batch(records.read(real), seed, real).items():
                batch[name][: len(real)] = rows
        yield batch


def to_global(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Assemble the global batch from each process's rows without any host holding all of it."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v) for k, v in batch.items()}


def batch_spec(objective: Objective, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        k: jax.ShapeDtypeStruct((global_batch, *shape), dtype) for k, (shape, dtype) in objective.example_spec().items()
    }


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many steps a run takes, from epochs or max_steps."""

    steps_per_epoch: int  # of the final batch (a ramp's earlier batches fit more steps into its first epoch)
    total_steps: int
    num_epochs: int  # whole epochs of data the iterator must provide


def make_schedule(num_records: int, global_batch: int | BatchRamp, num_train_epochs: float, max_steps: int) -> Schedule:
    """The run's steps: --max_steps, else --num_train_epochs of the data (with a ramp, the steps whose examples fit
    in that many epochs' examples)."""
    ramp = global_batch if isinstance(global_batch, BatchRamp) else BatchRamp.fixed(global_batch)
    steps_per_epoch = num_records // ramp.final
    if num_records < max(ramp.sizes):
        raise DataError(
            f"the training set has {num_records} examples, fewer than one global batch of {max(ramp.sizes)}; "
            "lower --per_device_train_batch_size (or the --batch_size_ramp sizes) or give more data"
        )
    if max_steps and max_steps > 0:
        total = max_steps
    elif ramp.ramps:
        total = ramp.steps_within(int(num_records * num_train_epochs))
    else:
        total = int(steps_per_epoch * num_train_epochs)
    if total <= 0:
        raise DataError(f"--num_train_epochs {num_train_epochs} gives no training steps; raise it or set --max_steps")
    if total > MAX_STEPS:
        raise DataError(
            f"--num_train_epochs {num_train_epochs} gives {total} steps, more than the {MAX_STEPS} a step "
            "counter holds; lower it or set --max_steps"
        )
    epochs = -(-ramp.examples_before(total) // num_records) if ramp.ramps else -(-total // steps_per_epoch)
    return Schedule(steps_per_epoch, total, num_epochs=epochs)
