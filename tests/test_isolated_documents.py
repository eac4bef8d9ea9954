"""--document_attention isolated: each document of a stream record is a segment of its own (CLM, T5, BART).

Segment ids and positions on hand-made records, exact reconstruction of every T5 segment from its own inputs and
targets, BART's encoder and label segments holding the same document, static shapes over many segmentations, a
batch equal to its rows one by one, and the joined default unchanged.
"""

import numpy as np
import pytest

from spmdlm.data.objectives import IGNORE_INDEX, example_rng, padding_example
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.sentences import SENTENCE_END
from spmdlm.families.bart.objective import Denoising
from spmdlm.families.t5.objective import SpanCorruption, _span_counts, num_noise_spans, random_spans_noise_masks

GPT2_EOS = 0  # <|endoftext|>, the first id of a trained GPT-2 tokenizer
T5_EOS, T5_START = 1, 0
SENTINELS = tuple(range(32099, 31999, -1))  # Google's layout: <extra_id_k> = 32099 - k
BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 4  # BART's layout; its decoder starts with </s>
BART_SPECIALS = (BOS, PAD, EOS, UNK, MASK)


def t5(inputs_length=64, **kwargs):
    return SpanCorruption(inputs_length, SENTINELS, T5_EOS, document_attention="isolated", **kwargs)


def bart(max_seq_length=64, **kwargs):
    return Denoising(
        max_seq_length,
        BOS,
        EOS,
        PAD,
        MASK,
        decoder_start_id=EOS,
        special_ids=BART_SPECIALS,
        document_attention="isolated",
        **kwargs,
    )


def record_of(doc_lengths, length, eos, start=0, first_id=10):
    """A record of `length` tokens cut at `start` from documents of these lengths, each followed by `eos`; content
    ids are distinct (first_id, first_id + 1, ...), so every output token traces back to one place."""
    pieces = []
    for n in doc_lengths:
        pieces += [np.full(n, -1), [eos]]
    stream = np.concatenate(pieces + [np.full(start + length, -1)])[start : start + length]
    content = stream == -1
    stream[content] = first_id + np.arange(content.sum())
    return stream.astype(np.int32)


def documents(record, eos):
    """The record's segments as (content without the separator, record position of its first token)."""
    cuts = np.flatnonzero(record == eos) + 1
    starts = np.concatenate(([0], cuts[cuts < len(record)]))
    ends = np.append(starts[1:], len(record))
    return [(record[a:b][record[a:b] != eos], a) for a, b in zip(starts, ends)]


def random_doc_lengths(rng, kind):
    if kind == "one-token":
        return [1] * 200
    if kind == "huge":
        return [10_000]
    if kind == "tiny":
        return list(rng.integers(0, 4, 200))  # empty documents too: two separators in a row
    return list(np.maximum(1, rng.exponential(rng.choice([3, 20, 80]), 100).astype(int)))


def assert_segment_layout(segment_ids, positions):
    """Valid positions form a prefix of contiguous segments in increasing order; positions count from 0 in each."""
    valid = segment_ids > 0
    n = valid.sum()
    assert valid[:n].all() and not valid[n:].any()
    assert (positions[n:] == 0).all()
    ids = segment_ids[:n]
    assert n == 0 or (ids[0] >= 1 and (np.diff(ids) >= 0).all())
    for k in np.unique(ids):
        np.testing.assert_array_equal(positions[:n][ids == k], np.arange((ids == k).sum()))
        assert np.ptp(np.flatnonzero(ids == k)) == (ids == k).sum() - 1  # contiguous


def assert_matches_spec(example, objective):
    spec = objective.example_spec()
    assert set(example) == set(spec)
    for name, (shape, dtype) in spec.items():
        assert example[name].shape == shape and example[name].dtype == dtype, name


# -- CLM ------------------------------------------------------------------------------------------------------------
def test_clm_segments_begin_at_each_eos():
    record = np.array([5, 6, 0, 7, 8, 9, 0, 0, 3], dtype=np.int32)
    example = CausalLM(8, eos_id=GPT2_EOS, document_attention="isolated")(record)
    np.testing.assert_array_equal(example["input_ids"], record[:-1])
    np.testing.assert_array_equal(example["labels"], record[1:])  # nothing masked: EOS is predicted, and predicts
    np.testing.assert_array_equal(example["segment_ids"], [1, 1, 2, 2, 2, 2, 3, 4])
    np.testing.assert_array_equal(example["positions"], [0, 1, 0, 1, 2, 3, 0, 0])
    # The last token of a document predicts EOS in its own segment; the EOS predicts the next document's start.
    assert example["labels"][1] == GPT2_EOS and example["segment_ids"][1] == 1
    assert example["labels"][2] == 7 and example["segment_ids"][2] == 2


