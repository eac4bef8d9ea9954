"""BART denoising: mask budget, span statistics, one <mask> per span, framing, sentence permutation, splitter."""

import collections
import math

import numpy as np
import pytest

from spmdlm.data.objectives import example_rng, padding_example
from spmdlm.data.sentences import SENTENCE_END, mark_sentence_ends, sentence_ends
from spmdlm.families.bart.objective import Denoising

# BART's layout: <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4; the decoder starts with </s>.
BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 4
SPECIALS = (BOS, PAD, EOS, UNK, MASK)
N_EXAMPLES = 2000


def make(max_seq_length=128, **kwargs):
    return Denoising(max_seq_length, BOS, EOS, PAD, MASK, decoder_start_id=EOS, special_ids=SPECIALS, **kwargs)


def rng_for(seed, index):
    return np.random.default_rng([seed, index])  # how the pipeline keys an example


def distinct_record(objective, seed, mean_sentence=12):
    """Record of distinct content ids (so every output token can be traced back) with random sentence ends."""
    rng = np.random.default_rng([seed, 999])
    ids = (rng.permutation(objective.record_length) + 10).astype(np.int32)
    ends = rng.random(objective.record_length) < 1 / mean_sentence
    return ids | np.where(ends, SENTENCE_END, 0).astype(np.int32)


def content(example):
    """input_ids between <s> and </s>, checking the framing and the padding on the way."""
    inputs, attention = example["input_ids"], example["attention_mask"]
    n = int(attention.sum())
    assert (attention[:n] == 1).all() and (inputs[n:] == PAD).all()
    assert inputs[0] == BOS and inputs[n - 1] == EOS
    return inputs[1 : n - 1]


def observed_spans(example, ids):
    """(starts, lengths) of the spans read back from input_ids alone, when nothing was permuted.

    ids are distinct, so each kept token's original position is known; a <mask> stands for the original tokens
    between the kept tokens on either side of it (possibly none).
    """
    noised = content(example)
    position = np.full(ids.max() + 1, -1)
    position[ids] = np.arange(len(ids))
    is_mask = noised == MASK
    assert not (is_mask[1:] & is_mask[:-1]).any(), "adjacent masks: spans are not kept apart"
    kept = position[noised[~is_mask]]
    assert (kept >= 0).all() and (np.diff(kept) > 0).all(), "kept tokens changed or moved"
    before = np.maximum.accumulate(np.where(is_mask, -1, position[np.where(is_mask, 0, noised)]))
    after = np.minimum.accumulate(np.where(is_mask, len(ids), position[np.where(is_mask, 0, noised)])[::-1])[::-1]
    starts = before[is_mask] + 1
    return starts, after[is_mask] - starts


def poisson_pmf(k, lam):
    return math.exp(-lam) * lam**k / math.factorial(k)


def trimmed_span_histogram(budget, lam, top):
    """Expected share of each span length (0..top) when Poisson(lam) lengths are drawn until their sum reaches
    `budget` and the last is trimmed to fit: the true target of the sampler, worked out exactly (renewal sums).

    visits[s]: expected number of draws made while the running sum is s (< budget); a zero draw stays at s.
    """
    pmf = [poisson_pmf(k, lam) for k in range(budget + top + 2)]
    visits = []
    for s in range(budget):
        visits.append(((s == 0) + sum(visits[j] * pmf[s - j] for j in range(s))) / (1 - pmf[0]))
    counts = [0.0] * (budget + 1)
    for s in range(budget):
        for k in range(budget - s):  # draws that stay below the budget keep their length
            counts[k] += visits[s] * pmf[k]
        counts[budget - s] += visits[s] * (1 - sum(pmf[: budget - s]))  # the one that reaches it is trimmed
    counts = np.array(counts)
    return counts[: top + 1] / counts.sum()


