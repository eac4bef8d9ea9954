"""Weighted mixtures of corpora (docs/data.md, "Mixtures"): the sources a run names, and which source each global
example comes from.

A mixture is `--train_file 'news/*.jsonl:0.6,wiki/*.txt:0.3,code/:0.1'` (every comma-separated part ends in
`:WEIGHT`) or `--data_mixture mixture.yaml`. Weights are normalised to sum to 1.

Sampling is a function of (seed, global example index) alone, with exact shares: the global examples are cut into
periods of PERIOD; in each, source k owns `counts[k]` slots (its weight times PERIOD, rounded by largest remainder
so they sum to PERIOD), placed by a permutation seeded by (seed, period). Global index g is slot g % PERIOD of
period g // PERIOD; if source k owns it, it is k's example `period * counts[k] + (rank of the slot among k's)`,
which spmdlm.data.pipeline.MixtureBatches maps to one of k's records by k's own epoch order (sources repeat
independently).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from spmdlm import storage
from spmdlm.data.records import PreparedSplit
from spmdlm.errors import ArgumentError, yaml_problem

PERIOD = 10_000  # global examples per period: a source's share is exact to 1/PERIOD over every period
SLOT_STREAM = 0x6D697800  # rng keys (seed, SLOT_STREAM, period), kept apart from EpochOrder's (seed, epoch)
SOURCE_STREAM = 0x6D697900  # source k's epoch order: (seed, SOURCE_STREAM + k, epoch)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a source's name, as in eval/<name>/loss
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")  # a weight: a decimal, exponent allowed
WEIGHTED = re.compile(rf"(?P<path>.+):(?P<weight>{NUMBER.pattern})")  # only a trailing :float
MIXTURE_KEYS = ("name", "train_file", "dataset_dir", "weight", "validation_file")


@dataclasses.dataclass(frozen=True)
class Source:
    """One corpus of a mixture: text files (`train_file`, tokenized into the token cache) or a dataset prepared by
    python -m spmdlm.prepare (`dataset_dir`)."""

    name: str
    weight: float  # normalised: a mixture's weights sum to 1
    train_file: str | None = None
    dataset_dir: str | None = None
    validation_file: str | None = None
    origin: str = "--train_file"  # what an error about its inputs names

    def to_json(self) -> dict:
        """As run_config.json records it (what a resume compares)."""
        return {key: getattr(self, key) for key in MIXTURE_KEYS}


def sources_of(train_file: str | None, data_mixture: str | None) -> tuple[Source, ...]:
    """The run's mixture; () for a single corpus (no weights anywhere)."""
    if data_mixture is not None:
        if train_file is not None:
            raise ArgumentError("give --data_mixture or --train_file, not both (a mixture's sources go in one)")
        return read_mixture_file(data_mixture)
    return parse_train_file(train_file) if train_file else ()


def parse_train_file(text: str) -> tuple[Source, ...]:
    """`a.txt:0.6,gs://b/c/*.txt:0.4` -> two sources; () when no part has a weight (one corpus, as before)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    matches = [WEIGHTED.fullmatch(part) for part in parts]
    if not any(matches):
        return ()
    unweighted = [part for part, match in zip(parts, matches) if match is None]
    if unweighted:
        raise ArgumentError(
            f"--train_file {text}: {unweighted[0]} has no :WEIGHT; in a mixture every part has one "
            "(a source of several files is a glob or a directory, or use --data_mixture)"
        )
    names = unique_names([name_of(match["path"]) for match in matches])
    weights = normalised([float(match["weight"]) for match in matches], names, "--train_file")
    return tuple(
        Source(name, weight, train_file=match["path"], origin=f"--train_file source {name}")
        for name, weight, match in zip(names, weights, matches)
    )


def name_of(pattern: str) -> str:
    """A source's name from its path: the last folder or file name before any glob, without suffixes
    (`news/*.jsonl` -> news, `code/` -> code, `gs://b/wiki.txt` -> wiki)."""
    parts = [part for part in pattern.split("://")[-1].split("/") if part]
    literal = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    stem = literal[-1].split(".")[0] if literal else ""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("_.-")
    return stem or "source"


def unique_names(names: list[str]) -> list[str]:
    """Names made distinct by a counter (two sources of folders called `data` are data and data_2)."""
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}_{n}"
        out.append(candidate)
    return out


def normalised(weights: Sequence[float], names: Sequence[str], where: str) -> list[float]:
    """Positive finite weights scaled to sum to 1; a source too light to get one slot per PERIOD is refused."""
    for name, weight in zip(names, weights):
        if not (math.isfinite(weight) and weight > 0):
            raise ArgumentError(
                f"{where}: source {name} has weight {weight:g}; weights must be positive (leave a "
                "source out instead of weighting it 0)"
            )
    total = sum(weights)
    if not math.isfinite(total):
        raise ArgumentError(
            f"{where}: the weights sum to more than a float holds; scale them down (only their ratios count)"
        )
    shares = [weight / total for weight in weights]
    for name, count in zip(names, slot_counts(shares)):
        if count == 0:
            raise ArgumentError(
                f"{where}: source {name}'s weight gives it no example in {PERIOD:,}; give it at "
                f"least 1/{PERIOD:,} of the total"
            )
    return shares


def read_mixture_file(path: str) -> tuple[Source, ...]:
    """A YAML mixture: `sources:` (or a bare list) of {name, train_file or dataset_dir, weight, validation_file}.
    Relative paths are relative to the YAML file's folder."""
    where = f"--data_mixture {path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ArgumentError(f"{where}: no such file")
    try:
        loaded = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ArgumentError(f"{where} is not valid YAML: {yaml_problem(e)}") from None
    entries = loaded.get("sources") if isinstance(loaded, dict) else loaded
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ArgumentError(
            f"{where}: expected `sources:`, a list of mappings with name, train_file or "
            "dataset_dir, weight and optionally validation_file"
        )
    names, weights = [], []
    for number, entry in enumerate(entries, start=1):
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        name = entry.get("name")
        if unknown:
            raise ArgumentError(
                f"{where}: source {number} has unknown keys {', '.join(map(str, unknown))} (known: "
                f"{', '.join(MIXTURE_KEYS)})"
            )
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ArgumentError(f"{where}: source {number} needs a name of letters, digits, _ . - (got {name!r})")
        if name in names:
            raise ArgumentError(f"{where}: two sources are named {name}")
        if (entry.get("train_file") is None) == (entry.get("dataset_dir") is None):
            raise ArgumentError(f"{where}: source {name} needs one of train_file and dataset_dir")
        if entry.get("dataset_dir") is not None and entry.get("validation_file") is not None:
            raise ArgumentError(
                f"{where}: source {name}: a dataset_dir has its own validation split; leave out validation_file"
            )
        names.append(name)
        weights.append(_weight(entry.get("weight"), f"{where}: source {name}"))
    shares = normalised(weights, names, where)
    beside = lambda value: None if value is None else _beside(file.parent, str(value))
    return tuple(
        Source(
            name,
            share,
            train_file=beside(entry.get("train_file")),
            dataset_dir=beside(entry.get("dataset_dir")),
            validation_file=beside(entry.get("validation_file")),
            origin=f"{where} source {name}",
        )
        for name, share, entry in zip(names, shares, entries)
    )


