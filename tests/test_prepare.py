"""python -m spmdlm.prepare: sharded datasets, the same bytes whatever the worker count, re-runs that do nothing,
bad inputs, failures that leave nothing behind, open_dataset's refusals, and --dataset_name on local datasets."""

import gzip
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from spmdlm.data import pipeline
from spmdlm.data.datasets import open_dataset
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.readers import open_corpus, read_documents
from spmdlm.data.records import Cut, _chunks, _writer, default_workers, record_source
from spmdlm.data.token_cache import prepare_split
from spmdlm.data.tokenization import save_tokenizer, train_tokenizer
from spmdlm.errors import DataError
from spmdlm.families import get_family
from spmdlm.prepare import main

_RNG = np.random.default_rng(1)
_WORDS = [f"w{i}" for i in range(400)] + ["Ærø", "straße", "café", "Привет"]
DOCS = [" ".join(_RNG.choice(_WORDS, _RNG.integers(3, 40))) + ". And then! More text." for _ in range(1200)]
needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs the datasets extra: pip install 'spmdlm[datasets]'"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text("\n".join(DOCS[:700]) + "\n")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[700:]))
    return folder


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for model in ("gpt2", "roberta", "bart"):
        tok = train_tokenizer(get_family(model), DOCS[:300], 500)
        save_tokenizer(tok, folder / model, get_family(model), model_max_length=1024)
        out[model] = (tok, folder / model)
    return out


def prepare(out, tokenizers, *inputs, model="gpt2", length=("--block_size", "32"), extra=()):
    workers = [] if "--workers" in extra else ["--workers", "1"]  # spawning worker processes takes a second
    return main(
        [
            "--tokenizer",
            str(tokenizers[model][1]),
            "--for_model",
            model,
            *length,
            "--out",
            str(out),
            "--shard_size",
            "8K",
            *workers,
            *extra,
            *map(str, inputs),
        ]
    )


def records(split) -> np.ndarray:
    source = record_source(split)
    return source.read(np.arange(len(source)))


def tree(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_one_or_two_workers_write_the_same_bytes(corpus, tokenizers, tmp_path):
    assert prepare(tmp_path / "one", tokenizers, corpus, extra=["--workers", "1"]) == 0
    assert prepare(tmp_path / "two", tokenizers, corpus, extra=["--workers", "2"]) == 0
    one = tree(tmp_path / "one")
    assert one == tree(tmp_path / "two")
    card = json.loads((tmp_path / "one" / "dataset.json").read_text())
    train = card["splits"]["train"]
    assert len(train["shards"]) > 1 and sum(s["records"] for s in train["shards"]) == train["examples"]
    assert card["record_length"] == 33 and card["mode"] == "stream" and card["read"]["documents"] == len(DOCS)
    assert train["documents"] + card["splits"]["validation"]["documents"] == len(DOCS)
    assert [f["path"] for f in card["inputs"]["files"]] == [str(corpus / "a.txt"), str(corpus / "b.jsonl")]
    assert (tmp_path / "one" / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "model, length, mode, record_length",
    [
        ("gpt2", ("--block_size", "32"), "stream", 33),
        ("bart", ("--max_seq_length", "34"), "sentences", 32),
        ("roberta", ("--max_seq_length", "34", "--line_by_line"), "lines", 32),
    ],
)
def test_records_are_those_of_the_launcher_cache(corpus, tokenizers, tmp_path, model, length, mode, record_length):
    out = tmp_path / "ds"
    assert prepare(out, tokenizers, corpus, model=model, length=length, extra=["--validation_percentage", "0"]) == 0
    tok = tokenizers[model][0]
    card = json.loads((out / "dataset.json").read_text())
    train, validation, _ = open_dataset(out, tokenizer=tok, record_length=record_length, mode=mode)
    assert validation is None and card["mode"] == mode and len(train.paths) > 1
    cached = prepare_split(
        DOCS,
        tok,
        Cut(record_length, card["separator_id"], mode, card["pad_id"]),
        cache_dir=tmp_path / "cache",
        name="train",
    )
    np.testing.assert_array_equal(records(train), records(cached))
    assert (train.num_records, train.num_tokens) == (cached.num_records, cached.num_tokens)


def test_a_second_run_does_nothing_and_changed_inputs_are_refused(corpus, tokenizers, tmp_path, caplog):
    out = tmp_path / "ds"
    assert prepare(out, tokenizers, corpus) == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spmdlm.data.datasets"):
        assert prepare(out, tokenizers, corpus) == 0
    assert f"{out} is up to date (same inputs and settings): nothing to do" in caplog.messages
    assert not any("tokenized" in m for m in caplog.messages)
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    extra = tmp_path / "more.txt"
    extra.write_text("one more document\n")
    assert prepare(out, tokenizers, corpus, extra) == 2
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert prepare(out, tokenizers, corpus, extra, extra=["--overwrite"]) == 0
    assert json.loads((out / "dataset.json").read_text())["read"]["documents"] == len(DOCS) + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "more.txt"]  # no temp or old dirs left


