"""The data path: readers, the tokenized cache, and batches that depend on (seed, step) alone."""

import json

import numpy as np
import pytest

from spmdlm.data import datasets, pipeline, readers, records, token_cache
from spmdlm.data.batch_ramp import BatchRamp
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.tokenization import load_tokenizer, train_tokenizer
from spmdlm.errors import DataError
from spmdlm.families import get_family

_WORDS = np.random.default_rng(0).integers(0, 500, (300, 60))
DOCS = [f"document {i}: " + " ".join(f"w{w}" for w in row[: 40 + i % 13]) for i, row in enumerate(_WORDS)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(get_family("gpt2"), DOCS, 300)


@pytest.fixture(scope="module")
def split(tokenizer, tmp_path_factory):
    return token_cache.prepare_split(
        DOCS, tokenizer, records.Cut(17, 0), cache_dir=tmp_path_factory.mktemp("cache"), name="train"
    )


def batches(split, *, seed=0, process_index=0, process_count=1, n=5, global_batch=8):
    it = pipeline.train_batches(
        split,
        CausalLM(16),
        seed=seed,
        global_batch=global_batch,
        num_epochs=3,
        process_index=process_index,
        process_count=process_count,
    )
    return [next(it) for _ in range(n)]


def test_records_are_the_token_stream_cut_in_blocks(split, tokenizer):
    stream = np.concatenate([np.append(tokenizer.encode(d, add_special_tokens=False).ids, 0) for d in DOCS])
    assert split.num_tokens == len(stream)
    assert split.num_records == len(stream) // 17
    source = records.record_source(split)
    for i in (0, 1, split.num_records - 1):
        np.testing.assert_array_equal(source[i], stream[i * 17 : (i + 1) * 17])
    np.testing.assert_array_equal(split.path.read_bytes(), stream[: split.num_records * 17].astype("<i4").tobytes())


def test_second_preparation_reuses_the_cache(split, tokenizer):
    class NoTokenizing:
        def to_str(self):
            return tokenizer.to_str()

        def get_vocab_size(self):
            return tokenizer.get_vocab_size()

        def encode_batch(self, *args, **kwargs):
            raise AssertionError("the cache should have been reused")

    again = token_cache.prepare_split(
        DOCS, NoTokenizing(), records.Cut(17, 0), cache_dir=split.path.parent.parent, name="train"
    )
    assert again == split
    with pytest.raises(AssertionError, match="reused"):  # other content -> a new key -> tokenizes
        token_cache.prepare_split(
            DOCS[:-1],
            NoTokenizing(),
            records.Cut(17, 0),
            cache_dir=split.path.parent.parent,
            name="train",
        )


def test_a_launcher_cache_given_as_dataset_dir_gives_the_same_batches(split, tokenizer):
    """The cache folder is a dataset directory: opened as a run given --dataset_dir opens it (its own copy of the
    tokenizer, the run's lengths and mode), it has the cache's records, key and counts, and the same batches."""
    folder = split.path.parent
    copy = load_tokenizer(folder / datasets.TOKENIZER_DIR)  # what a run given --dataset_dir alone loads
    assert copy.to_str() == tokenizer.to_str()
    train, validation, card = datasets.open_dataset(
        folder, tokenizer=copy, record_length=17, mode="stream", verify=True
    )
    assert validation is None and train == split and train.fingerprint == folder.name == card["key"]
    assert card["splits"]["train"]["documents"] == train.documents == len(DOCS)
    for ours, theirs in zip(batches(split, n=8), batches(train, n=8), strict=True):
        assert ours.keys() == theirs.keys()
        for field in ours:
            np.testing.assert_array_equal(ours[field], theirs[field])


def test_same_seed_same_batches_and_different_seed_differs(split):
    a, b, c = batches(split), batches(split), batches(split, seed=1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
    assert not all(np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))


def test_two_processes_read_the_rows_of_the_same_global_batches(split):
    whole = batches(split)
    halves = [batches(split, process_index=p, process_count=2) for p in range(2)]
    for step, batch in enumerate(whole):
        joined = np.concatenate([halves[0][step]["input_ids"], halves[1][step]["input_ids"]])
        np.testing.assert_array_equal(joined, batch["input_ids"])
        assert halves[0][step]["input_ids"].shape == (4, 16)


def test_epochs_are_reshuffled_and_cover_every_record(split):
    n = split.num_records
    order = pipeline.EpochOrder(n, seed=3)(np.arange(3 * n))
    for epoch in range(3):  # one epoch = every record once
        assert sorted(order[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert list(order[:n]) != list(order[n : 2 * n]) and list(order[:n]) != list(range(n))
    straddling = np.arange(n - 3, n + 5)  # a batch across two epochs reads each epoch's own permutation
    np.testing.assert_array_equal(pipeline.EpochOrder(n, seed=3)(straddling), order[n - 3 : n + 5])
    source = records.record_source(split)
    batch = pipeline.HostBatches(split, seed=3, global_batch=8, num_epochs=2)[1]
    np.testing.assert_array_equal(batch.records, source.read(order[8:16]))


def test_restored_iterator_continues_the_sequence(split):
    it = pipeline.train_batches(split, CausalLM(16), seed=0, global_batch=8, num_epochs=3)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(2)]
    fresh = pipeline.train_batches(split, CausalLM(16), seed=0, global_batch=8, num_epochs=3)
    fresh.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(fresh)["input_ids"], want)


RAMP = BatchRamp.parse("0:4,3:8,5:16")  # batches of 4, 4, 4, 8, 8, 16, 16, ...


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_a_ramp_reads_each_example_once_on_any_host_count(split, process_count):
    """Global batch s of a ramp is examples [start(s), start(s) + B(s)), start(s) the batches before it; host p
    reads its contiguous rows of it. Over the same examples a ramp reads the set of indices a fixed batch reads:
    each exactly once, no gaps, whatever the number of hosts; the rows are the records of those indices."""
    steps = 8  # 4 * 3 + 8 * 2 + 16 * 3 = 76 examples
    hosts = [
        pipeline.HostBatches(
            split, seed=3, global_batch=RAMP, num_epochs=1, process_index=p, process_count=process_count
        )
        for p in range(process_count)
    ]
    read = [[host[s] for host in hosts] for s in range(steps)]
    for s, parts in enumerate(read):  # the hosts' rows, in order, are the global batch
        joined = np.concatenate([part.indices for part in parts])
        start = RAMP.examples_before(s)
        np.testing.assert_array_equal(joined, np.arange(start, start + RAMP.batch_at(s)))
        assert {len(part.indices) for part in parts} == {RAMP.batch_at(s) // process_count}
    ramped = np.concatenate([part.indices for parts in read for part in parts])
    fixed_source = pipeline.HostBatches(split, seed=3, global_batch=4, num_epochs=1)
    fixed = np.concatenate([fixed_source[s].indices for s in range(76 // 4)])
    assert len(ramped) == len(set(ramped.tolist())) == 76  # no example twice
    np.testing.assert_array_equal(np.sort(ramped), np.sort(fixed))  # the same examples, no gaps
    order, source = pipeline.EpochOrder(split.num_records, seed=3), records.record_source(split)
    last = read[-1][-1]
    np.testing.assert_array_equal(last.records, source.read(order(last.indices)))
    assert len(hosts[0]) == RAMP.steps_within(split.num_records)  # the steps one epoch holds


def test_a_ramp_iterator_resumes_at_its_step(split):
    """The checkpointed position is the step: restored mid-ramp, the iterator goes on with the same batches."""
    make = lambda: pipeline.train_batches(split, CausalLM(16), seed=0, global_batch=RAMP, num_epochs=2)
    it = make()
    assert [next(it)["input_ids"].shape[0] for _ in range(4)] == [4, 4, 4, 8]
    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(3)]
    fresh = make()
    fresh.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(fresh)["input_ids"], want)


def test_max_train_samples_keeps_only_a_prefix_of_the_records(split):
    import dataclasses

    capped = dataclasses.replace(split, num_records=8)
    it = pipeline.train_batches(capped, CausalLM(16), seed=0, global_batch=4, num_epochs=3)
    seen = {tuple(row) for _ in range(6) for row in next(it)["input_ids"]}
    with pytest.raises(StopIteration):  # 3 epochs of 8 records: 6 batches of 4
        next(it)
    source = records.record_source(split)
    assert seen == {tuple(source[i][:-1]) for i in range(8)}


def test_eval_batches_pad_with_loss_free_rows(split):
    batches_ = list(pipeline.eval_batches(split, CausalLM(16), seed=0, global_batch=8, max_examples=13))
    assert len(batches_) == 2
    labels = batches_[-1]["labels"]
    assert (labels[5:] == -100).all() and (labels[:5] != -100).all()


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("a.txt", "first line\n\n  \nsecond line\n", ["first line", "second line"]),
        ("a.jsonl", '{"text": "one"}\n{"text": "two"}\n', ["one", "two"]),
        ("a.json", json.dumps([{"text": "x"}, {"text": "y"}]), ["x", "y"]),
        ("a.csv", "id,text\n1,hello\n2,world\n", ["hello", "world"]),
    ],
)
def test_readers(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    assert list(readers.read_documents([path])) == expected


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        readers.expand_files(str(tmp_path / "nope.txt"))
    (tmp_path / "a.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match="a.bin looks binary"):
        list(readers.read_documents([tmp_path / "a.bin"]))


def test_validation_split_is_stable_and_close_to_the_percentage():
    # 3,000 distinct documents (the split is by a document's own hash: a repeated one falls the same way)
    documents = [f"{d} (copy {k})" for d in DOCS for k in range(10)]
    held = [d for d in documents if readers.in_validation_split(d, 5.0)]
    assert len(documents) == 3000 and 0.04 < len(held) / 3000 < 0.06
    assert readers.in_validation_split("abc", 5.0) == readers.in_validation_split("abc", 5.0)


def test_embedded_corpus_is_the_stdlib():
    files = readers.embedded_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert any(f.name == "json" or f.parent.name == "json" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