def test_clm_needs_the_eos_id():
    with pytest.raises(ValueError, match="needs the EOS id"):
        CausalLM(8, document_attention="isolated")
    with pytest.raises(ValueError, match="joined or isolated"):
        CausalLM(8, eos_id=0, document_attention="packed")


def test_clm_joined_is_todays_batch():
    records = np.random.default_rng(0).integers(0, 50, (6, 17)).astype(np.int32)
    default, joined = CausalLM(16).batch(records, 0, range(6)), CausalLM(16, 0, "joined").batch(records, 0, range(6))
    assert set(default) == set(joined) == {"input_ids", "labels"}
    for name in default:
        np.testing.assert_array_equal(default[name], joined[name])
    np.testing.assert_array_equal(default["input_ids"], records[:, :-1])
    np.testing.assert_array_equal(default["labels"], records[:, 1:])


# -- T5 ---------------------------------------------------------------------------------------------------------------
def split_at_sentinels(ids):
    """Chunks of ids (EOS stripped), each opened by a sentinel but the first, and the sentinels' numbers."""
    assert ids[-1] == T5_EOS and T5_EOS not in ids[:-1]
    at = np.flatnonzero(np.isin(ids[:-1], SENTINELS))
    return np.split(ids[:-1], at), [SENTINELS.index(s) for s in ids[at]]


def uncorrupt(inputs, targets):
    """(content, noise mask) of one segment: each sentinel of the inputs replaced by its span from the targets."""
    keeps, numbers = split_at_sentinels(inputs)
    noises, target_numbers = split_at_sentinels(targets)
    assert numbers == target_numbers == list(range(len(numbers))), "sentinels restart at <extra_id_0>"
    assert len(noises[0]) == 0 and len(numbers) >= 1  # targets open with <extra_id_0>
    content, noise = [keeps[0]], [np.zeros(len(keeps[0]), bool)]
    for keep, span in zip(keeps[1:], noises[1:]):
        assert len(span) > 1, "empty noise span"
        content += [span[1:], keep[1:]]
        noise += [np.ones(len(span) - 1, bool), np.zeros(len(keep) - 1, bool)]
    return np.concatenate(content), np.concatenate(noise)


def check_t5_example(objective, record, example, draws):
    """Every segment's inputs and targets give back exactly its document (and so mention no other segment's
    tokens), each corrupted one as a record of its length is corrupted from its own uniforms; returns (segments
    left uncorrupted though long enough, targets used)."""
    assert_matches_spec(example, objective)
    seg, dseg = example["segment_ids"], example["decoder_segment_ids"]
    assert_segment_layout(seg, example["positions"])
    assert_segment_layout(dseg, example["decoder_positions"])
    assert (example["input_ids"][seg == 0] == 0).all() and (example["labels"][dseg == 0] == IGNORE_INDEX).all()
    assert (example["decoder_input_ids"][dseg == 0] == 0).all() and (example["labels"][dseg > 0] >= 0).all()
    docs = documents(record, T5_EOS)
    assert seg.max() == len(docs) and set(np.unique(dseg[dseg > 0])) <= set(range(1, len(docs) + 1))
    left_out = []
    for k, (content, start) in enumerate(docs, start=1):
        inputs = example["input_ids"][seg == k]
        if not (dseg == k).any():  # uncorrupted: the document as it is, then its EOS
            np.testing.assert_array_equal(inputs, np.append(content, T5_EOS))
            if len(content) >= 2:
                left_out.append(len(content))
            continue
        targets = example["labels"][dseg == k]
        rebuilt, noise = uncorrupt(inputs, targets)
        np.testing.assert_array_equal(rebuilt, content)
        m = len(content)
        expected = random_spans_noise_masks(
            m, objective.noise_density, objective.mean_noise_span_length, draws[None, start : start + m - 2]
        )[0]
        np.testing.assert_array_equal(noise, expected)
        # Decoder inputs restart per segment: the start id, then the segment's own targets shifted.
        np.testing.assert_array_equal(example["decoder_input_ids"][dseg == k], np.append(T5_START, targets[:-1]))
    return left_out, int((dseg > 0).sum())