@pytest.mark.slow
def test_mask_budget_spans_and_histogram():
    objective = make(128, permute_sentence_ratio=0.0)
    n = objective.record_length  # 126 maskable tokens: budget ceil(0.3 * 126) = 38
    masked, all_lengths = [], []
    for index in range(N_EXAMPLES):
        record = distinct_record(objective, index)
        example = objective(record, rng_for(0, index))
        starts, lengths = observed_spans(example, record & (SENTENCE_END - 1))
        # The helper gives the same layout from the same rng: one <mask> per span, nothing else changed.
        expected_starts, expected_lengths = objective.noise_spans(n, rng_for(0, index))
        np.testing.assert_array_equal(starts, expected_starts)
        np.testing.assert_array_equal(lengths, expected_lengths)
        assert (np.diff(starts) > 0).all() and (starts + lengths <= n).all()  # distinct, no wrap-around
        masked.append(lengths.sum() / n)
        all_lengths.append(lengths)
    fraction = float(np.mean(masked))
    print(f"masked fraction {fraction:.4f}")
    assert abs(fraction - 0.3) < 0.01
    assert np.allclose(masked, 38 / 126)  # the budget is per example, not shared across a batch

    lengths = np.concatenate(all_lengths)
    histogram = np.bincount(lengths, minlength=11)[:11] / len(lengths)
    pmf = np.array([poisson_pmf(k, 3.0) for k in range(11)])
    expected = trimmed_span_histogram(38, 3.0, 10)
    vs_pmf, vs_expected = np.abs(histogram - pmf), np.abs(histogram - expected)
    print(
        f"{len(lengths)} spans, mean length {lengths.mean():.3f}; largest bin difference vs Poisson(3) "
        f"{vs_pmf.max():.4f} at length {vs_pmf.argmax()}, vs the trimmed sampler {vs_expected.max():.4f}"
    )
    # Not exactly Poisson(3): in each example the span that reaches the budget is trimmed (1 of ~13 spans), which
    # moves mass to short lengths: +0.020 at length 1, +0.009 at 2, -0.008 at 4 and 5 (exact, from
    # trimmed_span_histogram). Sampling noise over ~26k spans is ~0.003 per bin. Hence 0.03 against the pmf, which
    # only catches gross errors (lambda 3.5 still passes it, at 0.027), and a tight 0.01 against the exact trimmed
    # target, which lambda 2.5 or 3.5 misses by 0.05 and 0.04.
    assert vs_pmf.max() < 0.03
    assert vs_expected.max() < 0.01
    assert abs(lengths.mean() - 38 / 13.17) < 0.05  # 38 tokens in 13.17 spans on average (exact value)


def test_framing_shapes_and_decoder_inputs():
    objective = make(128)
    spec = objective.example_spec()
    assert set(spec) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    for index in range(200):
        record = distinct_record(objective, index)
        example = objective(record, rng_for(1, index))
        for name, (shape, dtype) in spec.items():
            assert example[name].shape == shape and example[name].dtype == dtype
        labels = example["labels"]
        np.testing.assert_array_equal(labels, np.concatenate(([BOS], record & (SENTENCE_END - 1), [EOS])))
        np.testing.assert_array_equal(example["decoder_input_ids"], np.concatenate(([EOS], labels[:-1])))
        assert (example["decoder_attention_mask"] == 1).all()
        noised = content(example)  # <s> first, </s> last, pad after
        assert not np.isin(noised, [BOS, EOS, PAD]).any()  # no special moved into the content
        # Everything not masked is content from the record; masking never adds a real token.
        assert np.isin(noised[noised != MASK], labels[1:-1]).all()
    assert set(padding_example(objective)) == set(spec)


def sentences_of(ids, ends):
    cut = np.flatnonzero(ends[:-1]) + 1
    return [tuple(s) for s in np.split(ids, cut)]


def test_permutation_keeps_the_sentences():
    objective = make(128, mask_ratio=0.0, permute_sentence_ratio=1.0)
    reordered = 0
    for index in range(300):
        record = distinct_record(objective, index)
        ids, ends = record & (SENTENCE_END - 1), (record & SENTENCE_END) != 0
        noised = content(objective(record, rng_for(2, index)))
        assert len(noised) == len(ids)
        original = sentences_of(ids, ends)
        first_tokens = [s[0] for s in original]
        permuted = [tuple(s) for s in np.split(noised, np.flatnonzero(np.isin(noised, first_tokens))[1:])]
        assert sorted(permuted) == sorted(original)  # the multiset of sentences, each intact
        reordered += permuted != original
    assert reordered > 290  # ~10 sentences per record: almost always a new order


def test_partial_permutation_moves_at_most_its_share():
    objective = make(128, mask_ratio=0.0, permute_sentence_ratio=0.5)
    for index in range(200):
        record = distinct_record(objective, index)
        ids, ends = record & (SENTENCE_END - 1), (record & SENTENCE_END) != 0
        original = sentences_of(ids, ends)
        noised = content(objective(record, rng_for(3, index)))
        permuted = [tuple(s) for s in np.split(noised, np.flatnonzero(np.isin(noised, [s[0] for s in original]))[1:])]
        assert sorted(permuted) == sorted(original)
        assert sum(a != b for a, b in zip(permuted, original)) <= math.ceil(len(original) / 2)


