"""T5 span corruption (T5 v1.1 pretraining) in numpy, vectorised over a batch.

A record of `record_length` tokens is split into alternating keep/noise spans (starting with keep, ending with
noise). Each noise span is replaced by one sentinel in the encoder input, and the targets list the noise spans,
each after its sentinel:

    inputs = keep_0 <extra_id_0> keep_1 <extra_id_1> ... keep_n <extra_id_n> EOS
    labels = <extra_id_0> noise_0 <extra_id_1> noise_1 ... <extra_id_n> noise_n EOS

The numbers of noise tokens and spans depend only on the record length, so every example has the same static
shapes and nothing is padded. Only the span layout is random: one uniform per token but two, the sort keys that pick
each row's span boundaries, so a batch is corrupted with array operations over all its rows.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from spmdlm.data.objectives import MAX_SEQ_LENGTH, MLM_PROBABILITY, Flag, Vectorised

MEAN_NOISE_SPAN_LENGTH = Flag("mean_noise_span_length", float, 3.0, "T5 span corruption: mean length of a corrupted "
                              "span")


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
    """T5's `random_spans_helper`: (record length whose corrupted input has `inputs_length` tokens, target length).

    A faithful port, kept for parity with T5 and the HF script (Python's banker's rounding included). It assumes
    mean_noise_span_length > 1 and ignores the clamp and min() guard of the mask; `SpanCorruption` derives its
    shapes from the mask's own counts instead, which agree with this at the usual settings.
    """

    def lengths(tokens_length: int) -> tuple[int, int]:
        n_noise = int(round(tokens_length * noise_density))
        n_keep = tokens_length - n_noise
        n_spans = int(round(n_noise / mean_noise_span_length))
        return n_keep + n_spans + 1, n_noise + n_spans + 1  # +1: EOS

    tokens_length = inputs_length
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = lengths(tokens_length)
    # T5's fix-up: at density 0.5 the targets can come out longer than the inputs.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _num_noise_tokens(length: int, noise_density: float) -> int:
    # At least one noise and one kept token, whatever the density.
    return min(max(int(round(length * noise_density)), 1), length - 1)


def num_noise_spans(length: int, noise_density: float, mean_noise_span_length: float) -> int:
    """Number of noise spans (= sentinels used) in every record of `length` tokens."""
    n_noise = _num_noise_tokens(length, noise_density)
    n_keep = length - n_noise  # after the clamp (the HF script took it before, wrong for tiny lengths)
    # min(): each span of either kind needs at least one token, which matters above density 0.5.
    return max(int(round(min(n_noise, n_keep) / mean_noise_span_length)), 1)


def _span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of every record of `length` tokens."""
    return (_num_noise_tokens(length, noise_density),
            num_noise_spans(length, noise_density, mean_noise_span_length))


def _corrupted_lengths(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    n_noise, n_spans = _span_counts(length, noise_density, mean_noise_span_length)
    return length - n_noise + n_spans + 1, n_noise + n_spans + 1


def _random_segmentations(n_items: int, n_segments: int, keys: np.ndarray) -> np.ndarray:
    """(rows, n_segments) lengths of uniformly random splits of n_items into non-empty runs, one per row of `keys`
    (rows, n_items - 1) uniforms: the cuts are the n_segments - 1 gaps with the smallest keys."""
    cuts = np.sort(np.argsort(keys, axis=1)[:, : n_segments - 1], axis=1) + 1
    edges = np.zeros((len(keys), 1), dtype=np.int64)
    return np.diff(np.concatenate((edges, cuts, edges + n_items), axis=1), axis=1)


def noise_mask_draws(length: int, noise_density: float, mean_noise_span_length: float) -> int:
    """Uniforms one row of `random_spans_noise_masks` takes: a sort key per gap between kept and between noise
    tokens."""
    n_noise, _ = _span_counts(length, noise_density, mean_noise_span_length)
    return (length - n_noise - 1) + (n_noise - 1)


def random_spans_noise_masks(length: int, noise_density: float, mean_noise_span_length: float,
                             draws: np.ndarray) -> np.ndarray:
    """bool[rows, length], True at noise tokens, from `draws` (rows, noise_mask_draws(...)) uniforms: spans
    alternate keep/noise, starting with keep and ending with noise."""
    n_noise, n_spans = _span_counts(length, noise_density, mean_noise_span_length)
    n_keep = length - n_noise
    keep_lengths = _random_segmentations(n_keep, n_spans, draws[:, : n_keep - 1])
    noise_lengths = _random_segmentations(n_noise, n_spans, draws[:, n_keep - 1 :])
    span_lengths = np.stack([keep_lengths, noise_lengths], axis=2).reshape(len(draws), -1)
    # Each span's end flips keep <-> noise: a token is noise after an odd number of span ends.
    flips = np.zeros((len(draws), length + 1), dtype=np.int8)
    np.put_along_axis(flips, np.cumsum(span_lengths, axis=1), 1, axis=1)
    return (np.cumsum(flips[:, :length], axis=1) % 2).astype(bool)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator
) -> np.ndarray:
    """bool[length], True at noise tokens: one row of `random_spans_noise_masks`, drawn from `rng`."""
    draws = rng.random((1, noise_mask_draws(length, noise_density, mean_noise_span_length)))
    return random_spans_noise_masks(length, noise_density, mean_noise_span_length, draws)[0]


