"""BART denoising (sentence permutation + text infilling) in numpy, vectorised over a batch.

A record holds `record_length` = max_seq_length - 2 content ids; the last token of each sentence carries the flag bit
SENTENCE_END (set at preparation from `spmdlm.data.sentences`). Records are cut from a stream of documents, so the
record's edges also count as sentence boundaries. One example, all int32 of length max_seq_length:

    labels            = <s> content </s>                      (the clean text; records are full, nothing padded)
    decoder_input_ids = decoder_start_id, labels[:-1]         (transformers' shift_tokens_right)
    input_ids         = <s> infill(permute(content)) </s> <pad> ...   attention_mask 1 up to </s>, then 0

permute: ceil(permute_sentence_ratio * #sentences) sentences, chosen at random, are shuffled among their own places
(fairseq's rule), so the multiset of sentences is kept. infill: ceil(mask_ratio * #maskable tokens) tokens are
covered by spans of Poisson(poisson_lambda) length; each span becomes one <mask>, and a zero-length span inserts
one <mask>. <s> and </s> are never touched. Special ids inside the content (the separator that joins documents)
stay exactly where they are: sentences are shuffled only within the run between two specials (one document), and
no span covers a special (a span that would straddle one is cut in two around it, each part with its own <mask>).

With document_attention "isolated", each document is a segment of its own on both sides: an encoder segment ends
with its separator (the first also holds <s>, the last the closing </s>), and so does a label segment, the decoder
position j being in the segment of label j. Since the separators stay in place and in order, encoder segment k and
label segment k hold the same document. BART's decoder_start_id is </s>, the separator, so the shifted decoder
inputs already restart with it at each later segment (it is set there anyway, for any decoder_start_id). Infilled
content too long for the encoder (many inserted <mask>s, or spans split at the separators of 1-token documents) is
cut at its end (its last segment keeps what is left of its document, then </s>); label segments past the encoder's
last become padding (segment 0, labels IGNORE_INDEX).
attention_mask and decoder_attention_mask are segment_ids > 0 and decoder_segment_ids > 0.

Randomness: each row first draws, from its own generator, its Poisson span lengths (until they cover its budget) and
one array of uniforms: sort keys that order its spans, pick their gaps and pick and order its sentences. Everything
else is array operations over all the rows of a batch at once, so a row is the same in any batch, and alone
(`__call__` is a batch of one).

Differences from the HF script run_bart_dlm_flax.py, and why:
- sentence ends are a flag bit on the ids, not <pad> tokens in the text that the encoder could not attend to;
- the mask budget is per example (mask_ratio of its own maskable tokens), not one budget for the whole batch;
- spans are laid out so they neither overlap nor roll around the end of the sequence (the HF placement wrapped);
- zero-length spans insert a <mask> as in BART, rather than being dropped, so the model also learns "nothing here";
- every random choice uses the `rng` passed in (keyed by (seed, example index)), so any example can be recomputed;
- shapes are static: no padding to the longest example of a batch.
Differences from fairseq's DenoisingDataset: spans never overlap (fairseq lets them merge, masking a little less
than the budget) and are kept apart by at least one unmasked token whenever there are enough of those (always at
usual settings), so <mask>s are never adjacent; masking is per token, not whole-word; no random-token replacement
(--mask-random), no token rotation or extra insertion noise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from spmdlm.bounds import Bounds
from spmdlm.data.objectives import (
    DECODER_SEGMENT_FIELDS,
    DOCUMENT_ATTENTION,
    DOCUMENT_ATTENTION_MODES,
    IGNORE_INDEX,
    MAX_SEQ_LENGTH,
    MLM_PROBABILITY,
    OPEN_UNIT,
    SEGMENT_FIELDS,
    Flag,
    Framed,
    after,
    row_rngs,
    segments,
)
from spmdlm.data.sentences import SENTENCE_END

MASK_RATIO = Flag(
    "mask_ratio", float, None, "BART text infilling: fraction of tokens masked (default 0.3)", bounds=OPEN_UNIT
)
POISSON_LAMBDA = Flag(
    "poisson_lambda",
    float,
    3.0,
    "BART text infilling: mean span length (Poisson)",
    bounds=Bounds(0, above=True, hint="tokens"),
)
PERMUTE_SENTENCE_RATIO = Flag(
    "permute_sentence_ratio", float, 1.0, "BART: fraction of sentences permuted", bounds=Bounds(0, 1)
)

_ID_BITS = SENTENCE_END - 1
_NO_LENGTHS = np.zeros(0, dtype=np.int64)


def _ceil(x: float) -> int:
    return math.ceil(round(x, 6))  # round first: 0.35 * 180 is 62.99999999999999 in floating point


@dataclasses.dataclass(frozen=True)
class Denoising(Framed):
    FLAGS = (MAX_SEQ_LENGTH, MLM_PROBABILITY, MASK_RATIO, POISSON_LAMBDA, PERMUTE_SENTENCE_RATIO, DOCUMENT_ATTENTION)
    read_threads = 0  # per-row Poisson draws are small GIL-holding calls: a prefetch thread only contends (bench_read)
    max_seq_length: int
    bos_id: int
    eos_id: int
    pad_id: int
    mask_id: int
    decoder_start_id: int
    special_ids: tuple[int, ...]  # every special id of the tokenizer: never masked, never moved
    permute_sentence_ratio: float = 1.0
    mask_ratio: float = 0.3
    poisson_lambda: float = 3.0
    document_attention: str = "joined"

    def __post_init__(self):
        # Plain ints keep the objective hashable and cheap to pickle into data workers.
        object.__setattr__(self, "special_ids", tuple(sorted({int(i) for i in self.special_ids})))
        if self.document_attention not in DOCUMENT_ATTENTION_MODES:
            raise ValueError(f"document_attention {self.document_attention!r} must be joined or isolated")
        if self.max_seq_length < 3:
            raise ValueError(f"max_seq_length {self.max_seq_length} leaves no room for content: raise --max_seq_length")
        for name in ("permute_sentence_ratio", "mask_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} {getattr(self, name)} must be in [0, 1]")
        if not self.poisson_lambda > 0.0:  # at 0 every span is empty and the budget never fills
            raise ValueError(f"poisson_lambda {self.poisson_lambda} must be > 0")
        for role in ("bos_id", "eos_id", "pad_id", "mask_id"):
            if getattr(self, role) not in self.special_ids:
                raise ValueError(f"{role} {getattr(self, role)} is not among special_ids {self.special_ids}")

    preparation = "sentences"  # records carry sentence-end flags (spmdlm.data.records)

    @property
    def unscored_label_ids(self) -> tuple[int, ...]:
        """The labels' <s> and </s> (and any other special): easy tokens the HF script's metrics leave out."""
        return self.special_ids

    @functools.cached_property
    def _budgets(self) -> np.ndarray:
        """[n] = the mask budget ceil(mask_ratio * n) of a record with n maskable tokens."""
        return np.array([_ceil(self.mask_ratio * n) for n in range(self.record_length + 1)])

    @functools.cached_property
    def _budget_of(self) -> list[int]:
        return self._budgets.tolist()  # Python ints: read once per row

    @functools.cached_property
    def _sentence_keys(self) -> int:
        """Uniforms a row draws for its sentence order: one per token, none when nothing is permuted."""
        return self.record_length if self.permute_sentence_ratio > 0 else 0

    @functools.cached_property
    def _shuffled_counts(self) -> np.ndarray:
        """[s] = sentences shuffled among s: ceil(permute_sentence_ratio * s), 0 when fewer than two."""
        counts = np.array([_ceil(self.permute_sentence_ratio * s) for s in range(self.record_length + 1)])
        return np.where(counts < 2, 0, counts)  # shuffling one sentence changes nothing

    def _draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """One row's randomness, for a record of n maskable tokens: Poisson span lengths until they cover the mask
        budget (fairseq draws in batches this size), then uniforms: a sort key per length (the spans' order), one
        per gap a span may take (n - budget + lengths: enough for either layout of `_layout_spans`) and, when
        sentences are permuted, one per token (`_permute_sentences`)."""
        budget = self._budget_of[n]
        if not budget:
            return _NO_LENGTHS, rng.random(self._sentence_keys)
        lengths = rng.poisson(self.poisson_lambda, budget)
        while lengths.sum() < budget:  # at usual lambdas the first draws suffice
            lengths = np.concatenate((lengths, rng.poisson(self.poisson_lambda, budget)))
        return lengths, rng.random(2 * len(lengths) + n - budget + self._sentence_keys)

    def _layout_spans(
        self, n: np.ndarray, lengths: np.ndarray, drawn: np.ndarray, uniforms: np.ndarray, first_uniform: np.ndarray
    ):
        """(row, start, length) of every infilling span of rows with n[row] maskable tokens, sorted by (row,
        start), from the rows' `_draw`s concatenated: `lengths` (drawn[row] a row), `uniforms` (the row's from
        first_uniform[row]). All rows are laid out at once.

        A row's lengths sum to its budget: its Poisson draws up to the first that reaches the budget, that one
        trimmed, in the order of their sort keys (or the trimmed, short span would always come last). Unless
        there are more spans than gaps between kept tokens (extreme settings only), each span takes its own gap
        (those of the smallest gap keys): uniform over layouts with no overlap, no wrap-around and a kept token
        between any two spans; otherwise some spans sit back to back.
        """
        budget = self._budgets[n]
        row_of = np.repeat(np.arange(len(n)), drawn)
        first_draw = np.cumsum(drawn) - drawn
        covered = np.concatenate(([0], np.cumsum(lengths)))
        before = covered[:-1] - covered[first_draw][row_of]  # the row's tokens covered by its earlier draws
        used = before < budget[row_of]  # up to the draw that reaches the budget
        local = np.arange(len(lengths)) - first_draw[row_of]
        span_row = row_of[used]
        order = np.lexsort((uniforms[first_uniform[row_of] + local][used], span_row))
        span_lengths = np.minimum(lengths, budget[row_of] - before)[used][order]
        spans = np.bincount(span_row, minlength=len(n))
        kept = n - budget
        apart = spans <= kept + 1
        candidates = np.where(spans == 0, 0, np.where(apart, kept + 1, kept + spans))
        if not candidates.any():
            return span_row, span_row, span_row  # no spans (all empty)
        column = np.arange(candidates.max())
        at = (first_uniform + drawn)[:, None] + column  # the gap keys follow the order keys
        gap_keys = np.where(column < candidates[:, None], uniforms[np.minimum(at, len(uniforms) - 1)], 2.0)
        # Each row takes its `spans` smallest keys: those below the spans-th smallest, then that one (and, for an
        # exact tie, the first of equal keys): defined by the values alone, whatever the sort.
        threshold = np.sort(gap_keys, axis=1)[np.arange(len(n)), np.maximum(spans - 1, 0)][:, None]
        below, tied = gap_keys < threshold, gap_keys == threshold
        chosen = below | (tied & (np.cumsum(tied, axis=1) <= (spans - below.sum(axis=1))[:, None]))
        gap = np.flatnonzero(chosen) % len(column)  # by (row, candidate): sorted within each row
        first_span = np.cumsum(spans) - spans
        rank = np.arange(len(span_row)) - first_span[span_row]
        gap = np.where(apart[span_row], gap, gap - rank)  # back to back: n_spans of kept + n_spans, then shifted
        masked = np.concatenate(([0], np.cumsum(span_lengths)))
        earlier = masked[:-1] - masked[first_span][span_row]  # the row's tokens in its earlier spans
        return span_row, gap + earlier, span_lengths  # start: kept tokens before the span + earlier spans' tokens

    def noise_spans(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the infilling spans over n <= record_length maskable tokens, sorted by start: those
        of an example whose record has n maskable tokens, from the same generator.

        The lengths sum to the budget ceil(mask_ratio * n). A zero-length span inserts a <mask> before token
        `start` (start == n: after the last). Spans never overlap nor pass the end; unless there are more spans
        than gaps between kept tokens (extreme settings only), starts are distinct and spans are kept apart.
        """
        _, starts, lengths = self._layout_spans(np.array([n]), *_concatenated([self._draw(rng, n)]))
        return starts, lengths

    def _permute_sentences(self, ids: np.ndarray, ends: np.ndarray, pinned: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """ids (rows, N) with each row's sentences shuffled by its uniform `keys` (rows, N), read at each sentence's
        first token: the sentences of the smallest keys are chosen and take each other's places in the order of
        those keys (a uniform choice, a uniform order), each within its own document."""
        rows, n = ids.shape
        # Pieces: sentences (cut after each flagged token) and every special on its own, which stays in place.
        cut = np.ones((rows, n), dtype=bool)
        cut[:, 1:] = ends[:, :-1] | pinned[:, 1:] | pinned[:, :-1]
        piece_starts = np.flatnonzero(cut)  # flat positions; each row's last piece ends where the next row starts
        piece_row = piece_starts // n
        piece_lengths = np.diff(np.append(piece_starts, rows * n))
        is_sentence = ~pinned.reshape(-1)[piece_starts]
        document = np.cumsum(~is_sentence)  # specials seen before: shuffle only within a document
        sentences = np.flatnonzero(is_sentence)
        sentence_row, sentence_key = piece_row[sentences], keys.reshape(-1)[piece_starts[sentences]]
        per_row = np.bincount(sentence_row, minlength=rows)
        shuffled = self._shuffled_counts[per_row][sentence_row]
        if self.permute_sentence_ratio < 1:
            by_key = np.lexsort((sentence_key, sentence_row))
            rank = np.empty(len(sentences), dtype=np.int64)
            rank[by_key] = np.arange(len(sentences)) - (np.cumsum(per_row) - per_row)[sentence_row[by_key]]
            chosen = rank < shuffled
        else:  # every sentence of a row with two or more (the default): no need to rank the keys
            chosen = shuffled > 0
        places = sentences[chosen]
        order = np.arange(len(piece_starts))
        order[places] = places[np.lexsort((sentence_key[chosen], document[places], piece_row[places]))]
        lengths = piece_lengths[order]
        gather = np.repeat(piece_starts[order] - (np.cumsum(lengths) - lengths), lengths) + np.arange(rows * n)
        return ids.reshape(-1)[gather].reshape(rows, n)

    def _infill(self, content: np.ndarray, pinned: np.ndarray, spans) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) of rows of `content` (rows, N) infilled by `spans` (`_layout_spans`)."""
        rows, n = content.shape
        length = self.max_seq_length
        span_row, starts, lengths = spans
        maskable = np.flatnonzero(~pinned)  # flat positions, by row
        per_row = n - pinned.sum(axis=1)
        first_maskable = np.cumsum(per_row) - per_row
        filled = lengths > 0
        span_starts = first_maskable[span_row[filled]] + starts[filled]  # in the flat order of maskable tokens
        span_ends = span_starts + lengths[filled]
        # Span number of every maskable token (-1: kept): the last span starting at or before it, if it reaches it.
        is_start = np.zeros(len(maskable), dtype=bool)
        is_start[span_starts] = True
        span = np.cumsum(is_start) - 1
        inside = np.arange(len(maskable)) < np.append(span_ends, 0)[span]  # span -1 reads the appended 0
        span_at = np.full(rows * n, -1)
        span_at[maskable] = np.where(inside, span, -1)
        # A span's first token becomes <mask>, the rest go. "First" is also the first token after a special inside
        # the span, so a special is never swallowed and each side of it keeps a <mask>.
        first = (span_at >= 0) & (span_at != np.concatenate(([-1], span_at[:-1])))
        emitted = np.flatnonzero((span_at < 0) | first)  # flat positions of the tokens that stay (or become <mask>)
        emit_row = emitted // n
        tokens = np.where(first[emitted], self.mask_id, content.reshape(-1)[emitted])
        # Zero-length spans: one <mask> before maskable token `start` (column n: after the content).
        empty_row, empty_start = span_row[~filled], starts[~filled]
        before = maskable[np.minimum(first_maskable[empty_row] + empty_start, len(maskable) - 1)] % n
        column = np.where(empty_start < per_row[empty_row], before, n)
        # The output of all rows in one sequence, by (row, column) with rows n + 1 wide: inserted <mask>s go before
        # the token of their column. A row's output starts after all of the earlier rows'.
        emit_key, insert_key = emitted + emit_row, empty_row * (n + 1) + column
        emit_at = np.arange(len(emitted)) + np.searchsorted(insert_key, emit_key, side="right")
        insert_at = np.arange(len(insert_key)) + np.searchsorted(emit_key, insert_key, side="left")
        row_keys = np.arange(rows + 1) * (n + 1)
        row_start = np.searchsorted(emit_key, row_keys) + np.searchsorted(insert_key, row_keys)
        kept = np.minimum(np.diff(row_start), length - 2)  # rare overflow (many insertions): cut, keep </s>
        input_ids = np.full(rows * length, self.pad_id, dtype=np.int32)
        for at, row, values in ((emit_at, emit_row, tokens), (insert_at, empty_row, self.mask_id)):
            slot = at - row_start[row]
            fits = slot < kept[row]
            input_ids[(row * length + 1 + slot)[fits]] = values if np.ndim(values) == 0 else values[fits]
        frame = np.arange(rows) * length
        input_ids[frame] = self.bos_id
        input_ids[frame + kept + 1] = self.eos_id
        return input_ids.reshape(rows, length), (np.arange(length) <= kept[:, None] + 1).astype(np.int32)

    def _unpack(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, sentence ends, pinned specials) of records (rows, record_length)."""
        if records.shape[1:] != (self.record_length,):
            raise ValueError(f"BART record has shape {records.shape[1:]}, expected ({self.record_length},)")
        ids = (records & _ID_BITS).astype(np.int32)
        return ids, (records & SENTENCE_END) != 0, np.isin(ids, self._specials)

    def _examples(self, ids: np.ndarray, ends: np.ndarray, pinned: np.ndarray, draws: list) -> dict[str, np.ndarray]:
        """The examples of all rows at once, row i from draws[i] (`_draw`)."""
        rows, n = ids.shape
        maskable = n - pinned.sum(axis=1)
        lengths, drawn, uniforms, first_uniform = _concatenated(draws)
        content = ids
        if self.permute_sentence_ratio > 0:  # pinned is unchanged by the permutation: specials keep their places
            row_ends = np.append(first_uniform[1:], len(uniforms))
            keys = uniforms[(row_ends - n)[:, None] + np.arange(n)]  # each row's last n uniforms (`_draw`)
            content = self._permute_sentences(ids, ends, pinned, keys)
        spans = self._layout_spans(maskable, lengths, drawn, uniforms, first_uniform)
        input_ids, attention_mask = self._infill(content, pinned, spans)
        column = lambda value: np.full((rows, 1), value, dtype=np.int32)
        labels = np.concatenate((column(self.bos_id), ids, column(self.eos_id)), axis=1)
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "decoder_input_ids": np.concatenate((column(self.decoder_start_id), labels[:, :-1]), axis=1),
            "decoder_attention_mask": np.ones((rows, self.max_seq_length), dtype=np.int32),
            "labels": labels,
        }
        if self.document_attention == "isolated":
            out.update(self._segmented(out))
        return out

    def _segmented(self, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The isolated fields of examples `out`: both sides cut after each </s>; label segments the encoder lacks
        (its overflow cut) become padding."""
        segment_ids, positions = segments(after(out["input_ids"] == self.eos_id), out["attention_mask"] > 0)
        decoder_segment_ids, decoder_positions = segments(after(out["labels"] == self.eos_id))
        present = decoder_segment_ids <= segment_ids.max(axis=1, keepdims=True)
        decoder_segment_ids, decoder_positions = decoder_segment_ids * present, decoder_positions * present
        restart = present & (decoder_positions == 0)
        decoder_input_ids = np.where(present, out["decoder_input_ids"], self.pad_id)
        return {
            "decoder_input_ids": np.where(restart, self.decoder_start_id, decoder_input_ids).astype(np.int32),
            "decoder_attention_mask": present.astype(np.int32),
            "labels": np.where(present, out["labels"], IGNORE_INDEX).astype(np.int32),
            **dict(zip(SEGMENT_FIELDS, (segment_ids, positions))),
            **dict(zip(DECODER_SEGMENT_FIELDS, (decoder_segment_ids, decoder_positions))),
        }

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ids, ends, pinned = self._unpack(np.asarray(record)[None])
        draws = [self._draw(rng, int((~pinned).sum()))]
        return {name: rows[0] for name, rows in self._examples(ids, ends, pinned, draws).items()}

    def batch(self, records: np.ndarray, seed: int, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """All rows at once; each row's randomness drawn first from its own generator, as `__call__` draws it."""
        ids, ends, pinned = self._unpack(np.asarray(records))
        maskable = (self.record_length - pinned.sum(axis=1)).tolist()
        draws = [self._draw(rng, n) for rng, n in zip(row_rngs(seed, indices), maskable)]
        return self._examples(ids, ends, pinned, draws)

    def example_spec(self):
        shape = (self.max_seq_length,)
        names = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")
        if self.document_attention == "isolated":
            names += SEGMENT_FIELDS + DECODER_SEGMENT_FIELDS
        return {name: (shape, np.int32) for name in names}


def _concatenated(draws: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Rows' `_draw`s as flat arrays: (lengths, lengths per row, uniforms, each row's first uniform)."""
    drawn = np.array([len(lengths) for lengths, _ in draws])
    sizes = np.array([len(uniforms) for _, uniforms in draws])
    return (
        np.concatenate([lengths for lengths, _ in draws]),
        drawn,
        np.concatenate([uniforms for _, uniforms in draws]),
        np.cumsum(sizes) - sizes,
    )
