"""T5 span corruption (T5 v1.1 pretraining) in numpy, vectorised over a batch.

A record of `record_length` tokens is split into alternating keep/noise spans (starting with keep, ending with
noise). Each noise span is replaced by one sentinel in the encoder input, and the targets list the noise spans,
each after its sentinel:

    inputs = keep_0 <extra_id_0> keep_1 <extra_id_1> ... keep_n <extra_id_n> EOS
    labels = <extra_id_0> noise_0 <extra_id_1> noise_1 ... <extra_id_n> noise_n EOS

The numbers of noise tokens and spans depend only on the record length, so every example has the same static
shapes and nothing is padded. Only the span layout is random: one uniform per token but two, the sort keys that pick
each row's span boundaries, so a batch is corrupted with array operations over all its rows.

With document_attention "isolated", each document of the record is corrupted on its own, as T5X corrupts each
document before packing: the record is cut after each EOS separator into segments, and a segment whose content (its
tokens but the separator) has M >= 2 tokens is corrupted exactly as a record of M tokens is (the same counts, the
same sort-key rule, the keys read from the uniforms at its own positions), its sentinels numbered from <extra_id_0>:

    inputs  = keep_0 <extra_id_0> ... keep_n <extra_id_n> EOS  |  the next document's ...       (right-padded)
    labels  = <extra_id_0> noise_0 ... <extra_id_n> noise_n EOS |  ...                          (right-padded)

The separator is the segment's EOS (never noise); a record's last segment, when cut mid-document, gets one added; a
1-token document stays as it is. Since a corrupted segment never grows (noise tokens >= spans), records of
inputs_length - 1 tokens always fit the encoder's inputs_length. The targets keep the joined mode's length for the
same --max_seq_length; when a record's segments would need more, they are taken in a random order and one whose
targets no longer fit is left uncorrupted (inputs only, no loss: common only for documents of a few dozen tokens).
`segment_ids` and `decoder_segment_ids` hold the record's segment number (1, 2, ...; 0 = padding), so a target
segment carries the number of its document's input segment (numbers without targets are skipped); `positions` and
`decoder_positions` count from 0 within each segment, and each target segment's decoder inputs restart with
decoder_start_id.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from spmdlm.bounds import Bounds
from spmdlm.data.objectives import (
    DECODER_SEGMENT_FIELDS,
    DOCUMENT_ATTENTION,
    DOCUMENT_ATTENTION_MODES,
    IGNORE_INDEX,
    MAX_SEQ_LENGTH,
    MLM_PROBABILITY,
    SEGMENT_FIELDS,
    Flag,
    Vectorised,
    after,
    segments,
)

MEAN_NOISE_SPAN_LENGTH = Flag(
    "mean_noise_span_length",
    float,
    3.0,
    "T5 span corruption: mean length of a corrupted span",
    bounds=Bounds(1, hint="tokens per span, 3 in T5"),
)


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
    return (_num_noise_tokens(length, noise_density), num_noise_spans(length, noise_density, mean_noise_span_length))


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


def random_spans_noise_masks(
    length: int, noise_density: float, mean_noise_span_length: float, draws: np.ndarray
) -> np.ndarray:
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


def _runs(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, offset) of the concatenated ranges arange(lengths[i]): which range each element is in, and where."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return owner, np.arange(len(owner)) - (np.cumsum(lengths) - lengths)[owner]


def _compact(emit: np.ndarray, values: np.ndarray, segment: np.ndarray, width: int, fill: int):
    """(ids, segment_ids, positions), each (rows, width): the `values` where `emit` (both (rows, n)) moved to the
    left of each row, right-padded with `fill` (segment 0, position 0); positions count within each segment."""
    row, column = np.nonzero(emit)
    at = (np.cumsum(emit, axis=1) - 1)[row, column]
    ids = np.full((len(emit), width), fill, dtype=np.int32)
    segment_ids = np.zeros((len(emit), width), dtype=np.int32)
    ids[row, at], segment_ids[row, at] = values[row, column], segment[row, column]
    starts = segment_ids != np.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    return ids, segment_ids, segments(starts, segment_ids > 0)[1]


def _segment_runs(start: np.ndarray, m: np.ndarray, n_noise: np.ndarray, n_spans: np.ndarray, draws: np.ndarray):
    """Where the spans of segments begin: (noise run starts, their numbers, keep run starts, their numbers), flat
    positions and run numbers within the segment, of segments at flat `start` with m content tokens, n_noise of them
    in n_spans noise runs (each run of either kind non-empty, keep first, noise last).

    The layout is `random_spans_noise_masks`' for a record of m tokens, from the uniforms of `draws` (flat) at the
    segment's first m - 2 positions: the K - 1 gaps between kept tokens, then the N - 1 between noise tokens; the
    S - 1 gaps of each kind with the smallest keys are where its runs are cut. All segments at once.
    """
    n_keep = m - n_noise
    owner, j = _runs(m - 2)
    noise_gap = j >= (n_keep - 1)[owner]
    group = 2 * owner + noise_gap  # non-decreasing: by segment, keep gaps before noise gaps
    by_key = np.lexsort((draws.reshape(-1)[start[owner] + j], group))
    cut = np.zeros(len(j), dtype=bool)
    cut[by_key] = np.arange(len(j)) - np.searchsorted(group, group[by_key]) < (n_spans - 1)[owner[by_key]]
    keep_cuts = (j + 1)[cut & ~noise_gap]  # S - 1 per segment, ascending: kept tokens before keep runs 1..
    noise_cuts = (j - (n_keep - 1)[owner] + 1)[cut & noise_gap]  # noise tokens before noise runs 1..
    ends = np.cumsum(n_spans - 1)
    # Noise run r begins after keep runs 0..r and noise runs 0..r-1; keep run r >= 1 after runs 0..r-1 of both.
    keep_before = np.insert(keep_cuts, ends, n_keep)  # per segment: keep_cuts, then K
    noise_before = np.insert(noise_cuts, ends - (n_spans - 1), 0)  # per segment: 0, then noise_cuts
    run_owner, noise_runs = _runs(n_spans)
    cut_owner, cut_run = _runs(n_spans - 1)
    keep_starts = np.concatenate((start, start[cut_owner] + keep_cuts + noise_cuts))
    keep_runs = np.concatenate((np.zeros_like(start), cut_run + 1))
    return start[run_owner] + keep_before + noise_before, noise_runs, keep_starts, keep_runs


@dataclasses.dataclass(frozen=True)
class SpanCorruption(Vectorised):
    FLAGS = (MAX_SEQ_LENGTH, MLM_PROBABILITY, MEAN_NOISE_SPAN_LENGTH, DOCUMENT_ATTENTION)
    inputs_length: int  # encoder length (--max_seq_length)
    sentinel_ids: tuple[int, ...]  # [k] = id of <extra_id_k>, from the real tokenizer
    eos_id: int
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    decoder_start_id: int = 0
    document_attention: str = "joined"

    def __post_init__(self):
        # Stored as plain ints so the objective stays hashable and cheap to pickle into data workers.
        object.__setattr__(self, "sentinel_ids", tuple(int(i) for i in self.sentinel_ids))
        if self.document_attention not in DOCUMENT_ATTENTION_MODES:
            raise ValueError(f"document_attention {self.document_attention!r} must be joined or isolated")
        if not 0.0 < self.noise_density < 1.0:
            raise ValueError(f"noise_density {self.noise_density} must be in (0, 1): fix --mlm_probability")
        if self.mean_noise_span_length < 1.0:
            raise ValueError(
                f"mean_noise_span_length {self.mean_noise_span_length} must be >= 1: fix --mean_noise_span_length"
            )
        if self.inputs_length < 3:
            raise ValueError(f"inputs_length {self.inputs_length} is too short to corrupt: raise --max_seq_length")
        # Isolated: a segment has at most record_length tokens and spans grow with the length, so this bounds every
        # segment's spans too (each numbers its sentinels from <extra_id_0>).
        n_spans = num_noise_spans(self.record_length, self.noise_density, self.mean_noise_span_length)
        if n_spans > len(self.sentinel_ids):
            raise ValueError(
                f"span corruption of {self.record_length}-token records makes {n_spans} noise spans but only "
                f"{len(self.sentinel_ids)} sentinels exist: lower --max_seq_length or raise "
                "--mean_noise_span_length, or use a tokenizer with more sentinels"
            )

    @property
    def isolated(self) -> bool:
        return self.document_attention == "isolated"

    @functools.cached_property
    def _expanded_length(self) -> int:
        """Longest record whose corrupted input has at most inputs_length tokens (T5's expanded_inputs_length).

        The same search as T5's random_spans_helper, run on the counts the mask really uses. The two agree at the
        usual settings; T5's helper gives lengths the examples would not have at mean span 1, density > 0.5 or tiny
        lengths, and at density 0.5 it shortens the record by one token to keep targets <= inputs, which static
        target shapes do not need.
        """
        density, mean = self.noise_density, self.mean_noise_span_length
        length = self.inputs_length - 1  # corruption adds at most one token (EOS), so this never overshoots
        while _corrupted_lengths(length + 1, density, mean)[0] <= self.inputs_length:
            length += 1
        return length

    @functools.cached_property
    def record_length(self) -> int:
        """Joined: the record whose corrupted input is exactly inputs_length tokens. Isolated: inputs_length - 1,
        the longest record that fits the encoder however it is segmented (every segment's input is at most its
        tokens, plus the EOS the last one gets when it is cut mid-document)."""
        if self.isolated:
            return self.inputs_length - 1
        length, density, mean = self._expanded_length, self.noise_density, self.mean_noise_span_length
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
        """The joined mode's targets length for this inputs_length (isolated: the capacity segments share)."""
        return _corrupted_lengths(self._expanded_length, self.noise_density, self.mean_noise_span_length)[1]

    @functools.cached_property
    def _sentinels(self) -> np.ndarray:
        return np.asarray(self.sentinel_ids, dtype=np.int32)

    @functools.cached_property
    def _segment_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[M] = (noise tokens, noise spans, targets) of a segment of M content tokens; all 0 below 2 tokens (left
        uncorrupted: there is no keep and noise token to split them into)."""
        counts = np.zeros((3, self.record_length + 1), dtype=np.int64)
        for m in range(2, self.record_length + 1):
            n_noise, n_spans = _span_counts(m, self.noise_density, self.mean_noise_span_length)
            counts[:, m] = n_noise, n_spans, n_noise + n_spans + 1
        return counts[0], counts[1], counts[2]

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        if self.isolated:  # one uniform per token: each segment reads its sort keys at its own positions
            return rng.random(self.record_length)
        return rng.random(noise_mask_draws(self.record_length, self.noise_density, self.mean_noise_span_length))

    def apply(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        if records.shape[1:] != (self.record_length,):
            raise ValueError(f"T5 record has shape {records.shape[1:]}, expected ({self.record_length},)")
        if self.isolated:
            return self._apply_isolated(records.astype(np.int32, copy=False), draws)
        noise = random_spans_noise_masks(self.record_length, self.noise_density, self.mean_noise_span_length, draws)
        labels = _replace_spans(records, ~noise, self._sentinels, self.eos_id)
        starts = np.full((len(records), 1), self.decoder_start_id, dtype=np.int32)
        return {
            "input_ids": _replace_spans(records, noise, self._sentinels, self.eos_id),
            "labels": labels,
            "decoder_input_ids": np.concatenate((starts, labels[:, :-1]), axis=1),
        }

    def _corrupted_segments(self, count: np.ndarray, targets: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """bool per segment (flat, by row then segment; `count` per row): corrupted. A segment long enough is
        corrupted if its targets fit what the others taken before it left of targets_length; a row whose segments do
        not all fit takes them in the order of their uniform `keys`: which one is left out does not depend on its place
        (in order, a record's last segment, the head of a document the next record goes on with, would go first)."""
        corrupt = targets > 0
        first = np.cumsum(count) - count
        for row in np.flatnonzero(np.add.reduceat(targets, first) > self.targets_length).tolist():
            room, at = self.targets_length, int(first[row])
            for g in (at + np.argsort(keys[at : at + count[row]])).tolist():
                if corrupt[g] and targets[g] <= room:
                    room -= int(targets[g])
                else:
                    corrupt[g] = False
        return corrupt

    def _apply_isolated(self, records: np.ndarray, draws: np.ndarray) -> dict[str, np.ndarray]:
        rows, length = records.shape
        separator = records == self.eos_id
        segment, index = segments(after(separator))  # a segment ends with its separator
        count = segment[:, -1]  # segments per row
        flat_segment = (np.cumsum(count) - count)[:, None] + segment - 1  # by row then segment, as `starts`
        flat_size = rows * length
        starts = np.flatnonzero(index == 0)  # flat position of every segment's first token, by row then segment
        sizes = np.diff(np.append(starts, flat_size))
        content = sizes - separator.reshape(-1)[starts + sizes - 1]  # only a row's last segment may lack one
        noise_of, spans_of, targets_of = self._segment_counts
        # The key of a segment's order is the uniform at its last token, which its spans' keys never use.
        corrupt = self._corrupted_segments(count, targets_of[content], draws.reshape(-1)[starts + sizes - 1])

        start, m = starts[corrupt], content[corrupt]
        noise_starts, noise_runs, keep_starts, keep_runs = _segment_runs(start, m, noise_of[m], spans_of[m], draws)
        # A noise run ends where keep run r >= 1 begins (keep_starts lists each segment's run 0 first) or, the
        # last, where its segment's content does.
        noise_ends = np.concatenate((keep_starts[len(start) :], start + m))
        flips = np.bincount(noise_starts, minlength=flat_size + 1) - np.bincount(noise_ends, minlength=flat_size + 1)
        noise = (np.cumsum(flips)[:-1] > 0).reshape(rows, length)

        # Both sides on a grid one column wider than the record: the EOS a row's last segment gets when it lacks a
        # separator goes in the extra column. Sentinels replace the first token of each run they stand for.
        width = length + 1
        grid = lambda flat: flat // length * width + flat % length
        eos = np.full((rows, 1), self.eos_id, dtype=np.int32)
        ends_open = ~separator[:, -1:]
        in_corrupt = corrupt[flat_segment]
        grid_segment = np.concatenate((segment, segment[:, -1:]), axis=1)
        inputs = np.concatenate((records, eos), axis=1)
        input_emit = np.concatenate((~noise, ends_open), axis=1)
        inputs.flat[grid(noise_starts)] = self._sentinels[noise_runs]
        input_emit.flat[grid(noise_starts)] = True
        targets = np.concatenate((records, eos), axis=1)
        target_emit = np.concatenate((noise | (separator & in_corrupt), ends_open & in_corrupt[:, -1:]), axis=1)
        targets.flat[grid(keep_starts)] = self._sentinels[keep_runs]
        target_emit.flat[grid(keep_starts)] = True

        # Right-padded with T5's <pad> (0) in segment 0, which no query sees; the decoder restarts per segment.
        input_ids, segment_ids, positions = _compact(input_emit, inputs, grid_segment, self.inputs_length, 0)
        labels, decoder_segment_ids, decoder_positions = _compact(
            target_emit, targets, grid_segment, self.targets_length, IGNORE_INDEX
        )
        shifted = np.pad(labels, ((0, 0), (1, 0)))[:, :-1]
        restart = (decoder_positions == 0) & (decoder_segment_ids > 0)
        decoder_input_ids = np.where(restart, self.decoder_start_id, np.where(decoder_segment_ids > 0, shifted, 0))
        return {
            "input_ids": input_ids,
            "labels": labels,
            "decoder_input_ids": decoder_input_ids.astype(np.int32),
            **dict(zip(SEGMENT_FIELDS, (segment_ids, positions))),
            **dict(zip(DECODER_SEGMENT_FIELDS, (decoder_segment_ids, decoder_positions))),
        }

    def example_spec(self):
        encoder, decoder = ((self.inputs_length,), np.int32), ((self.targets_length,), np.int32)
        spec = {"input_ids": encoder, "labels": decoder, "decoder_input_ids": decoder}
        if self.isolated:
            spec.update({name: encoder for name in SEGMENT_FIELDS})
            spec.update({name: decoder for name in DECODER_SEGMENT_FIELDS})
        return spec
