"""BART denoising (sentence permutation + text infilling), per example in numpy.

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
import math

import numpy as np

from spmdlm.data.objectives import MAX_SEQ_LENGTH, MLM_PROBABILITY, Flag, Framed, open_unit
from spmdlm.data.sentences import SENTENCE_END

MASK_RATIO = Flag("mask_ratio", float, None, "BART text infilling: fraction of tokens masked (default 0.3)", open_unit,
                  "must be between 0 and 1")
POISSON_LAMBDA = Flag("poisson_lambda", float, 3.0, "BART text infilling: mean span length (Poisson)",
                      lambda value: value > 0, "must be positive")
PERMUTE_SENTENCE_RATIO = Flag("permute_sentence_ratio", float, 1.0, "BART: fraction of sentences permuted",
                              lambda value: 0 <= value <= 1, "must be in [0, 1]")

_ID_BITS = SENTENCE_END - 1


def _ceil(x: float) -> int:
    return math.ceil(round(x, 6))  # round first: 0.35 * 180 is 62.99999999999999 in floating point


@dataclasses.dataclass(frozen=True)
class Denoising(Framed):
    FLAGS = (MAX_SEQ_LENGTH, MLM_PROBABILITY, MASK_RATIO, POISSON_LAMBDA, PERMUTE_SENTENCE_RATIO)
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

    def __post_init__(self):
        # Plain ints keep the objective hashable and cheap to pickle into data workers.
        object.__setattr__(self, "special_ids", tuple(sorted({int(i) for i in self.special_ids})))
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

    def noise_spans(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the infilling spans over n maskable tokens, sorted by start.

        The lengths sum to the budget ceil(mask_ratio * n). A zero-length span inserts a <mask> before token
        `start` (start == n: after the last). Spans never overlap nor pass the end; unless there are more spans
        than gaps between kept tokens (extreme settings only), starts are distinct and spans are kept apart.
        """
        budget = _ceil(self.mask_ratio * n)
        if budget == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        draws, total = [], 0
        while total < budget:  # Poisson lengths until they cover the budget (fairseq draws in batches this size)
            draws.append(rng.poisson(self.poisson_lambda, size=budget))
            total += int(draws[-1].sum())
        lengths = np.concatenate(draws)
        cumulative = np.cumsum(lengths)
        last = int(np.searchsorted(cumulative, budget))  # the first span that reaches the budget...
        lengths = lengths[: last + 1]
        lengths[last] -= cumulative[last] - budget  # ...is trimmed so the total is exactly the budget
        lengths = rng.permutation(lengths)  # or the trimmed (short) span would always come last in the text
        n_spans, n_kept = len(lengths), n - budget
        if n_spans <= n_kept + 1:
            # Each span takes its own gap between two kept tokens (n_kept + 1 gaps, ends included): uniform over
            # layouts with no overlap and no wrap-around, and a kept token between any two spans.
            gaps = np.sort(rng.choice(n_kept + 1, n_spans, replace=False))
        else:
            # More spans than gaps (only at extreme ratios or tiny lambdas): some spans sit back to back.
            gaps = np.sort(rng.choice(n_kept + n_spans, n_spans, replace=False)) - np.arange(n_spans)
        starts = gaps + np.cumsum(lengths) - lengths  # kept tokens before the span + tokens of earlier spans
        return starts, lengths

    def _permute_sentences(self, ids: np.ndarray, ends: np.ndarray, pinned: np.ndarray, rng) -> np.ndarray:
        n = len(ids)
        # Pieces: sentences (cut after each flagged token) and every special on its own, which stays in place.
        cut = np.ones(n, dtype=bool)
        cut[1:] = ends[:-1] | pinned[1:] | pinned[:-1]
        piece_starts = np.flatnonzero(cut)
        piece_lengths = np.diff(np.append(piece_starts, n))
        is_sentence = ~pinned[piece_starts]
        sentences = np.flatnonzero(is_sentence)
        k = _ceil(self.permute_sentence_ratio * len(sentences))
        if k < 2:
            return ids  # shuffling fewer than two sentences changes nothing (and draws nothing from rng)
        chosen = np.sort(rng.choice(sentences, k, replace=False))
        document = np.cumsum(~is_sentence)[chosen]  # specials seen before: shuffle only within a document
        order = np.arange(len(piece_starts))
        order[chosen] = chosen[np.lexsort((rng.random(k), document))]
        lengths = piece_lengths[order]
        gather = np.repeat(piece_starts[order] - (np.cumsum(lengths) - lengths), lengths) + np.arange(n)
        return ids[gather]

    def _infill(self, content: np.ndarray, pinned: np.ndarray, rng) -> np.ndarray:
        maskable = np.flatnonzero(~pinned)
        n = len(maskable)
        starts, lengths = self.noise_spans(n, rng)
        filled = lengths > 0
        span_starts, span_ends = starts[filled], starts[filled] + lengths[filled]
        # Span number of every maskable token (-1: kept): the last span starting at or before it, if it reaches it.
        is_start = np.zeros(n, dtype=bool)
        is_start[span_starts] = True
        span = np.cumsum(is_start) - 1
        inside = np.arange(n) < np.append(span_ends, 0)[span]  # span -1 reads the appended 0: never inside
        span = np.where(inside, span, -1)
        span_at = np.full(len(content), -1)
        span_at[maskable] = span
        # A span's first token becomes <mask>, the rest go. "First" is also the first token after a special inside
        # the span, so a special is never swallowed and each side of it keeps a <mask>.
        first = (span_at >= 0) & (span_at != np.concatenate(([-1], span_at[:-1])))
        emit = (span_at < 0) | first
        out = np.where(first, self.mask_id, content)[emit]
        # Zero-length spans: one <mask> before maskable token `start` (or after the content), placed in `out`.
        before = np.append(maskable, len(content))[starts[~filled]]
        emitted_before = np.concatenate(([0], np.cumsum(emit)))
        return np.insert(out, emitted_before[before], self.mask_id)

    def __call__(self, record: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        record = np.asarray(record)
        if record.shape != (self.record_length,):
            raise ValueError(f"BART record has shape {record.shape}, expected ({self.record_length},)")
        ids = (record & _ID_BITS).astype(np.int32)
        ends = (record & SENTENCE_END) != 0
        pinned = np.isin(ids, self._specials)  # unchanged by the permutation: specials keep their positions
        length = self.max_seq_length

        content = self._permute_sentences(ids, ends, pinned, rng)
        noised = np.concatenate(([self.bos_id], self._infill(content, pinned, rng), [self.eos_id]))
        if len(noised) > length:
            # Insertions can outnumber the tokens that spans saved (many empty or 1-token spans): rare at usual
            # settings. Cut the tail but keep the closing </s>.
            noised = np.concatenate((noised[: length - 1], [self.eos_id]))
        input_ids = np.full(length, self.pad_id, dtype=np.int32)
        input_ids[: len(noised)] = noised
        labels = np.concatenate(([self.bos_id], ids, [self.eos_id])).astype(np.int32)
        return {
            "input_ids": input_ids,
            "attention_mask": (np.arange(length) < len(noised)).astype(np.int32),
            "decoder_input_ids": np.concatenate(([self.decoder_start_id], labels[:-1])).astype(np.int32),
            "decoder_attention_mask": np.ones(length, dtype=np.int32),
            "labels": labels,
        }

    def example_spec(self):
        shape = (self.max_seq_length,)
        names = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")
        return {name: (shape, np.int32) for name in names}