def test_compressed_inputs_give_the_same_records(corpus, tokenizers, tmp_path):
    text = (corpus / "a.txt").read_bytes()
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text))
    inputs = [tmp_path / "a.txt.gz"]
    if importlib.util.find_spec("zstandard"):
        import zstandard

        (tmp_path / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
        inputs.append(tmp_path / "a.txt.zst")
    tok = tokenizers["gpt2"][0]
    for path in [corpus / "a.txt", *inputs]:
        assert prepare(tmp_path / path.name.replace(".", "_"), tokenizers, path) == 0
    splits = [
        open_dataset(tmp_path / p.name.replace(".", "_"), tokenizer=tok, record_length=33, mode="stream")[0]
        for p in [corpus / "a.txt", *inputs]
    ]
    for split in splits[1:]:
        np.testing.assert_array_equal(records(split), records(splits[0]))
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(text)[:200])
    with pytest.raises(DataError, match=r"bad.txt.gz: cannot decompress \(.*\); the file is truncated"):
        list(read_documents([tmp_path / "bad.txt.gz"]))


def test_bad_bytes_empty_lines_and_empty_files_are_counted(tokenizers, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "latin1.txt").write_bytes(("\n".join(DOCS[:300]) + "\n").encode() + b"caf\xe9 cr\xe8me\n\n\n")
    (inputs / "empty.txt").write_text("\n  \n")
    (inputs / "records.jsonl").write_text('{"text": "x y z"}\n{"text": ""}\n\n')
    assert prepare(tmp_path / "ds", tokenizers, inputs) == 0
    read = json.loads((tmp_path / "ds" / "dataset.json").read_text())["read"]
    assert read == {
        "files": 3,
        "documents": 302,
        "invalid_utf8_bytes_replaced": 2,
        "empty_lines_skipped": 6,
        "empty_files_skipped": 1,
    }


