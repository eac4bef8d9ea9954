"""T5 span corruption: lengths, statistics, exact recoverability, sentinel order, determinism, config checks."""

import numpy as np
import pytest

from spmdlm.families import get_family
from spmdlm.families.t5.objective import (
    SpanCorruption,
    compute_input_and_target_lengths,
    num_noise_spans,
    random_spans_noise_mask,
)

# Google's layout: <extra_id_k> = 32099 - k in a 32100-token vocab.
SENTINELS = tuple(range(32099, 31999, -1))
EOS = 1


def make(inputs_length=512, **kwargs):
    return SpanCorruption(inputs_length=inputs_length, sentinel_ids=SENTINELS, eos_id=EOS, **kwargs)


def random_record(objective, seed, high=32000):
    return np.random.default_rng(seed).integers(0, high, objective.record_length, dtype=np.int32)


def split_at_sentinels(ids, sentinels):
    """Chunks between sentinels (EOS stripped) and the sentinels in the order they appear."""
    is_sentinel = np.isin(ids[:-1], sentinels)
    positions = np.flatnonzero(is_sentinel)
    chunks = np.split(ids[:-1], positions)
    return chunks, ids[:-1][positions]


def reconstruct(example, sentinels=SENTINELS):
    """Put the noise spans from the labels back where their sentinels sit in the inputs."""
    keep_chunks, input_sentinels = split_at_sentinels(example["input_ids"], sentinels)
    noise_chunks, label_sentinels = split_at_sentinels(example["labels"], sentinels)
    assert list(input_sentinels) == list(label_sentinels)
    # inputs split into [keep_0, S0 keep_1, ..., S_last]; labels into [(empty), S0 noise_0, ..., S_last noise_last]
    assert len(noise_chunks[0]) == 0
    out = [keep_chunks[0]]
    for keep, noise in zip(keep_chunks[1:], noise_chunks[1:]):
        out += [noise[1:], keep[1:]]  # drop the sentinel that opens each chunk
    return np.concatenate(out)


@pytest.mark.parametrize(
    "inputs_length, expanded, targets", [(128, 141, 29), (256, 284, 58), (512, 568, 114), (1024, 1137, 229)]
)
def test_length_pairs_match_t5(inputs_length, expanded, targets):
    assert compute_input_and_target_lengths(inputs_length, 0.15, 3.0) == (expanded, targets)
    objective = make(inputs_length)
    assert (objective.record_length, objective.targets_length) == (expanded, targets)


def test_t5_helper_density_half_fixup():
    # T5 shortens the record by one at density 0.5 when the targets would exceed the inputs.
    assert compute_input_and_target_lengths(8, 0.5, 3.0) == (10, 8)


@pytest.mark.parametrize("inputs_length", [3, 16, 64, 100, 128, 512, 1024])
def test_every_example_has_the_static_shapes(inputs_length):
    objective = make(inputs_length)
    spec = objective.example_spec()
    for seed in range(20):
        example = objective(random_record(objective, seed), np.random.default_rng(seed))
        assert set(example) == set(spec)
        for name, (shape, dtype) in spec.items():
            assert example[name].shape == shape and example[name].dtype == dtype
    assert spec["input_ids"][0] == (inputs_length,)


def test_noise_statistics_over_many_examples():
    length, n_examples = 568, 2000
    masks = np.stack([random_spans_noise_mask(length, 0.15, 3.0, np.random.default_rng(i)) for i in range(n_examples)])
    starts = masks & ~np.pad(masks, ((0, 0), (1, 0)))[:, :-1]
    # Counts are fixed by the length: 85 noise tokens in 28 spans in every example.
    assert (masks.sum(1) == 85).all() and (starts.sum(1) == 28).all()
    assert abs(masks.mean() - 0.15) < 0.001
    assert abs(masks.sum() / starts.sum() - 3.0) < 0.05
    # The layout is uniform: away from the ends every position is noise ~15% of the time.
    middle = masks[:, 20:-20].mean(0).reshape(-1, 66).mean(1)  # 8 bins of 66 positions
    assert np.abs(middle - 0.15).max() < 0.01
    # Uniform random split of 85 noise tokens into 28 spans: P(span of length 1) = 27/84.
    ends = masks & ~np.pad(masks, ((0, 0), (0, 1)))[:, 1:]
    span_lengths = np.flatnonzero(ends.reshape(-1)) - np.flatnonzero(starts.reshape(-1)) + 1
    assert abs((span_lengths == 1).mean() - 27 / 84) < 0.01
    # Spans alternate keep/noise, starting with keep and ending with noise.
    assert not masks[:, 0].any() and masks[:, -1].all()


@pytest.mark.parametrize("inputs_length", [16, 128, 512])
def test_inputs_and_labels_reconstruct_the_record(inputs_length):
    objective = make(inputs_length)
    for seed in range(50):
        record = random_record(objective, seed)
        np.testing.assert_array_equal(reconstruct(objective(record, np.random.default_rng(seed))), record)