def _weight(value, where: str) -> float:
    """A source's weight; YAML 1.1 (PyYAML) reads `1e-3` as a string, so a string that is a number counts too."""
    if isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{where} needs a numeric weight (got {value!r})")
    return float(value)


def _beside(folder: Path, value: str) -> str:
    """Each comma-separated path of `value`, relative ones taken relative to `folder`."""

    def one(part: str) -> str:
        part = part.strip()
        return part if storage.is_url(part) or Path(part).expanduser().is_absolute() else str(folder / part)

    return ",".join(one(part) for part in value.split(",") if part.strip())


def describe_change(old: list[dict] | None, new: list[dict] | None) -> str:
    """What differs between two recorded mixtures, in a few words (for the resume refusal)."""
    show = lambda mix: ", ".join(f"{s['name']} {s['weight']:.4g}" for s in mix) if mix else "one corpus"
    return f"{show(old)} -> {show(new)}"


# -- sampling ------------------------------------------------------------------------------------------------------


def slot_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Slots per source in a period: weight x period, rounded by largest remainder (ties to the earlier source)
    so that they sum to `period`."""
    exact = np.asarray(weights, dtype=np.float64) * period / sum(weights)
    counts = np.floor(exact).astype(np.int64)
    short = period - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class MixtureOrder:
    """Global example index -> (source, index among that source's examples); periods' slot permutations are kept
    for the last two periods (a batch rarely spans more)."""

    def __init__(self, weights: Sequence[float], seed: int, period: int = PERIOD):
        self.counts, self.seed, self.period = slot_counts(weights, period), seed, period
        self._slots = functools.lru_cache(maxsize=2)(self._make_slots)

    def _make_slots(self, period_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, rank of the slot among that source's slots) of one period."""
        sources = np.repeat(np.arange(len(self.counts), dtype=np.int32), self.counts)
        np.random.default_rng([self.seed, SLOT_STREAM, period_index]).shuffle(sources)
        ranks = np.empty(self.period, dtype=np.int64)
        grouped = np.argsort(sources, kind="stable")  # each source's slots together, in period order
        ranks[grouped] = np.arange(self.period) - np.repeat(np.cumsum(self.counts) - self.counts, self.counts)
        return sources, ranks

    def __call__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        periods, slots = np.divmod(np.asarray(indices, dtype=np.int64), self.period)
        sources, ranks = np.empty(len(slots), dtype=np.int32), np.empty(len(slots), dtype=np.int64)
        for period in np.unique(periods):
            rows = periods == period
            period_sources, period_ranks = self._slots(int(period))
            sources[rows], ranks[rows] = period_sources[slots[rows]], period_ranks[slots[rows]]
        return sources, periods * self.counts[sources] + ranks

    def taken(self, num_examples: int) -> np.ndarray:
        """How many of each source's examples the global examples [0, num_examples) use."""
        full, rest = divmod(num_examples, self.period)
        counts = full * self.counts
        if rest:
            counts = counts + np.bincount(self._slots(full)[0][:rest], minlength=len(self.counts))
        return counts


@dataclasses.dataclass(frozen=True)
class MixedSplit:
    """A mixture's training records: one prepared split per source (each with its own cache or dataset)."""

    sources: tuple[Source, ...]
    splits: tuple[PreparedSplit, ...]

    @property
    def num_records(self) -> int:
        """What an epoch of a mixture is: the sum of its sources' records (--num_train_epochs counts these)."""
        return sum(split.num_records for split in self.splits)

    @property
    def weights(self) -> list[float]:
        return [source.weight for source in self.sources]

    @property
    def fingerprint(self) -> dict[str, str]:
        """Each source's records' fingerprint, by name: a resume compares the sources both runs have."""
        return {source.name: split.fingerprint for source, split in zip(self.sources, self.splits)}

    def epochs_reached(self, seed: int, num_examples: int) -> dict[str, float]:
        """Each source's epochs after the first `num_examples` global examples."""
        taken = MixtureOrder(self.weights, seed).taken(num_examples)
        return {source.name: float(n) / split.num_records for source, split, n in zip(self.sources, self.splits, taken)}