def test_a_json_line_without_the_text_field_names_file_and_line(tokenizers, tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": DOCS[0]}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert prepare(tmp_path / "ds", tokenizers, path) == 2
    assert capsys.readouterr().err == (
        f"error: {path}:2 has no 'text' field; pass --text_column NAME, NAME one of its fields: body\n"
    )
    assert not (tmp_path / "ds").exists()


def test_missing_inputs_are_listed_in_one_line(tokenizers, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmdlm.prepare",
            "--tokenizer",
            str(tokenizers["gpt2"][1]),
            "--for_model",
            "gpt2",
            "--out",
            str(tmp_path / "ds"),
            str(tmp_path / "a.txt"),
            str(tmp_path / "dir/*.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"error: INPUTS: no such files: {tmp_path / 'a.txt'}, {tmp_path / 'dir/*.jsonl'}; "
        "check the paths (globs like 'data/*.txt' are allowed)\n"
    )


def test_a_failure_while_writing_leaves_no_dataset(corpus, tokenizers, tmp_path, monkeypatch, capsys):
    real, writes = _writer, []

    class DiskFull:  # the third shard file does not fit
        def __init__(self, path):
            self.inner = real(path)

        def write(self, data):
            writes.append(len(data))
            if len(writes) > 2:
                raise OSError(28, "No space left on device")
            self.inner.write(data)

        def close(self):
            self.inner.close()

    monkeypatch.setattr("spmdlm.data.records._writer", DiskFull)
    assert prepare(tmp_path / "ds", tokenizers, corpus) == 2
    written = r"it needs more than [\d,]+ bytes, [\d,]+ are free there"  # what it had written when the disk filled
    assert re.fullmatch(
        f"error: cannot write the dataset {re.escape(str(tmp_path / 'ds'))}: no space left on device \\({written}\\) "
        f"in {re.escape(str(tmp_path))}; free some space or choose another --out\n",
        capsys.readouterr().err,
    )
    assert list(tmp_path.iterdir()) == []  # neither the dataset nor its temp dir


def test_open_dataset_refuses_another_tokenizer_length_or_mode(corpus, tokenizers, tmp_path):
    out = tmp_path / "ds"
    assert prepare(out, tokenizers, corpus) == 0
    tok = tokenizers["gpt2"][0]
    train, validation, card = open_dataset(out, tokenizer=tok, record_length=33, mode="stream", verify=True)
    assert train.num_records == card["splits"]["train"]["examples"] == len(records(train))
    assert validation.num_records == card["splits"]["validation"]["examples"]
    batch = next(pipeline.train_batches(train, CausalLM(32), seed=0, global_batch=4, num_epochs=1))
    assert batch["input_ids"].shape == (4, 32)
    refusals = [
        (
            dict(tokenizer=tokenizers["roberta"][0], record_length=33, mode="stream"),
            re.escape(f"--dataset_dir {out} was tokenized with another tokenizer than this run's (sha256 ")
            + ".*"
            + re.escape(f"): pass --tokenizer_name {out}/tokenizer or prepare the data again"),
        ),
        (
            dict(tokenizer=tok, record_length=129, mode="stream"),
            f"--dataset_dir {out} was prepared for gpt2 --block_size 32 \\(records of 33 tokens\\) but this run needs "
            "records of 129 tokens: pass the same length flags or prepare the data again",
        ),
        (
            dict(tokenizer=tok, record_length=33, mode="sentences"),
            f"--dataset_dir {out} was prepared for gpt2 --block_size 32 \\('stream' records\\) but this run's "
            "objective needs 'sentences' records: pass --block_size 32 as it was prepared \\(--model_type gpt2\\), "
            "or prepare the data again for this objective$",
        ),
    ]
    for kwargs, message in refusals:
        with pytest.raises(DataError, match=f"^{message}"):
            open_dataset(out, **kwargs)
    from spmdlm.data.tokenization import load_tokenizer

    assert (
        open_dataset(out, tokenizer=load_tokenizer(out / "tokenizer"), record_length=33, mode="stream")[0] == train
    )  # the copy is the same tokenizer
    shard = out / card["splits"]["train"]["shards"][1]["file"]
    assert shard.suffix == ".tokens"
    assert shard.stat().st_size == card["splits"]["train"]["shards"][1]["records"] * 33 * 4  # int32 tokens only
    card_path, card_text = out / "dataset.json", (out / "dataset.json").read_text()
    miscounted = json.loads(card_text)
    miscounted["splits"]["train"]["shards"][1]["records"] += 1
    card_path.write_text(json.dumps(miscounted))
    with pytest.raises(DataError, match=f"^--dataset_dir {out}: {shard.name} holds .* records, .* expected; prepare"):
        open_dataset(out, tokenizer=tok, record_length=33, mode="stream")
    card_path.write_text(json.dumps({**json.loads(card_text), "version": 1}))  # an earlier version's
    with pytest.raises(
        DataError,
        match=re.escape(
            f"--dataset_dir {out}: dataset format version 1, this spmdlm reads 2 (flat token shards, read in "
            f"batches); prepare it again: python -m spmdlm.prepare --tokenizer {out / 'tokenizer'} --for_model gpt2 "
            f"--block_size 32 --out {out} --overwrite {corpus / 'a.txt'} {corpus / 'b.jsonl'}"
        )
        + "$",
    ):
        open_dataset(out, tokenizer=tok, record_length=33, mode="stream")
    packed = {"line_by_line": True, "packing": True, "max_seq_length": 33, "mlm_probability": None}
    card_path.write_text(
        json.dumps({**json.loads(card_text), "for_model": "roberta", "mode": "packed_lines", "objective": packed})
    )  # as RoBERTa's --line_by_line --packing writes it
    with pytest.raises(
        DataError,
        match=re.escape(
            "but this run's objective needs 'stream' records: pass "
            "--line_by_line --packing --max_seq_length 33 as it was prepared "
            "(--model_type roberta), or prepare"
        ),
    ):
        open_dataset(out, tokenizer=tok, record_length=33, mode="stream")
    card_path.write_text(card_text)
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(64)
    shard.write_bytes(bytes(data))
    open_dataset(out, tokenizer=tok, record_length=33, mode="stream")  # sizes only: not noticed
    with pytest.raises(DataError, match=f"shard {shard.name} does not match its sha256"):
        open_dataset(out, tokenizer=tok, record_length=33, mode="stream", verify=True)
    shard.unlink()
    with pytest.raises(DataError, match=f"shard {shard.name} is missing; prepare the dataset again"):
        open_dataset(out, tokenizer=tok, record_length=33, mode="stream")
    with pytest.raises(DataError, match="no dataset.json in it; prepare one with python -m spmdlm.prepare"):
        open_dataset(tmp_path, tokenizer=tok, record_length=33, mode="stream")


def test_a_non_dataset_out_dir_and_objective_flags_of_another_model_are_refused(corpus, tokenizers, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert prepare(tmp_path / "mine", tokenizers, corpus) == 2
    assert "holds no prepared dataset; choose a new or empty --out" in capsys.readouterr().err
    assert prepare(tmp_path / "x", tokenizers, corpus, length=("--max_seq_length", "32")) == 2
    assert (
        capsys.readouterr().err
        == "error: --max_seq_length does not apply to gpt2; its flags: --block_size, --document_attention\n"
    )


def test_parquet_input(corpus, tokenizers, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(
        pyarrow.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "docs.parquet", row_group_size=100
    )
    assert prepare(tmp_path / "ds", tokenizers, tmp_path / "docs.parquet", extra=["--text_column", "body"]) == 0
    assert prepare(tmp_path / "plain", tokenizers, corpus) == 0
    tok = tokenizers["gpt2"][0]
    a, b = (open_dataset(tmp_path / d, tokenizer=tok, record_length=33, mode="stream")[0] for d in ("ds", "plain"))
    np.testing.assert_array_equal(records(a), records(b))


@needs_datasets
def test_dataset_name_reads_save_to_disk_and_parquet_dirs_offline(corpus, tokenizers, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    data.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    data.to_parquet(str(tmp_path / "pq" / "train.parquet"))
    assert prepare(tmp_path / "plain", tokenizers, corpus) == 0
    tok = tokenizers["gpt2"][0]
    expected = records(open_dataset(tmp_path / "plain", tokenizer=tok, record_length=33, mode="stream")[0])
    for name in ("saved", "pq", "pq/train.parquet"):
        out = tmp_path / f"ds-{name.replace('/', '-')}"
        assert prepare(out, tokenizers, extra=["--dataset_name", str(tmp_path / name)]) == 0
        train, _, card = open_dataset(out, tokenizer=tok, record_length=33, mode="stream")
        np.testing.assert_array_equal(records(train), expected)
        assert card["validation"] == {"from": "document hash", "percentage": 5.0}

    # a DatasetDict with its own validation split: used as is
    datasets.DatasetDict(
        {"train": data.select(range(1000)), "validation": data.select(range(1000, 1200))}
    ).save_to_disk(str(tmp_path / "dict"))
    assert prepare(tmp_path / "ds-dict", tokenizers, extra=["--dataset_name", str(tmp_path / "dict")]) == 0
    card = json.loads((tmp_path / "ds-dict" / "dataset.json").read_text())
    assert card["validation"] == {"from": "the dataset's validation split"}
    assert (card["splits"]["train"]["documents"], card["splits"]["validation"]["documents"]) == (1000, 200)
    with pytest.raises(
        DataError,
        match=r"split train has no 'body' column; pass --text_column NAME, NAME "
        r"one of its columns: text, id",
    ):
        list(open_corpus(dataset_name=str(tmp_path / "saved"), text_column="body").documents())


def test_without_datasets_dataset_name_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(
        DataError, match=re.escape("--dataset_name needs the datasets library: pip install 'spmdlm[datasets]'")
    ):
        _ = open_corpus(dataset_name="wikitext").splits


def test_workers_read_documents_in_order_with_bounded_chunks(tokenizers, monkeypatch):
    monkeypatch.setattr("spmdlm.data.records.TOKENIZE_BATCH", 7)
    chunks = list(_chunks(iter(DOCS[:50])))
    assert [len(c) for c in chunks] == [7] * 7 + [1] and sum(chunks, []) == DOCS[:50]
    assert os.cpu_count() >= 1 and default_workers() >= 1


@pytest.mark.slow
@needs_datasets
def test_the_launcher_trains_from_a_dataset_dir_a_dataset_name_and_a_cache_folder(
    corpus, tokenizers, tmp_path, tiny_gpt2_config, cache_dir, monkeypatch
):
    import datasets
    from conftest import read_metrics

    from spmdlm.cli.launch import main as launch

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert prepare(tmp_path / "prepared", tokenizers, corpus) == 0
    common = [
        "--config_name",
        str(tiny_gpt2_config),
        "--block_size",
        "32",
        "--max_steps",
        "2",
        "--mesh",
        "data=8",
        "--per_device_train_batch_size",
        "1",
        "--logging_steps",
        "1",
        "--cache_dir",
        str(cache_dir),
    ]
    assert launch([*common, "--dataset_dir", str(tmp_path / "prepared"), "--output_dir", str(tmp_path / "a")]) == 0
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert (
        launch(
            [
                *common,
                "--dataset_name",
                str(tmp_path / "saved"),
                "--tokenizer_name",
                str(tokenizers["gpt2"][1]),
                "--output_dir",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    # the same documents, tokenizer and held-out split: the same batches, so the same losses
    # ... and run b's token cache of its training records, given to another run as --dataset_dir (its tokenizer the
    # cache's copy): one format, so the same records and batches again
    key = json.loads((tmp_path / "b" / "run_config.json").read_text())["fingerprints"]["train_data"]
    assert launch([*common, "--dataset_dir", str(cache_dir / key), "--output_dir", str(tmp_path / "d")]) == 0
    losses = [[m["loss"] for m in read_metrics(tmp_path / run) if "loss" in m] for run in ("a", "b", "d")]
    assert losses[0] == losses[1] == losses[2] and len(losses[0]) == 2
    # a dataset of another length is refused in one line
    assert (
        launch(
            [
                *common,
                "--block_size",
                "16",
                "--dataset_dir",
                str(tmp_path / "prepared"),
                "--output_dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
