"""MLM --packing (line_by_line lines packed best-fit decreasing into full records, each line a segment) and
--document_attention isolated (grouped blocks, each document a segment): preparation, objective, errors, cache keys."""

import collections
import hashlib
import json

import numpy as np
import pytest

from spmdlm.data import records, token_cache
from spmdlm.data.datasets import open_dataset
from spmdlm.data.objectives import IGNORE_INDEX, SEGMENT_FIELDS, example_rng, padding_example
from spmdlm.data.objectives.mlm import MaskedLM
from spmdlm.data.tokenization import save_tokenizer, special_token_ids, train_tokenizer
from spmdlm.errors import DataError
from spmdlm.families import get_family
from spmdlm.prepare import main

BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 4  # RoBERTa's layout
SPECIALS = (BOS, PAD, EOS, UNK, MASK)
LENGTH = 64  # --max_seq_length of the preparation tests

_RNG = np.random.default_rng(5)
_WORDS = [f"w{i}" for i in range(300)] + ["café", "Привет"]
# short lines (2-12 words), a few too long for one example (truncated)
LINES = [" ".join(_RNG.choice(_WORDS, _RNG.integers(2, 13))) for _ in range(1100)]
LINES[::97] = [" ".join(_RNG.choice(_WORDS, 90)) for _ in LINES[::97]]


def make(max_seq_length=32, **kwargs):
    return MaskedLM(
        max_seq_length, bos_id=BOS, eos_id=EOS, pad_id=PAD, mask_id=MASK, special_ids=SPECIALS, vocab_size=500, **kwargs
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    family = get_family("roberta")
    tok = train_tokenizer(family, LINES[:400], 500)
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, folder, family, model_max_length=512)
    return tok, folder


def cut(tok, mode, length=LENGTH):
    ids = special_token_ids(tok, get_family("roberta"))
    return records.Cut(length, ids["eos"], mode, ids["pad"], bos_id=ids["bos"])


def tokenized(tok, mode, length=LENGTH, documents=LINES):
    """(records, stats) of `documents` prepared in one process."""
    sink = records.RecordShards(lambda i: None)
    rows = []
    sink.write = rows.append  # in memory: the rows as the cutter writes them
    stats = records.tokenize_into(documents, tok, {"train": sink}, cut(tok, mode, length))["train"]
    return np.concatenate(rows), stats


# -- preparation ------------------------------------------------------------------------------------------------------


def test_best_fit_decreasing_puts_each_item_where_it_leaves_least_room():
    # 7 opens bin 0 (room 3), 5 opens bin 1 (room 5), 4 -> bin 1 (room 1), 3 -> bin 0 (full), 2 fits nowhere.
    assert records.best_fit_decreasing([5, 3, 7, 2, 4], 10) == [[1, 2], [0, 4], [3]]
    assert records.best_fit_decreasing([4, 4, 4], 4) == [[0], [1], [2]]  # ties: input order
    assert records.best_fit_decreasing([], 8) == []


def test_every_line_appears_once_framed_and_records_are_full_length(tokenizer):
    tok, _ = tokenizer
    rows, stats = tokenized(tok, "packed_lines")
    assert rows.shape == (stats.examples, LENGTH) and rows.dtype == np.int32
    expected = collections.Counter()
    for line in LINES:
        ids = tok.encode(line, add_special_tokens=False).ids[: LENGTH - 2]
        expected[(BOS, *ids, EOS)] += 1
    found = collections.Counter()
    for row in rows:
        n = int((row != PAD).sum())
        assert (row[n:] == PAD).all() and row[0] == BOS  # lines packed from the start, padding at the end
        starts = np.flatnonzero(row[:n] == BOS).tolist() + [n]
        for begin, end in zip(starts, starts[1:]):
            assert row[end - 1] == EOS
            found[tuple(row[begin:end].tolist())] += 1
    assert found == expected
    truncated = sum(max(0, len(tok.encode(line, add_special_tokens=False).ids) - (LENGTH - 2)) for line in LINES)
    assert stats.tokens_dropped == truncated > 0 and stats.documents == len(LINES)
    assert stats.tokens == sum(len(k) * v for k, v in expected.items())
    assert stats.pad_tokens == rows.size - stats.tokens == int((rows == PAD).sum())