def test_sentinels_are_used_in_order():
    objective = make(512)
    example = objective(random_record(objective, 0), np.random.default_rng(0))
    n_spans = num_noise_spans(objective.record_length, 0.15, 3.0)
    expected = list(SENTINELS[:n_spans])  # <extra_id_0>, <extra_id_1>, ...
    assert list(split_at_sentinels(example["input_ids"], SENTINELS)[1]) == expected
    assert list(split_at_sentinels(example["labels"], SENTINELS)[1]) == expected
    assert example["labels"][0] == SENTINELS[0]
    assert example["input_ids"][-1] == EOS and example["labels"][-1] == EOS


def test_real_token_id_zero_survives():
    # transformers#12755: a `> 0` filter deleted real id 0 and broke the shapes.
    objective = make(128)
    for seed in range(20):
        record = random_record(objective, seed, high=3)  # mostly 0, 1, 2
        example = objective(record, np.random.default_rng(seed))
        assert example["input_ids"].shape == (128,)
        np.testing.assert_array_equal(reconstruct(example), record)


def test_same_rng_same_example_different_rng_different_mask():
    objective = make(512)
    record = random_record(objective, 0)
    first = objective(record, np.random.default_rng(123))
    again = objective(record, np.random.default_rng(123))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    inputs = {objective(record, np.random.default_rng(seed))["input_ids"].tobytes() for seed in range(20)}
    assert len(inputs) == 20


@pytest.mark.parametrize("start", [0, 7])
def test_decoder_input_ids_are_labels_shifted_right(start):
    objective = make(128, decoder_start_id=start)
    example = objective(random_record(objective, 0), np.random.default_rng(0))
    np.testing.assert_array_equal(example["decoder_input_ids"], np.concatenate(([start], example["labels"][:-1])))


def test_too_few_sentinels_fails_at_config_time():
    assert num_noise_spans(1137, 0.15, 3.0) == 57
    with pytest.raises(ValueError, match="57 noise spans.*50 sentinels.*--max_seq_length"):
        SpanCorruption(inputs_length=1024, sentinel_ids=SENTINELS[:50], eos_id=EOS)
    SpanCorruption(inputs_length=1024, sentinel_ids=SENTINELS[:57], eos_id=EOS)  # exactly enough


def test_high_density_keeps_exact_lengths():
    # At 0.5 / mean 1 an odd record has one more noise token than kept ones: without min(n_noise, n_keep) there
    # would be more noise spans than kept tokens to separate them.
    objective = make(127, noise_density=0.5, mean_noise_span_length=1.0)
    assert (objective.record_length, objective.targets_length) == (127, 128)
    assert num_noise_spans(127, 0.5, 1.0) == 63
    for seed in range(20):
        record = random_record(objective, seed)
        example = objective(record, np.random.default_rng(seed))
        assert example["input_ids"].shape == (127,) and example["labels"].shape == (128,)
        np.testing.assert_array_equal(reconstruct(example), record)


@pytest.mark.parametrize("density", [0.05, 0.15, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("mean", [1.0, 3.0])
def test_mask_counts_for_all_small_lengths(density, mean):
    rng = np.random.default_rng(0)
    for length in range(2, 80):
        mask = random_spans_noise_mask(length, density, mean, rng)
        n_noise = mask.sum()
        assert mask.shape == (length,) and 1 <= n_noise <= length - 1
        assert not mask[0] and mask[-1]
        n_spans = (mask & ~np.concatenate(([False], mask[:-1]))).sum()
        assert n_spans == num_noise_spans(length, density, mean)


def test_unreachable_input_length_is_explained():
    # At 0.5 / mean 1 the corrupted input jumps from 127 to 129 tokens.
    with pytest.raises(ValueError, match="exactly 128 input tokens.*--max_seq_length"):
        make(128, noise_density=0.5, mean_noise_span_length=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_density=0.0), "noise_density"),
        (dict(noise_density=1.0), "noise_density"),
        (dict(mean_noise_span_length=0.5), "mean_noise_span_length"),
        (dict(inputs_length=2), "too short"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**{"inputs_length": 128, **kwargs})


def test_wrong_record_length_is_rejected():
    objective = make(128)
    with pytest.raises(ValueError, match=r"expected \(141,\)"):
        objective(np.zeros(140, np.int32), np.random.default_rng(0))


def test_with_a_trained_tokenizer():
    from spmdlm.data.tokenization import sentinel_ids, special_token_ids, train_tokenizer

    texts = [f"sentence {i} about apples, pears and {i * 7} plums." for i in range(200)]
    tok = train_tokenizer(get_family("t5"), texts, vocab_size=200)
    objective = SpanCorruption(64, tuple(sentinel_ids(tok)), special_token_ids(tok, get_family("t5"))["eos"])
    record = np.array(tok.encode(" ".join(texts), add_special_tokens=False).ids[: objective.record_length])
    example = objective(record, np.random.default_rng(0))
    assert tok.id_to_token(int(example["labels"][0])) == "<extra_id_0>"
    assert tok.id_to_token(int(example["input_ids"][-1])) == "</s>"
    np.testing.assert_array_equal(reconstruct(example, tuple(sentinel_ids(tok))), record)
