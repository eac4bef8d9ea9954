"""RoBERTa masked LM: 80/10/10 statistics, what may be chosen, framing, real id 0, determinism, config checks."""

import dataclasses

import numpy as np
import pytest

from spmdlm.data.objectives import IGNORE_INDEX, padding_example
from spmdlm.data.objectives.mlm import MaskedLM

# RoBERTa's layout: <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4.
BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 4
SPECIALS = (BOS, PAD, EOS, UNK, MASK)
VOCAB = 1000


def make(max_seq_length=512, **kwargs):
    settings = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, mask_id=MASK, special_ids=SPECIALS, vocab_size=VOCAB)
    return MaskedLM(max_seq_length=max_seq_length, **{**settings, **kwargs})


def rng_for(seed, index):
    return np.random.default_rng([seed, index])  # how the pipeline keys every example


def content(objective, index, low=len(SPECIALS), high=VOCAB):
    return np.random.default_rng([7, index]).integers(low, high, objective.record_length, dtype=np.int32)


def framed(objective, record):
    """The unmasked input: <s> content </s> then padding, content = leading non-pad tokens in line_by_line."""
    is_pad = record == objective.pad_id
    n = int(np.argmax(is_pad)) if objective.line_by_line and is_pad.any() else len(record)
    out = np.full(objective.max_seq_length, objective.pad_id, np.int32)
    out[0], out[1 : n + 1], out[n + 1] = objective.bos_id, record[:n], objective.eos_id
    return out, n


def check_example(objective, record, example):
    """Invariants of every example; returns (original, chosen) for further checks."""
    for name, (shape, dtype) in objective.example_spec().items():
        assert example[name].shape == shape and example[name].dtype == dtype
    original, n = framed(objective, record)
    input_ids, labels = example["input_ids"], example["labels"]
    chosen = labels != IGNORE_INDEX
    np.testing.assert_array_equal(example["attention_mask"], np.arange(objective.max_seq_length) < n + 2)
    assert not np.isin(original[chosen], objective.special_ids).any()  # bos/eos/pad/separators never chosen
    np.testing.assert_array_equal(labels[chosen], original[chosen])
    np.testing.assert_array_equal(input_ids[~chosen], original[~chosen])  # framing and padding untouched
    replaced = chosen & (input_ids != original) & (input_ids != objective.mask_id)
    assert not np.isin(input_ids[replaced], objective.special_ids).any()
    assert ((input_ids >= 0) & (input_ids < objective.vocab_size)).all()
    return original, chosen


def test_masking_statistics():
    objective = make(512)
    n_records = 400  # 400 x 510 = 204,000 maskable tokens
    totals = dict(maskable=0, chosen=0, mask=0, random=0, unchanged=0)
    for index in range(n_records):
        record = content(objective, index)
        example = objective(record, rng_for(0, index))
        original, chosen = check_example(objective, record, example)
        input_ids = example["input_ids"]
        totals["maskable"] += objective.record_length
        totals["chosen"] += chosen.sum()
        totals["mask"] += (chosen & (input_ids == MASK)).sum()
        totals["random"] += (chosen & (input_ids != MASK) & (input_ids != original)).sum()
        totals["unchanged"] += (chosen & (input_ids == original)).sum()
    chosen = totals["chosen"]
    assert abs(chosen / totals["maskable"] - 0.15) < 0.005
    # A random draw equals the original with probability 1/995 (uniform over the 995 non-special ids), so it then
    # looks unchanged: 0.1 * 994/995 of the chosen look random, 0.1 + 0.1/995 look unchanged.
    n_drawable = VOCAB - len(SPECIALS)
    assert abs(totals["mask"] / chosen - 0.8) < 0.01
    assert abs(totals["random"] / chosen - 0.1 * (n_drawable - 1) / n_drawable) < 0.01
    assert abs(totals["unchanged"] / chosen - (0.1 + 0.1 / n_drawable)) < 0.01


def test_random_replacements_are_uniform_over_non_special_ids():
    # Specials scattered through a 10-id vocab: only 1, 4, 5, 6 and 8 may be drawn.
    objective = MaskedLM(512, bos_id=0, eos_id=3, pad_id=2, mask_id=7, special_ids=(0, 2, 3, 7, 9), vocab_size=10)
    draws = []
    for index in range(200):
        record = np.full(objective.record_length, 5, np.int32)
        example = objective(record, rng_for(0, index))
        check_example(objective, record, example)
        chosen = example["labels"] != IGNORE_INDEX
        draws.append(example["input_ids"][chosen & (example["input_ids"] != 7)])
    draws = np.concatenate(draws)  # random replacements plus the unchanged tokens (id 5)
    counts = {int(i): int((draws == i).sum()) for i in np.unique(draws)}
    assert set(counts) == {1, 4, 5, 6, 8}
    random_counts = np.array([counts[i] for i in (1, 4, 6, 8)])
    # Each non-special id gets 1/5 of the random draws; id 5 also has the unchanged 10% on top.
    assert np.abs(random_counts / random_counts.mean() - 1).max() < 0.25
    assert abs(counts[5] / random_counts.mean() - 6) < 1.0  # (0.1 + 0.1/5) / (0.1/5) = 6


