"""The read path: token files and their record boundaries, old caches rebuilt, objectives applied to whole
batches exactly as to single examples, host slices and mid-epoch resume of the training iterator."""

import json
import logging

import numpy as np
import pytest

from spmdlm import storage
from spmdlm.data import pipeline, records, token_cache
from spmdlm.data.objectives import example_rng
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.objectives.mlm import MaskedLM
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.families.bart.objective import Denoising
from spmdlm.families.t5.objective import SpanCorruption

SPECIALS = (0, 1, 2, 3, 4)  # <s> <pad> </s> <unk> <mask>
FRAMED = dict(bos_id=0, eos_id=2, pad_id=1, mask_id=4, special_ids=SPECIALS)
OBJECTIVES = {
    "clm": CausalLM(16),
    "mlm": MaskedLM(18, vocab_size=300, **FRAMED),
    "t5": SpanCorruption(16, tuple(range(299, 199, -1)), 2),
    "bart": Denoising(18, decoder_start_id=2, **FRAMED),
    # documents isolated in segments (docs/packing.md): the segment fields come from the same (seed, index)
    "clm-isolated": CausalLM(16, eos_id=2, document_attention="isolated"),
    "mlm-packed": MaskedLM(18, vocab_size=300, line_by_line=True, packing=True, **FRAMED),
    "mlm-isolated": MaskedLM(18, vocab_size=300, document_attention="isolated", **FRAMED),
    "t5-isolated": SpanCorruption(16, tuple(range(299, 199, -1)), 2, document_attention="isolated"),
    "bart-isolated": Denoising(18, decoder_start_id=2, document_attention="isolated", **FRAMED),
}


def token_split(folder, objective, n_records=40, records_per_shard=None, seed=0):
    rng = np.random.default_rng(seed)
    rows = rng.integers(5, 200, (n_records, objective.record_length)).astype(np.int32)
    rows[rng.random(rows.shape) < 0.05] = 2  # document separators
    if getattr(objective, "packing", False):  # packed lines: each begins with <s> (0)
        rows[rng.random(rows.shape) < 0.1] = 0
    rows |= np.where(rng.random(rows.shape) < 0.1, SENTENCE_END, 0).astype(np.int32)  # BART's sentence ends
    if not isinstance(objective, Denoising):
        rows &= SENTENCE_END - 1
    sink = records.RecordShards(lambda i: folder / f"train-{i:05d}.tokens", records_per_shard)
    sink.write(rows)
    shards = sink.close()
    return records.PreparedSplit(tuple(s["path"] for s in shards), n_records, rows.size, objective.record_length), rows


def test_records_lie_back_to_back_across_shards(tmp_path):
    split, rows = token_split(tmp_path, CausalLM(6), n_records=10, records_per_shard=3)
    assert [p.stat().st_size for p in split.paths] == [3 * 7 * 4] * 3 + [7 * 4]  # no header, no framing
    source = records.record_source(split)
    assert len(source) == 10
    indices = np.array([9, 0, 4, 3, 2, 8, 8])  # across shard boundaries, repeated, in any order
    np.testing.assert_array_equal(source.read(indices), rows[indices])
    np.testing.assert_array_equal(source[5], rows[5])
    with pytest.raises(IndexError):
        source.read(np.array([10]))
    assert records.token_file_problem(split.paths[0], 84, 3, 7) is None
    assert records.token_file_problem(split.paths[0], 70, 3, 7) == "train-00000.tokens holds 2.5 records, 3 expected"


@pytest.mark.parametrize("name", OBJECTIVES)
def test_a_batch_is_its_rows_computed_one_by_one(tmp_path, name):
    objective = OBJECTIVES[name]
    _, rows = token_split(tmp_path, objective, n_records=6)
    indices = np.array([7, 3, 100, 0, 5, 123456789])
    batch = objective.batch(rows, 11, indices)
    assert {k: (v.shape[1:], v.dtype) for k, v in batch.items()} == objective.example_spec()
    for row, (record, index) in enumerate(zip(rows, indices)):
        one = objective(record, example_rng(11, index))
        for field in batch:
            np.testing.assert_array_equal(batch[field][row], one[field], err_msg=f"{field} of row {row}")
    if not name.startswith("clm"):  # the randomness is the example's, not the batch position's
        again = objective.batch(rows[::-1], 11, indices[::-1])
        np.testing.assert_array_equal(again["input_ids"][::-1], batch["input_ids"])


@pytest.mark.parametrize(
    "name", ["mlm", "t5", "bart", "clm-isolated", "mlm-packed", "mlm-isolated", "t5-isolated", "bart-isolated"]
)
def test_hosts_read_their_rows_of_the_same_global_batches(tmp_path, name):
    objective = OBJECTIVES[name]
    split, _ = token_split(tmp_path, objective, n_records=40, records_per_shard=7)

    def first_batches(process_index, process_count, n=6):  # 6 batches of 16 cross the epoch boundary at 40
        it = pipeline.train_batches(
            split,
            objective,
            seed=5,
            global_batch=16,
            num_epochs=3,
            process_index=process_index,
            process_count=process_count,
        )
        return [next(it) for _ in range(n)]

    whole, quarters = first_batches(0, 1), [first_batches(p, 4) for p in range(4)]
    for step, batch in enumerate(whole):
        for field, rows in batch.items():
            np.testing.assert_array_equal(np.concatenate([q[step][field] for q in quarters]), rows)


def test_a_restored_iterator_resumes_mid_epoch(tmp_path):
    objective = OBJECTIVES["mlm"]
    split, _ = token_split(tmp_path, objective, n_records=40)
    it = pipeline.train_batches(
        split, objective, seed=2, global_batch=8, num_epochs=2, process_index=1, process_count=2
    )
    for _ in range(3):  # mid-epoch: 5 steps per epoch
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]  # on into the second epoch
    fresh = pipeline.train_batches(
        split, objective, seed=2, global_batch=8, num_epochs=2, process_index=1, process_count=2
    )
    fresh.set_state(json.loads(json.dumps(state)))  # as the checkpoint stores it
    for want in expected:
        got = next(fresh)
        for field in want:
            np.testing.assert_array_equal(got[field], want[field])


def test_a_cache_in_the_previous_layout_is_a_miss_and_rebuilt(tmp_path, caplog):
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    docs = [f"document {i} " + " ".join(f"w{(i * j) % 97}" for j in range(30)) for i in range(60)]
    tokenizer = train_tokenizer(get_family("gpt2"), docs, 300)
    prepare = lambda: token_cache.prepare_split(docs, tokenizer, records.Cut(17, 0), cache_dir=tmp_path, name="train")
    split = prepare()
    rows = records.record_source(split).read(np.arange(split.num_records))
    folder = split.path.parent
    for path in folder.iterdir():  # what the previous version wrote under the same key: NAME.tokens + NAME.json
        storage.rmtree(path)
    rows.astype("<i4").tofile(folder / "train.tokens")
    (folder / "train.json").write_text(json.dumps({"format": "int32 records back to back", "num_records": len(rows)}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmdlm.data.token_cache"):
        assert prepare() == split
    assert caplog.messages == [
        f"the tokenized train cache {folder} is in an earlier version's layout or incomplete; rebuilding it"
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["dataset.json", "tokenizer", "train-00000.tokens"]
    np.testing.assert_array_equal(records.record_source(split).read(np.arange(split.num_records)), rows)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmdlm.data.token_cache"):
        prepare()
    assert not caplog.messages