def test_t5_hand_made_record():
    objective = t5(32)
    assert (objective.record_length, objective.targets_length) == (31, 8)
    # documents: the tail of one (5 tokens), a 1-token one, one of 12, the head of one cut mid-document
    record = record_of([5, 1, 12, 30], 31, T5_EOS)
    example = objective(record, example_rng(3, 7))
    np.testing.assert_array_equal(example["segment_ids"][:4], [1] * 4)
    counts = np.bincount(example["segment_ids"])[1:]
    assert counts[1] == 2  # the 1-token document: itself and its EOS, never corrupted
    np.testing.assert_array_equal(example["input_ids"][example["segment_ids"] == 2], [record[6], T5_EOS])
    assert 2 not in example["decoder_segment_ids"]
    assert example["input_ids"][(example["segment_ids"] > 0).sum() - 1] == T5_EOS  # added to the cut document
    check_t5_example(objective, record, example, objective.draw(example_rng(3, 7)))


@pytest.mark.parametrize("inputs_length", [3, 16, 64, 128])
def test_t5_static_shapes_and_exact_segments_for_many_segmentations(inputs_length):
    objective = t5(inputs_length)
    rng = np.random.default_rng(inputs_length)
    for i in range(60):
        kind = ("one-token", "huge", "tiny", "mixed")[i % 4]
        record = record_of(
            random_doc_lengths(rng, kind), objective.record_length, T5_EOS, start=int(rng.integers(0, 50))
        )
        example = objective(record, example_rng(1, i))
        check_t5_example(objective, record, example, objective.draw(example_rng(1, i)))
    # A record that starts and one that ends with a separator.
    for record in (
        record_of([0, 5, 9], objective.record_length, T5_EOS),
        record_of([objective.record_length - 1], objective.record_length, T5_EOS),
    ):
        check_t5_example(objective, record, objective(record, example_rng(2, 0)), objective.draw(example_rng(2, 0)))


def test_t5_targets_capacity_left_out_segments_are_counted():
    """Targets have the joined mode's length; a segment whose targets no longer fit is left uncorrupted. Never
    with long documents; with many short ones, exactly as many as the capacity cannot hold."""
    objective = t5(512)
    assert (objective.record_length, objective.targets_length) == (511, 114)
    targets_of = lambda m: sum(_span_counts(m, 0.15, 3.0)) + 1
    rng = np.random.default_rng(0)
    for i in range(20):  # documents of 400+ tokens: at most three segments, whose targets always fit
        record = record_of(rng.integers(400, 2000, 5), 511, T5_EOS, start=int(rng.integers(0, 2000)))
        left_out, _ = check_t5_example(
            objective, record, objective(record, example_rng(0, i)), objective.draw(example_rng(0, i))
        )
        assert left_out == []
    # 46 documents of 10 tokens (targets 4 each) and the head of one (5 tokens, targets 3): 28 x 4 or 27 x 4 + 3.
    assert (targets_of(10), targets_of(5)) == (4, 3)
    seen = set()
    for i in range(30):
        record = record_of([10] * 60, 511, T5_EOS)
        left_out, used = check_t5_example(
            objective, record, objective(record, example_rng(0, i)), objective.draw(example_rng(0, i))
        )
        assert (sorted(left_out), used) in (([5] + [10] * 18, 112), ([10] * 19, 111))
        seen.add(used)
    assert seen == {111, 112}  # the order segments are taken in is random, not always the record's last first
    # Every left-out segment's targets exceed what the corrupted ones left of the capacity.
    for i in range(30):
        record = record_of(rng.integers(1, 40, 100), 511, T5_EOS, start=int(rng.integers(0, 200)))
        left_out, used = check_t5_example(
            objective, record, objective(record, example_rng(5, i)), objective.draw(example_rng(5, i))
        )
        assert all(targets_of(m) > objective.targets_length - used for m in left_out)


def test_t5_sentinel_check_covers_every_segment():
    # Isolated records are inputs_length - 1 tokens; a segment is at most that, and numbers its own sentinels.
    n = num_noise_spans(1023, 0.15, 3.0)
    with pytest.raises(ValueError, match=f"makes {n} noise spans but only {n - 1} sentinels"):
        SpanCorruption(1024, SENTINELS[: n - 1], T5_EOS, document_attention="isolated")
    objective = SpanCorruption(1024, SENTINELS[:n], T5_EOS, document_attention="isolated")
    example = objective(record_of([5000], 1023, T5_EOS), example_rng(0, 0))  # one segment: the most spans
    assert np.isin(example["labels"], SENTINELS[:n]).sum() == n