def test_special_ids_inside_grouped_records_are_never_chosen():
    # Grouped records hold document separators and other specials: they must stay as they are.
    objective = make(128)
    for index in range(200):
        record = content(objective, index, low=0, high=12)  # ~40% specials
        example = objective(record, rng_for(1, index))
        original, chosen = check_example(objective, record, example)
        is_special = np.isin(original, SPECIALS)
        assert not chosen[is_special].any()
        np.testing.assert_array_equal(example["input_ids"][is_special], original[is_special])
        assert example["input_ids"][0] == BOS and example["input_ids"][-1] == EOS
        assert example["attention_mask"].all()


@pytest.mark.parametrize("n_content", [0, 1, 5, 60, 126])
def test_line_by_line_frames_and_pads_each_line(n_content):
    objective = make(128, line_by_line=True)
    any_chosen = False
    for index in range(100):
        record = content(objective, index)
        record[n_content:] = PAD
        example = objective(record, rng_for(2, index))
        _, chosen = check_example(objective, record, example)
        any_chosen |= chosen.any()
        input_ids = example["input_ids"]
        assert input_ids[0] == BOS and input_ids[n_content + 1] == EOS
        assert (input_ids[n_content + 2 :] == PAD).all()
        assert example["attention_mask"].sum() == n_content + 2 and not example["attention_mask"][n_content + 2 :].any()
        assert not chosen[0] and not chosen[n_content + 1 :].any()  # framing and padding never chosen
    assert any_chosen == (n_content > 0)


def test_grouped_mode_does_not_treat_pad_as_end_of_content():
    # Only line_by_line reads pad as the end of a line; grouped records are all content.
    objective = make(16)
    record = np.arange(10, 10 + objective.record_length, dtype=np.int32)
    record[3] = PAD
    example = objective(record, rng_for(0, 0))
    check_example(objective, record, example)
    assert example["attention_mask"].all() and example["input_ids"][-1] == EOS


def test_real_token_id_zero_is_masked_and_labelled():
    # A layout where id 0 is a normal token (specials 1..5): `labels > 0` filters would drop it.
    objective = MaskedLM(64, bos_id=1, eos_id=3, pad_id=2, mask_id=5, special_ids=(1, 2, 3, 4, 5), vocab_size=VOCAB)
    for line_by_line in (False, True):
        objective = dataclasses.replace(objective, line_by_line=line_by_line)
        n_chosen = 0
        for index in range(50):
            record = np.zeros(objective.record_length, np.int32)
            record[40:] = 2 if line_by_line else 0  # in line_by_line, a 40-token line of zeros
            example = objective(record, rng_for(3, index))
            _, chosen = check_example(objective, record, example)
            assert (example["labels"][chosen] == 0).all()
            n_chosen += chosen.sum()
        assert n_chosen > 100


def test_same_seed_and_index_give_the_same_example():
    objective = make(512)
    record = content(objective, 0)
    first = objective(record, rng_for(42, 9))
    again = objective(record, rng_for(42, 9))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    by_index = {objective(record, rng_for(42, index))["input_ids"].tobytes() for index in range(20)}
    by_seed = {objective(record, rng_for(seed, 9))["input_ids"].tobytes() for seed in range(20)}
    assert len(by_index) == 20 and len(by_seed) == 20


def test_padding_example_carries_no_loss():
    objective = make(32)
    example = padding_example(objective)
    assert (example["labels"] == IGNORE_INDEX).all() and not example["attention_mask"].any()
    assert example["input_ids"].shape == (32,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_seq_length=2), "max_seq_length"),
        (dict(mlm_probability=0.0), "mlm_probability"),
        (dict(mlm_probability=1.0), "mlm_probability"),
        (dict(mask_id=999), "mask_id"),
        (dict(bos_id=999), "bos_id"),
        (dict(special_ids=(BOS, PAD, EOS, UNK)), "mask_id"),
        (dict(special_ids=SPECIALS + (VOCAB,)), "vocab_size"),
        (dict(vocab_size=5), "vocab_size"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_wrong_record_length_is_rejected():
    with pytest.raises(ValueError, match=r"expected \(126,\)"):
        make(128)(np.zeros(128, np.int32), np.random.default_rng(0))