def _replace_spans(ids: np.ndarray, spans: np.ndarray, sentinels: np.ndarray, eos_id: int) -> np.ndarray:
    """ids (rows, n) with the k-th run of `spans` in each row collapsed into sentinels[k], then EOS.

    Positions decide what is dropped, never token values, so a real id 0 (or any id) always survives. Every row has
    the same number of runs and of run tokens (fixed by the length), so the rows stay one array.
    """
    starts = spans & ~np.pad(spans, ((0, 0), (1, 0)))[:, :-1]
    out = np.where(starts, sentinels[np.cumsum(starts, axis=1) - 1], ids)
    kept = out[~spans | starts].reshape(len(ids), -1)
    return np.concatenate((kept, np.full((len(ids), 1), eos_id)), axis=1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SpanCorruption(Vectorised):
    FLAGS = (MAX_SEQ_LENGTH, MLM_PROBABILITY, MEAN_NOISE_SPAN_LENGTH)
    inputs_length: int  # encoder length (--max_seq_length)
    sentinel_ids: tuple[int, ...]  # [k] = id of <extra_id_k>, from the real tokenizer
    eos_id: int
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    decoder_start_id: int = 0

    def __post_init__(self):
        # Stored as plain ints so the objective stays hashable and cheap to pickle into data workers.
        object.__setattr__(self, "sentinel_ids", tuple(int(i) for i in self.sentinel_ids))
        if not 0.0 < self.noise_density < 1.0:
            raise ValueError(f"noise_density {self.noise_density} must be in (0, 1): fix --mlm_probability")
        if self.mean_noise_span_length < 1.0:
            raise ValueError(
                f"mean_noise_span_length {self.mean_noise_span_length} must be >= 1: fix --mean_noise_span_length"
            )
        if self.inputs_length < 3:
            raise ValueError(f"inputs_length {self.inputs_length} is too short to corrupt: raise --max_seq_length")
        n_spans = num_noise_spans(self.record_length, self.noise_density, self.mean_noise_span_length)
        if n_spans > len(self.sentinel_ids):
            raise ValueError(
                f"span corruption of {self.record_length}-token records makes {n_spans} noise spans but only "
                f"{len(self.sentinel_ids)} sentinels exist: lower --max_seq_length or raise "
                "--mean_noise_span_length, or use a tokenizer with more sentinels"
            )

    @functools.cached_property
    def record_length(self) -> int:
        """Longest record whose corrupted input is exactly inputs_length tokens (T5's expanded_inputs_length).

        The same search as T5's random_spans_helper, run on the counts the mask really uses. The two agree at the
        usual settings; T5's helper gives lengths the examples would not have at mean span 1, density > 0.5 or tiny
        lengths, and at density 0.5 it shortens the record by one token to keep targets <= inputs, which static
        target shapes do not need.
        """
        density, mean = self.noise_density, self.mean_noise_span_length
        length = self.inputs_length - 1  # corruption adds at most one token (EOS), so this never overshoots
        while _corrupted_lengths(length + 1, density, mean)[0] <= self.inputs_length:
            length += 1
        below, above = (_corrupted_lengths(n, density, mean)[0] for n in (length, length + 1))
        if below != self.inputs_length:
            raise ValueError(
                f"no record length gives exactly {self.inputs_length} input tokens at noise_density {density} and "
                f"mean_noise_span_length {mean} (records of {length} and {length + 1} tokens give {below} and "
                f"{above}): change --max_seq_length"
            )
        return length

    @functools.cached_property
    def targets_length(self) -> int:
        return _corrupted_lengths(self.record_length, self.noise_density, self.mean_noise_span_length)[1]

    @functools.cached_property
    def _sentinels(self) -> np.ndarray:
        return np.asarray(self.sentinel_ids, dtype=np.int32)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        return rng.random(noise_mask_draws(self.record_length, self.noise_density, self.mean_noise_span_length))

    def apply(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        if records.shape[1:] != (self.record_length,):
            raise ValueError(f"T5 record has shape {records.shape[1:]}, expected ({self.record_length},)")
        noise = random_spans_noise_masks(self.record_length, self.noise_density, self.mean_noise_span_length, draws)
        labels = _replace_spans(records, ~noise, self._sentinels, self.eos_id)
        starts = np.full((len(records), 1), self.decoder_start_id, dtype=np.int32)
        return {
            "input_ids": _replace_spans(records, noise, self._sentinels, self.eos_id),
            "labels": labels,
            "decoder_input_ids": np.concatenate((starts, labels[:, :-1]), axis=1),
        }

    def example_spec(self):
        return {
            "input_ids": ((self.inputs_length,), np.int32),
            "labels": ((self.targets_length,), np.int32),
            "decoder_input_ids": ((self.targets_length,), np.int32),
        }