def test_specials_inside_the_content_stay_put():
    # Documents joined by </s>: separators keep their positions, sentences never cross them, none is masked.
    objective = make(128, mask_ratio=0.0)
    for index in range(100):
        record = distinct_record(objective, index)
        separators = np.sort(np.random.default_rng(index).choice(objective.record_length, 4, replace=False))
        record[separators] = EOS
        noised = content(objective(record, rng_for(4, index)))
        np.testing.assert_array_equal(np.flatnonzero(noised == EOS), separators)
        documents = np.split(record & (SENTENCE_END - 1), separators)
        for before, after in zip(documents, np.split(noised, separators)):
            assert sorted(before) == sorted(after)  # only shuffled within its own document
    masking = make(128)
    for index in range(200):
        record = distinct_record(masking, index)
        record[[0, 40, 41, 125]] = [UNK, EOS, EOS, EOS]
        noised = content(masking(record, rng_for(5, index)))
        assert (noised == EOS).sum() == 3 and (noised == UNK).sum() == 1


def test_tiny_mask_ratio_keeps_sentences_and_framing():
    objective = make(128, mask_ratio=1e-3, permute_sentence_ratio=1.0)  # budget: ceil(0.126) = 1 token
    exactly_one_missing = 0
    for index in range(300):
        record = distinct_record(objective, index)
        ids, ends = record & (SENTENCE_END - 1), (record & SENTENCE_END) != 0
        noised = content(objective(record, rng_for(6, index)))  # <s> ... </s> framing checked here
        sentence = np.cumsum(np.concatenate(([0], ends[:-1])))  # sentence number of every content token
        position = np.full(ids.max() + 1, -1)
        position[ids] = np.arange(len(ids))
        kept = position[noised[noised != MASK]]
        assert (kept >= 0).all()
        runs = sentence[kept]
        run_starts = np.concatenate(([0], np.flatnonzero(np.diff(runs)) + 1))
        assert len(set(runs[run_starts])) == len(run_starts)  # every sentence in one piece
        steps = np.diff(kept)[np.diff(runs) == 0]
        assert (steps >= 1).all() and (steps - 1).sum() <= 1  # in order, at most the one masked token skipped
        # One token masked. A zero-length span (~5%) adds a <mask> that makes the input one token too long, and
        # the truncation then drops the last content token too.
        missing = len(ids) - len(kept)
        assert 1 <= missing <= 1 + (noised == MASK).sum()
        exactly_one_missing += missing == 1
    assert exactly_one_missing >= 0.9 * 300


def test_deterministic_per_seed_and_index():
    objective = make(128)
    record = distinct_record(objective, 0)
    first, again = objective(record, rng_for(7, 3)), objective(record, rng_for(7, 3))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    inputs = {objective(record, rng_for(7, index))["input_ids"].tobytes() for index in range(50)}
    assert len(inputs) == 50
    assert objective(record, rng_for(8, 3))["input_ids"].tobytes() != first["input_ids"].tobytes()


def test_many_insertions_are_truncated_keeping_eos():
    # Tiny lambda: mostly zero-length spans, so insertions outgrow the record and spans sit back to back.
    objective = make(64, poisson_lambda=0.05)
    for index in range(50):
        example = objective(distinct_record(objective, index), rng_for(9, index))
        assert example["input_ids"].shape == (64,) and example["attention_mask"].all()
        assert example["input_ids"][0] == BOS and example["input_ids"][-1] == EOS


