"""gs:// output, input and export against a local GCS emulator (the `gcs_bucket` fixture in conftest.py)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import STDLIB_JSON, final_params, read_metrics, run_argv, run_killed_after_first_checkpoint
from family_fixtures import FIXTURES

from spmdlm import storage
from spmdlm.launch import main


def bucket_metrics(out: str) -> list[dict]:
    return [json.loads(line) for line in storage.path(out + "/metrics.jsonl").read_text().splitlines()]


def gpt2_flags(out: str, config: Path, cache_dir, *extra: str) -> list[str]:
    # test_train.py's resume flags: the same compiled programs
    flags = dict(block_size=32, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate="3e-3")
    flags |= dict(warmup_steps=2, logging_steps=1, max_eval_samples=32, seed=7, mesh="data=8", max_steps=6)
    return run_argv(out, config, cache_dir, *extra, **flags, save_steps=3, global_batch_size=16)


@pytest.mark.slow
def test_a_run_in_a_bucket_resumes_exactly_and_exports(gcs_bucket, tmp_path, tiny_gpt2_config, cache_dir, monkeypatch):
    whole, moved = str(tmp_path / "whole"), f"{gcs_bucket}/run"
    assert main(gpt2_flags(whole, tiny_gpt2_config, cache_dir, "--export_hf", "false")) == 0
    run_killed_after_first_checkpoint(monkeypatch, lambda: main(gpt2_flags(moved, tiny_gpt2_config, cache_dir)))
    run = storage.path(moved)
    assert not (run / "run.lock").exists() and (run / "checkpoints" / "3").is_dir()
    assert main(gpt2_flags(moved, tiny_gpt2_config, cache_dir)) == 0

    losses = lambda metrics: [m["loss"] for m in metrics if "loss" in m]
    assert losses(bucket_metrics(moved)) == losses(read_metrics(Path(whole)))
    resumed, uninterrupted = final_params(moved), final_params(Path(whole))
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        np.testing.assert_array_equal(resumed[key], uninterrupted[key])  # bitwise
    names = {p.name for p in run.iterdir()}
    assert {
        "checkpoints",
        "metrics.jsonl",
        "eval_results.json",
        "loss_curve.png",
        "tensorboard",
        "tokenizer.json",
        "run_config.json",
        "hf",
    } <= names
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())

    # python -m spmdlm.export from the bucket to the bucket; both exports load in transformers once downloaded
    from spmdlm.cli.export import main as export_main

    assert export_main(["--checkpoint", moved, "--out", f"{gcs_bucket}/export"]) == 0
    from transformers import AutoModelForCausalLM

    for folder in (f"{moved}/hf", f"{gcs_bucket}/export"):
        model = AutoModelForCausalLM.from_pretrained(storage.local_copy(folder))
        np.testing.assert_array_equal(model.transformer.wte.weight.detach().numpy(), resumed["['wte']['embedding']"])
    from spmdlm.hf_export import load_hf  # --model_name_or_path gs://...: read from the bucket

    ours, _ = load_hf(f"{gcs_bucket}/export")
    np.testing.assert_array_equal(np.asarray(ours.wte.embedding[...]), resumed["['wte']['embedding']"])


@pytest.mark.slow
def test_t5_reads_its_corpus_and_keeps_its_token_cache_in_a_bucket(gcs_bucket, tmp_path, monkeypatch):
    corpus = storage.path(f"{gcs_bucket}/corpus.txt")
    corpus.write_text("".join(Path(p).read_text() for p in sorted(Path(STDLIB_JSON).parent.glob("*.py"))))
    config = tmp_path / "t5-micro.json"  # the family suite's tiny T5 (fast to compile)
    config.write_text(json.dumps(FIXTURES["t5"].tiny_config))
    flags = [
        "--model_type",
        "t5",
        "--config_name",
        str(config),
        *FIXTURES["t5"].run_flags,
        "--mesh",
        "data=8",
        "--train_file",
        str(corpus),
        "--cache_dir",
        f"{gcs_bucket}/cache",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--do_train",
        "--export_hf",
        "false",
    ]
    monkeypatch.setenv("SPMDLM_LOCAL_CACHE", str(tmp_path / "local"))  # this host's copy of the bucket's cache
    assert main([*flags, "--output_dir", str(tmp_path / "t5")]) == 0
    cached = storage.files_under(f"{gcs_bucket}/cache")
    assert sorted(p.name for p in cached) == ["dataset.json", "tokenizer.json", "train-00000.tokens"]
    assert [m["step"] for m in read_metrics(tmp_path / "t5") if "loss" in m] == [1, 2]


def test_bad_gs_paths_are_one_line_exit_2(gcs_bucket, tmp_path, capsys, monkeypatch):
    def refused(*flags) -> str:
        assert main(["--max_steps", "1", *flags]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "no such bucket" in refused("--output_dir", "gs://no-such-bucket/run")
    assert "only gs://" in refused("--output_dir", "s3://bucket/run")
    assert "no such file" in refused("--train_file", f"{gcs_bucket}/missing.txt", "--output_dir", str(tmp_path))
    # no credentials (no emulator, a credentials file that is not there) and no gcs extra: fresh configuration
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    storage.filesystem.cache_clear()
    storage.check_bucket.cache_clear()
    try:
        assert "credentials" in refused("--output_dir", f"{gcs_bucket}/other")
        storage.filesystem.cache_clear()
        monkeypatch.setitem(sys.modules, "gcsfs", None)
        assert "pip install 'spmdlm[gcs]'" in refused("--output_dir", f"{gcs_bucket}/other")
    finally:
        storage.filesystem.cache_clear()
        storage.check_bucket.cache_clear()


def test_a_tokenizer_and_a_prepared_dataset_in_a_bucket(gcs_bucket, tmp_path, monkeypatch):
    from spmdlm.cli.tokenizer import main as tokenizer_main
    from spmdlm.data import datasets, records
    from spmdlm.data.tokenization import load_tokenizer
    from spmdlm.prepare import main as prepare_main

    monkeypatch.setenv("SPMDLM_LOCAL_CACHE", str(tmp_path / "local"))
    inputs = f"{gcs_bucket}/stdlib-json/"  # a bucket folder as the input: every file under it
    for file in sorted(Path(STDLIB_JSON).parent.glob("*.py")):
        storage.upload(file, f"{inputs}{file.name}")
    tok, data = f"{gcs_bucket}/tok", f"{gcs_bucket}/gpt2-32"
    assert tokenizer_main(["--for_model", "gpt2", "--vocab_size", "400", "--out", tok, inputs]) == 0
    prepare = ["--tokenizer", tok, "--for_model", "gpt2", "--block_size", "32", "--out", data]
    prepare += ["--workers", "1", "--shard_size", "8K", inputs]
    assert prepare_main(prepare) == 0
    card = json.loads(storage.path(f"{data}/dataset.json").read_text())
    assert len(card["splits"]["train"]["shards"]) > 1 and card["inputs"]["files"][0]["path"].startswith(inputs)
    tokenizer = load_tokenizer(f"{data}/tokenizer")
    train, validation, _ = datasets.open_dataset(data, tokenizer=tokenizer, record_length=33, mode="stream")
    assert all(str(p).startswith(str(tmp_path / "local")) for p in train.paths)  # this host's verified copy
    assert len(records.record_source(train)) == card["splits"]["train"]["examples"]
    assert prepare_main(prepare) == 0  # up to date: nothing to do


def test_a_token_cache_in_a_bucket_is_reused_by_another_host_and_opens_as_a_dataset(gcs_bucket, tmp_path, monkeypatch):
    from spmdlm.data import datasets, records, token_cache
    from spmdlm.data.tokenization import load_tokenizer, train_tokenizer
    from spmdlm.families import get_family

    docs = [f"line {i}: " + " ".join(f"w{(i * j) % 89}" for j in range(25)) for i in range(80)]
    tokenizer = train_tokenizer(get_family("gpt2"), docs, 300)
    cache = storage.path(f"{gcs_bucket}/shared-cache")
    prepare = lambda tok: token_cache.prepare_split(docs, tok, records.Cut(17, 0), cache_dir=cache, name="train")
    monkeypatch.setenv("SPMDLM_LOCAL_CACHE", str(tmp_path / "host0"))
    built = prepare(tokenizer)  # tokenized here, uploaded from this host's copy
    rows = records.record_source(built).read(np.arange(built.num_records))

    class NoTokenizing:
        def to_str(self):
            return tokenizer.to_str()

        def encode_batch(self, *args, **kwargs):
            raise AssertionError("the bucket's cache should have been reused")

    monkeypatch.setenv("SPMDLM_LOCAL_CACHE", str(tmp_path / "host1"))  # another host: its own disk
    again = prepare(NoTokenizing())
    assert all(str(p).startswith(str(tmp_path / "host1")) for p in again.paths)
    np.testing.assert_array_equal(records.record_source(again).read(np.arange(again.num_records)), rows)
    folder = f"{cache}/{built.fingerprint}"  # the bucket's cache folder, given as --dataset_dir
    train, _, _ = datasets.open_dataset(
        folder, tokenizer=load_tokenizer(f"{folder}/tokenizer"), record_length=17, mode="stream"
    )
    assert train.fingerprint == built.fingerprint and train.num_records == built.num_records