def test_t5_joined_is_todays_batch():
    records = np.random.default_rng(0).integers(2, 300, (5, 141)).astype(np.int32)
    records[:, ::17] = T5_EOS
    default = SpanCorruption(128, SENTINELS, T5_EOS)
    joined = SpanCorruption(128, SENTINELS, T5_EOS, document_attention="joined")
    assert default.record_length == joined.record_length == 141 and t5(128).record_length == 127
    a, b = default.batch(records, 4, range(5)), joined.batch(records, 4, range(5))
    assert set(a) == set(b) == {"input_ids", "labels", "decoder_input_ids"}
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


# -- BART -------------------------------------------------------------------------------------------------------------
def bart_record(objective, doc_lengths, rng, start=0):
    record = record_of(doc_lengths, objective.record_length, EOS, start=start)
    ends = (rng.random(len(record)) < 0.15) & (record != EOS)
    return record | np.where(ends, SENTENCE_END, 0).astype(np.int32)


def check_bart_example(objective, record, example):
    """Encoder segment k and label segment k hold the same document; returns the encoder's segment count."""
    assert_matches_spec(example, objective)
    seg, dseg = example["segment_ids"], example["decoder_segment_ids"]
    assert_segment_layout(seg, example["positions"])
    assert_segment_layout(dseg, example["decoder_positions"])
    np.testing.assert_array_equal(example["attention_mask"], seg > 0)
    np.testing.assert_array_equal(example["decoder_attention_mask"], dseg > 0)
    assert (example["labels"][dseg == 0] == IGNORE_INDEX).all()
    assert dseg.max() == seg.max()  # only label segments the encoder has are kept
    docs = [content for content, _ in documents(record & (SENTENCE_END - 1), EOS)]
    if record[-1] & (SENTENCE_END - 1) == EOS:
        docs.append(np.zeros(0, np.int32))  # the closing </s> after the last separator: a segment of its own
    assert (dseg > 0).sum() == example["labels"].size or seg.max() < len(docs)  # a shorter decoder: the cut only
    for k in range(1, seg.max() + 1):
        inputs, labels = example["input_ids"][seg == k], example["labels"][dseg == k]
        document = docs[k - 1]
        assert labels[-1] == EOS and inputs[-1] == EOS  # each ends with its separator (the last: the closing </s>)
        np.testing.assert_array_equal(labels[labels > MASK], document)
        kept = inputs[inputs > MASK]
        assert len(set(kept)) == len(kept) and set(kept) <= set(document)  # distinct ids: a sub-multiset
        if k == 1:
            assert inputs[0] == BOS and labels[0] == BOS
        # The decoder restarts with decoder_start_id (</s>), which the shift already puts there after a separator.
        decoder_inputs = example["decoder_input_ids"][dseg == k]
        assert decoder_inputs[0] == EOS
        np.testing.assert_array_equal(decoder_inputs[1:], labels[:-1])
    return int(seg.max())


def test_bart_hand_made_record():
    objective = bart(24, mask_ratio=0.0, permute_sentence_ratio=0.0)  # nothing noised: the segments are visible
    record = record_of([2, 0, 5, 30], objective.record_length, EOS)
    example = objective(record, example_rng(0, 0))
    np.testing.assert_array_equal(example["input_ids"], example["labels"])  # <s> a b </s> </s> c.. </s> d.. </s>
    for side in ("", "decoder_"):
        np.testing.assert_array_equal(example[f"{side}segment_ids"], [1] * 4 + [2] + [3] * 6 + [4] * 13)
        np.testing.assert_array_equal(example[f"{side}positions"], [0, 1, 2, 3, 0, *range(6), *range(13)])
    np.testing.assert_array_equal(example["decoder_input_ids"][[0, 4, 5, 11]], [EOS] * 4)  # each segment restarts
    check_bart_example(objective, record, example)


@pytest.mark.parametrize("kind", ["one-token", "huge", "tiny", "mixed"])
def test_bart_encoder_and_label_segments_are_the_same_document(kind):
    objective = bart(64)
    joined = Denoising(64, BOS, EOS, PAD, MASK, decoder_start_id=EOS, special_ids=BART_SPECIALS)
    rng = np.random.default_rng(len(kind))
    for i in range(40):
        record = bart_record(objective, random_doc_lengths(rng, kind), rng, start=int(rng.integers(0, 30)))
        example = objective(record, example_rng(2, i))
        segments_kept = check_bart_example(objective, record, example)
        # The noise is the joined mode's: isolated only adds the segment fields, and pads the label segments of
        # documents the overflow cut took from the encoder (1-token documents: spans split at every separator).
        today = joined(record, example_rng(2, i))
        present = example["decoder_segment_ids"] > 0
        for name in today:
            np.testing.assert_array_equal(example[name][present], today[name][present], err_msg=name)
        np.testing.assert_array_equal(example["input_ids"], today["input_ids"])
        assert present.all() == (segments_kept == (record & (SENTENCE_END - 1) == EOS).sum() + 1)