@pytest.mark.parametrize("n", [0, 1, 2, 7, 126, 1022])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_noise_spans_cover_exactly_the_budget(n, ratio):
    objective = make(max(n + 2, 3), mask_ratio=ratio)
    for index in range(20):
        starts, lengths = objective.noise_spans(n, rng_for(10, index))
        assert lengths.sum() == math.ceil(round(ratio * n, 6))
        assert (starts >= 0).all() and (starts + lengths <= n).all() and (np.diff(starts) >= 0).all()
        assert (starts[1:] >= (starts + lengths)[:-1]).all()  # no overlap


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mask_ratio=1.5), "mask_ratio"),
        (dict(permute_sentence_ratio=-0.1), "permute_sentence_ratio"),
        (dict(poisson_lambda=0.0), "poisson_lambda"),
        (dict(max_seq_length=2), "max_seq_length"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**{"max_seq_length": 128, **kwargs})
    with pytest.raises(ValueError, match="mask_id"):
        Denoising(128, BOS, EOS, PAD, 99, EOS, SPECIALS)
    with pytest.raises(ValueError, match=r"expected \(126,\)"):
        make(128)(np.zeros(127, np.int32), np.random.default_rng(0))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("One. Two! Three?", ["One.", " Two!", " Three?"]),
        ("Line one\nLine two", ["Line one", "\nLine two"]),
        ("Para.\n\nnext para", ["Para.", "\n\nnext para"]),
        ("Really?! Yes... Sure.", ["Really?!", " Yes...", " Sure."]),
        ('He said "Stop." Then left.', ['He said "Stop."', " Then left."]),
        ("(It was late.) After that", ["(It was late.)", " After that"]),
        ("See e.g. this case. Done", ["See e.g. this case.", " Done"]),
        ("Pi is 3.14 roughly. Yes", ["Pi is 3.14 roughly.", " Yes"]),
        ("Trailing text without punctuation", ["Trailing text without punctuation"]),
        ("Ends with space. \n", ["Ends with space. \n"]),
        ("  \n ", []),
        ("", []),
    ],
)
def test_sentence_ends(text, expected):
    ends = sentence_ends(text)
    assert [text[a:b] for a, b in zip([0] + ends[:-1], ends)] == expected
    if text.strip():
        assert ends[-1] == len(text)


def test_mark_sentence_ends():
    text = "Hi there. Bye!\nOk"
    assert sentence_ends(text) == [9, 14, 17]
    # Hand-made byte-level-BPE-like offsets: "Hi", " there", ".", " Bye", "!", "\n", "Ok"
    offsets = [(0, 2), (2, 8), (8, 9), (9, 13), (13, 14), (14, 15), (15, 17)]
    np.testing.assert_array_equal(
        mark_sentence_ends(offsets, sentence_ends(text)), [False, False, True, False, True, False, True]
    )
    # A token straddling a boundary (a merged '."') belongs to the sentence it starts in.
    assert mark_sentence_ends([(0, 3), (3, 5), (5, 9)], [4, 9]).tolist() == [False, True, True]
    assert mark_sentence_ends([], [5]).shape == (0,)


@pytest.mark.parametrize(
    "max_seq_length, mask_ratio, poisson_lambda, permute_sentence_ratio",
    [
        (128, 0.3, 3.0, 1.0),  # the defaults
        (40, 0.3, 0.05, 0.5),  # mostly empty spans: more spans than gaps, insertions overflow
        (40, 1.0, 3.0, 1.0),  # everything masked
        (40, 1e-3, 12.0, 0.0),  # one token, nothing permuted
        (3, 0.3, 3.0, 1.0),  # a one-token record
    ],
)
def test_a_batch_is_its_examples_one_by_one(max_seq_length, mask_ratio, poisson_lambda, permute_sentence_ratio):
    # All rows are computed at once; each must still be its own example, whatever its neighbours.
    objective = make(
        max_seq_length,
        mask_ratio=mask_ratio,
        poisson_lambda=poisson_lambda,
        permute_sentence_ratio=permute_sentence_ratio,
    )
    records = np.stack([distinct_record(objective, index, mean_sentence=4) for index in range(8)])
    records[1, ::3] = EOS  # documents
    records[2] = UNK  # nothing maskable
    records[3, [0, -1]] = [EOS, UNK]  # at both edges
    indices = np.array([5, 0, 17, 3, 10**12, 8, 1, 2])
    batch = objective.batch(records, 12, indices)
    for row, (record, index) in enumerate(zip(records, indices)):
        one = objective(record, example_rng(12, index))
        for name in one:
            np.testing.assert_array_equal(batch[name][row], one[name], err_msg=f"{name} of row {row}")
    np.testing.assert_array_equal(content(batch_row(batch, 2)), records[2])  # specials only: left as they are


def batch_row(batch, row):
    return {name: rows[row] for name, rows in batch.items()}


@pytest.mark.slow
def test_sentence_orders_are_uniform_within_each_document():
    objective = make(12, mask_ratio=0.0)
    # Three sentences, a separator, two sentences: 3! x 2! = 12 orders, the separator in place.
    record = np.array([10, 11 | SENTENCE_END, 12, 13 | SENTENCE_END, 14, 15, EOS, 16, 17 | SENTENCE_END, 18], np.int32)
    orders = [tuple(content(objective(record, rng_for(13, index)))) for index in range(6000)]
    assert all(order[6] == EOS for order in orders)
    counts = np.array(sorted(collections.Counter(orders).values()))
    assert len(counts) == 12 and counts.min() > 420 and counts.max() < 580  # 500 expected, sd ~21