def test_packing_cuts_padding_on_short_lines(tokenizer):
    tok, _ = tokenizer
    _, lines = tokenized(tok, "lines", LENGTH - 2)
    _, packed = tokenized(tok, "packed_lines")
    assert lines.examples == len(LINES) and packed.examples < lines.examples / 3
    assert lines.padding_fraction(LENGTH - 2) > 0.6 and packed.padding_fraction(LENGTH) < 0.05


def prepare(out, folder, *flags, workers=1):
    return main(
        [
            "--tokenizer",
            str(folder),
            "--for_model",
            "roberta",
            "--max_seq_length",
            str(LENGTH),
            "--out",
            str(out),
            "--workers",
            str(workers),
            "--shard_size",
            "4K",
            *flags,
            str(out.parent / "c.txt"),
        ]
    )


def test_packed_dataset_is_the_same_bytes_for_one_or_two_workers_and_refused_unpacked(tokenizer, tmp_path):
    tok, folder = tokenizer
    (tmp_path / "c.txt").write_text("\n".join(LINES) + "\n")
    assert len(list(records._chunks(LINES))) > 1  # several chunks: their boundaries must not depend on workers
    assert prepare(tmp_path / "one", folder, "--line_by_line", "--packing") == 0
    assert prepare(tmp_path / "two", folder, "--line_by_line", "--packing", workers=2) == 0
    tree = lambda d: {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
    assert tree(tmp_path / "one") == tree(tmp_path / "two")
    card = json.loads((tmp_path / "one" / "dataset.json").read_text())
    assert (card["mode"], card["record_length"], card["bos_id"]) == ("packed_lines", LENGTH, BOS)
    assert card["objective"]["packing"] is True and card["splits"]["train"]["pad_tokens"] > 0
    train, validation, _ = open_dataset(tmp_path / "one", tokenizer=tok, record_length=LENGTH, mode="packed_lines")
    assert train.num_records == card["splits"]["train"]["examples"] and validation is not None
    with pytest.raises(DataError, match="'packed_lines' records\\) but this run's objective needs 'lines' records"):
        open_dataset(tmp_path / "one", tokenizer=tok, record_length=LENGTH - 2, mode="lines")  # an unpacked run


def test_the_cache_key_tells_packed_from_unpacked_and_keeps_the_old_keys(tokenizer, tmp_path):
    tok, _ = tokenizer
    docs = LINES[:50]
    keys = {mode: token_cache._cache_key(docs, tok, cut(tok, mode)) for mode in ("lines", "packed_lines")}
    assert keys["lines"] != keys["packed_lines"]
    content = hashlib.sha256(b"".join(hashlib.sha256(d.encode()).digest() for d in docs)).digest()
    for mode in ("stream", "lines"):  # what earlier versions computed: their caches are still found
        old = hashlib.sha256(
            b"|".join(
                [content, tok.to_str().encode(), str(LENGTH).encode(), str(EOS).encode(), f"{mode}:{PAD}".encode()]
            )
        ).hexdigest()[:24]
        assert token_cache._cache_key(docs, tok, cut(tok, mode)) == old
    split = token_cache.prepare_split(
        docs,
        tok,
        records.Cut(LENGTH, EOS, "packed_lines", PAD, bos_id=BOS),
        cache_dir=tmp_path,
        name="train",
    )
    assert split.path.parent.name == keys["packed_lines"]
    card = json.loads((split.path.parent / "dataset.json").read_text())
    assert card["splits"]["train"]["pad_tokens"] == int(
        (records.record_source(split).read(np.arange(split.num_records)) == PAD).sum()
    )


# -- the objective ----------------------------------------------------------------------------------------------------


def packed_record():
    record = np.full(16, PAD, np.int32)
    record[:11] = [BOS, 10, 11, 12, EOS, BOS, 13, EOS, BOS, 14, EOS]
    return record


def test_packed_segments_and_positions_of_a_hand_made_record():
    objective = make(16, line_by_line=True, packing=True)
    assert (objective.record_length, objective.preparation) == (16, "packed_lines")
    example = objective(packed_record(), example_rng(0, 3))
    np.testing.assert_array_equal(example["segment_ids"], [1] * 5 + [2] * 3 + [3] * 3 + [0] * 5)
    np.testing.assert_array_equal(example["positions"], [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2] + [0] * 5)
    np.testing.assert_array_equal(example["attention_mask"], [1] * 11 + [0] * 5)
    assert {k: (v.shape, v.dtype) for k, v in example.items()} == objective.example_spec()
    padding = padding_example(objective)
    assert set(padding) == {"input_ids", "attention_mask", "labels", *SEGMENT_FIELDS}
    assert not padding["segment_ids"].any() and (padding["labels"] == IGNORE_INDEX).all()


def test_packed_masking_never_chooses_specials_and_a_batch_row_is_its_example():
    objective = make(16, line_by_line=True, packing=True)
    rows = np.stack([packed_record()] * 300)
    rows[::2, 11:14] = [BOS, 15, EOS]  # a fourth line in every other record
    indices = np.arange(1000, 1300)
    batch = objective.batch(rows, 7, indices)
    chosen = batch["labels"] != IGNORE_INDEX
    assert not np.isin(rows[chosen], SPECIALS).any()
    np.testing.assert_array_equal(batch["labels"][chosen], rows[chosen])
    np.testing.assert_array_equal(batch["input_ids"][np.isin(rows, SPECIALS)], rows[np.isin(rows, SPECIALS)])
    content = ~np.isin(rows, SPECIALS)
    assert abs(chosen.sum() / content.sum() - 0.15) < 0.03
    for row in (0, 1, 299):
        one = objective(rows[row], example_rng(7, indices[row]))
        for field in batch:
            np.testing.assert_array_equal(batch[field][row], one[field], err_msg=field)


def test_isolated_grouped_segments_end_at_their_separators():
    joined, isolated = make(12), make(12, document_attention="isolated")
    record = np.array([10, 11, EOS, 12, 13, 14, EOS, 15, 16, EOS], np.int32)  # a separator last: </s> joins it
    one, other = joined(record, example_rng(1, 2)), isolated(record, example_rng(1, 2))
    assert set(one) == {"input_ids", "attention_mask", "labels"} and set(joined.example_spec()) == set(one)
    for field in one:  # the same example, plus its segments
        np.testing.assert_array_equal(other[field], one[field])
    # <s> 10 11 </s> | 12 13 14 </s> | 15 16 </s> </s>
    np.testing.assert_array_equal(other["segment_ids"], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(other["positions"], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3])
    record[-1] = 17  # no separator at the end: the last document runs on into the closing </s>
    ids = isolated(record, example_rng(1, 2))["segment_ids"]
    np.testing.assert_array_equal(ids, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    assert isolated.preparation == "stream" and isolated.record_length == 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(packing=True), r"^--packing packs --line_by_line lines into full examples: add --line_by_line"),
        (
            dict(line_by_line=True, document_attention="isolated"),
            r"--line_by_line example holds one line: use --packing",
        ),
        (dict(document_attention="apart"), r"--document_attention 'apart' must be one of joined, isolated"),
    ],
)
def test_bad_layouts_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)
    make(line_by_line=True, packing=True, document_attention="isolated")  # what packing does anyway


def test_packing_without_line_by_line_is_refused_before_writing(tokenizer, tmp_path, capsys):
    _, folder = tokenizer
    (tmp_path / "c.txt").write_text("\n".join(LINES[:20]) + "\n")
    assert prepare(tmp_path / "ds", folder, "--packing") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --packing packs --line_by_line lines") and err.count("\n") == 1
    assert not (tmp_path / "ds").exists()