def test_bart_label_segments_the_encoder_cut_away_are_padding():
    # Near-zero Poisson spans insert many <mask>s: the infilled content overflows and its tail is cut.
    objective = bart(48, poisson_lambda=0.05)
    rng, cut = np.random.default_rng(0), 0
    for i in range(20):
        record = bart_record(objective, [3] * 30, rng, start=i)
        example = objective(record, example_rng(0, i))
        segments_kept = check_bart_example(objective, record, example)
        cut += segments_kept < (record & (SENTENCE_END - 1) == EOS).sum() + 1
    assert cut >= 10


def test_bart_joined_is_todays_batch():
    rng = np.random.default_rng(1)
    records = np.stack([bart_record(bart(32), random_doc_lengths(rng, "mixed"), rng) for _ in range(4)])
    default = Denoising(32, BOS, EOS, PAD, MASK, decoder_start_id=EOS, special_ids=BART_SPECIALS)
    joined = Denoising(
        32, BOS, EOS, PAD, MASK, decoder_start_id=EOS, special_ids=BART_SPECIALS, document_attention="joined"
    )
    a, b = default.batch(records, 3, range(4)), joined.batch(records, 3, range(4))
    assert set(a) == set(b) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


# -- all three --------------------------------------------------------------------------------------------------------
ISOLATED = {
    "clm": (CausalLM(40, eos_id=GPT2_EOS, document_attention="isolated"), GPT2_EOS),
    "t5": (t5(40), T5_EOS),
    "bart": (bart(40), EOS),
}


@pytest.mark.parametrize("name", sorted(ISOLATED))
def test_a_batch_is_its_rows_one_by_one(name):
    objective, eos = ISOLATED[name]
    rng = np.random.default_rng(9)
    kinds = ("one-token", "huge", "tiny", "mixed") * 2
    rows = np.stack(
        [
            record_of(random_doc_lengths(rng, kind), objective.record_length, eos, start=int(rng.integers(0, 20)))
            for kind in kinds
        ]
    )
    if name == "bart":
        rows |= np.where(rng.random(rows.shape) < 0.1, SENTENCE_END, 0).astype(np.int32)
    indices = [3, 1000, 7, 0, 12, 5, 99, 42]
    batch = objective.batch(rows, 11, indices)
    assert_matches_spec({k: v[0] for k, v in batch.items()}, objective)
    for i, (record, index) in enumerate(zip(rows, indices)):
        one = objective(record, example_rng(11, index))
        for field in one:
            np.testing.assert_array_equal(batch[field][i], one[field], err_msg=field)
    again = objective.batch(rows[::-1], 11, indices[::-1])
    for field in batch:
        np.testing.assert_array_equal(again[field][::-1], batch[field])
    padding = padding_example(objective)
    assert all((padding[f] == 0).all() for f in ("segment_ids", "positions"))


@pytest.mark.parametrize("family_name, preset", [("gpt2", "gpt2-tiny"), ("t5", "t5-v1_1-tiny"), ("bart", "bart-tiny")])
def test_families_build_the_isolated_objective(family_name, preset):
    from spmdlm.cli.launch import parse_args
    from spmdlm.data.tokenization import special_token_ids, train_tokenizer
    from spmdlm.families import get_family, load_config

    family = get_family(family_name)
    assert "document_attention" in family.resume_keys  # recorded, and a resume must keep it
    args, _ = parse_args(
        ["--model_type", family_name, "--document_attention", "isolated", "--max_seq_length", "32"]
        if family_name != "gpt2"
        else ["--model_type", "gpt2", "--document_attention", "isolated", "--block_size", "32"]
    )
    texts = [f"sentence {i} about apples, pears and {i * 7} plums." for i in range(100)]
    tokenizer = train_tokenizer(family, texts, vocab_size=300 if family_name == "t5" else 400)
    objective = family.build_objective(args.objective, load_config(preset, family_name), tokenizer)
    assert objective.document_attention == "isolated"
    assert objective.eos_id == special_token_ids(tokenizer, family.tokenizer)["eos"]
    assert "segment_ids" in objective.example_spec()
    # Only T5's records change with the mode (so does the token cache's key): one token short of the encoder.
    assert objective.record_length == {"gpt2": 33, "t5": 31, "bart": 30}[family_name]
    default, _ = parse_args(["--model_type", family_name])
    built = family.build_objective(default.objective, load_config(preset, family_name), tokenizer)
    assert built.document_attention == "joined"
