"""Reliability round 4 (issue 40): the numeric flags' one rule, and the edges of mixtures, prepared datasets,
trackers, generation and export that ended in tracebacks or wrong advice. Each refusal is one line, before work."""

import dataclasses
import json
import typing

import pytest
from test_reliability_inputs import FIXTURES, refused, small_run

from spmdlm.cli.launch import _base_type
from spmdlm.families import objective_flags
from spmdlm.run_args import SECTIONS
from spmdlm.run_args.choices import FLAG_BOUNDS


# -- every numeric flag: finite, in range, refused before any output ---------------------------------------------
@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--num_train_epochs", "nan", "--num_train_epochs must be a finite number at least 0, got nan"),
        ("--num_train_epochs", "inf", "--num_train_epochs must be a finite number at least 0, got inf"),
        ("--spike_window", str(2**31), "--spike_window must be in [2, 100000], got 2147483648"),
        ("--max_steps", "1" + "0" * 400, "--max_steps must be in [-1, 2147483647], got 1000"),
        ("--adam_epsilon", "-1e-8", "--adam_epsilon must be above 0, got -1e-08 (e.g. 1e-8"),
        ("--adam_epsilon", "0", "--adam_epsilon must be above 0, got 0.0"),
        ("--adam_epsilon", "nan", "--adam_epsilon must be a finite number above 0, got nan"),
        ("--z_loss", "-1", "--z_loss must be at least 0, got -1.0 (0 = off"),
        ("--skip_step_on_spike", "nan", "--skip_step_on_spike must be a finite number at least 0, got nan"),
        ("--save_every_minutes", "nan", "--save_every_minutes must be a finite number at least 0, got nan (0 = off)"),
        ("--mean_noise_span_length", "inf", "--mean_noise_span_length must be a finite number at least 1, got inf"),
    ],
)
def test_numeric_flags_one_rule(capsys, tmp_path, cache_dir, tiny_gpt2_config, flag, value, expected):
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, f"{flag}={value}"))
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_every_numeric_flag_is_bounded():
    """A numeric flag added without bounds would be judged only as finite: each must say its range."""
    numeric = {
        f.name
        for section in SECTIONS.values()
        for f in dataclasses.fields(section)
        if _base_type(typing.get_type_hints(section)[f.name]) in (int, float)
    }
    assert numeric - set(FLAG_BOUNDS) == set()
    assert set(FLAG_BOUNDS) <= numeric
    unbounded = [flag.name for flag in objective_flags() if flag.type in (int, float) and flag.bounds is None]
    assert unbounded == []


# -- mixtures: refused at parse time, naming the source ----------------------------------------------------------
def test_mixture_yaml_errors_and_weights(tmp_path):
    from spmdlm.data.mixture import parse_train_file, read_mixture_file
    from spmdlm.errors import ArgumentError

    path = tmp_path / "mix.yaml"
    path.write_text("sources:\n  - name: a\n   train_file: [a.txt\n")
    with pytest.raises(ArgumentError, match="is not valid YAML: .* at line 3 column 4"):
        read_mixture_file(str(path))
    path.write_text(
        "sources:\n  - {name: a, train_file: a.txt, weight: 1e-3}\n  - {name: b, train_file: b.txt, weight: 1}\n"
    )  # YAML 1.1 reads 1e-3 as a string
    assert [s.weight for s in read_mixture_file(str(path))] == pytest.approx([1e-3 / 1.001, 1 / 1.001])
    path.write_text(
        "sources:\n  - {name: a, train_file: a.txt, weight: 1.0e308}\n  - {name: b, train_file: b.txt, "
        "weight: 1.0e308}\n"
    )
    with pytest.raises(ArgumentError, match="the weights sum to more than a float holds; scale them down"):
        read_mixture_file(str(path))
    with pytest.raises(ArgumentError, match="--train_file: the weights sum to more than a float holds"):
        parse_train_file("a.txt:1e308,b.txt:1e308")
    with pytest.raises(ArgumentError, match="source b needs a numeric weight"):
        path.write_text("- {name: a, train_file: a.txt, weight: 1}\n- {name: b, train_file: b.txt, weight: lots}\n")
        read_mixture_file(str(path))


def test_overflowing_weights_leave_no_output(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    flags = small_run(tmp_path / "run", cache_dir, tiny_gpt2_config)
    at = flags.index("--train_file") + 1
    flags[at] = f"{flags[at]}:1e308,{flags[at]}:1e308"
    assert "the weights sum to more than a float holds" in refused(capsys, *flags)
    assert not (tmp_path / "run").exists()


def test_a_source_too_small_is_named(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    (tmp_path / "tiny.txt").write_text("hello world\n")
    flags = small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--validation_split_percentage", "0")
    at = flags.index("--train_file") + 1
    flags[at] = f"{flags[at]}:0.5,{tmp_path / 'tiny.txt'}:0.5"
    line = refused(capsys, *flags)
    assert "--train_file source tiny: the train corpus has" in line and "fewer than one example of 33" in line, line
    assert not (tmp_path / "run").exists()


def fake_dataset(folder, tokenizer_sha: str):
    from spmdlm.data.datasets import CARD_FORMAT, CARD_NAME, CARD_VERSION

    folder.mkdir()
    (folder / CARD_NAME).write_text(
        json.dumps({"format": CARD_FORMAT, "version": CARD_VERSION, "tokenizer": {"sha256": tokenizer_sha}})
    )
    return folder


def test_prepared_sources_of_two_tokenizers_get_advice_that_works(tmp_path):
    from spmdlm.cli.launch import parse_args
    from spmdlm.data.mixture import read_mixture_file
    from spmdlm.errors import DataError
    from spmdlm.train.stages.corpora import read_sources

    for name, sha in (("a", "1" * 64), ("b", "2" * 64), ("c", "1" * 64)):
        fake_dataset(tmp_path / name, sha)
    path = tmp_path / "mix.yaml"
    path.write_text(
        "- {name: a, dataset_dir: a, weight: 1}\n- {name: c, dataset_dir: c, weight: 1}\n"
        "- {name: b, dataset_dir: b, weight: 1}\n"
    )
    args, _ = parse_args(["--data_mixture", str(path)])
    with pytest.raises(DataError) as refusal:
        read_sources(args.data, read_mixture_file(str(path)))
    assert str(refusal.value) == (
        f"--data_mixture {path} source b: {tmp_path / 'b'} was tokenized with another "
        f"tokenizer than source a's {tmp_path / 'a'}; a mixture's sources share one "
        f"tokenizer: prepare it again with --tokenizer {tmp_path / 'a' / 'tokenizer'}"
    )


def test_a_prepared_dataset_is_not_read_as_text(tmp_path):
    from spmdlm.data.readers import expand_files
    from spmdlm.errors import DataError

    folder = fake_dataset(tmp_path / "prepared", "1" * 64)
    with pytest.raises(
        DataError,
        match=f"--train_file source x {folder}: is a dataset prepared by python -m "
        "spmdlm.prepare, not text; give it as --dataset_dir",
    ):
        expand_files(f"{folder}", "--train_file source x")


# -- a damaged model.safetensors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_safetensors_is_one_line(tmp_path, tiny_gpt2_config, damage):
    import numpy as np
    from safetensors.numpy import save_file

    from spmdlm.errors import ExportError
    from spmdlm.hf_export import load_hf

    (tmp_path / "config.json").write_text(tiny_gpt2_config.read_text())
    file = tmp_path / "model.safetensors"
    save_file({"transformer.wte.weight": np.zeros((512, 64), np.float32)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x10" + b"\x00" * 7 + b"{not json" + data)
    with pytest.raises(ExportError, match=f"{file} is truncated or damaged .*; export or download it again"):
        load_hf(tmp_path)


# -- tokenizer training memory: documents cut into pieces, as the record writer does -------------------------------
@pytest.mark.parametrize("model", ["gpt2", "t5"])
def test_the_tokenizer_trainer_reads_long_documents_in_pieces(monkeypatch, model):
    import numpy as np

    from spmdlm.data import records
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), rng.integers(2, 7))) for _ in range(200)]
    doc = " ".join(rng.choice(words, 3000)) + "  double  spaces stay   whole. And\nlines too"
    whole = train_tokenizer(get_family(model), [doc], 400).to_str()
    monkeypatch.setattr(records, "PIECE_CHARS", 100)
    pieces = list(records.in_pieces([doc, "short"]))
    assert "".join(pieces[:-1]) == doc and pieces[-1] == "short" and len(pieces) > 100
    assert max(map(len, pieces)) < 120
    assert train_tokenizer(get_family(model), [doc], 400).to_str() == whole  # the same word counts


# -- logs and prompts --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_tokenizer():
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    return train_tokenizer(get_family("gpt2"), FIXTURES.joinpath("overfit.txt").read_text().splitlines(), 300)


def test_sample_prompts_keep_the_tokenizer_s_own_bars(gpt2_tokenizer):
    from spmdlm.train.loop import split_prompts

    assert split_prompts("a<|endoftext|>b|c||", gpt2_tokenizer) == ["a<|endoftext|>b", "c"]
    assert split_prompts("def main(|import os", gpt2_tokenizer) == ["def main(", "import os"]


def test_the_validation_split_s_padding_line_says_validation(caplog, tmp_path, gpt2_tokenizer):
    import logging

    from spmdlm.data.records import Cut
    from spmdlm.data.token_cache import prepare_split

    with caplog.at_level(logging.INFO, logger="spmdlm"):
        prepare_split(
            ["one line", "two more lines here"],
            gpt2_tokenizer,
            Cut(8, 0, "lines", pad_id=0),
            cache_dir=tmp_path,
            name="validation",
        )
    lines = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lines records of 8 tokens: validation 2 with"), lines


def test_one_document_that_leaves_no_held_out_text_says_so(caplog):
    import logging
    import types

    from spmdlm.cli.launch import parse_args
    from spmdlm.train.stages.corpora import tokenize_validation

    args, _ = parse_args(["--train_file", "x.txt", "--text_documents", "file"])
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        reading = types.SimpleNamespace(data=args.data, control=args.control)  # what the data stage reads of the run
        assert tokenize_validation(reading, [], False) is None
    assert "no evaluation: the held-out 5.0% of the documents is none of them" in caplog.text


def test_generate_from_a_folder_without_a_tokenizer_says_what_to_copy(capsys, tmp_path, tiny_gpt2_config):
    from spmdlm.cli.generate import main as generate

    (tmp_path / "config.json").write_text(tiny_gpt2_config.read_text())
    assert generate(["--model_name_or_path", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(f"error: --model_name_or_path {tmp_path} has no tokenizer (tokenizer.json or ")
    assert err.strip().endswith(
        "sentencepiece.bpe.model): copy the tokenizer the model was trained with into it (a run's is "
        "OUTPUT_DIR/tokenizer.json)"
    )
    assert "vocab.json + merges.txt" in err and "\n" not in err.strip()
    assert "--tokenizer_name" not in err


# -- a tracker that cannot start ------------------------------------------------------------------------------------
def test_a_tracker_that_cannot_start_leaves_the_output_dir_as_it_was(
    capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install -e '.[mlflow]')")
    from spmdlm.train.stages.outputs import OUR_OUTPUTS

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://nowhere")  # refused by MLflow at once
    out = tmp_path / "run"
    line = refused(capsys, *small_run(out, cache_dir, tiny_gpt2_config, "--report_to", "mlflow"))
    assert line.startswith("error: --report_to mlflow: could not start its run:"), line
    assert line.endswith("; fix that or leave mlflow out of --report_to")
    # nothing a retry without mlflow would refuse (an earlier run's metrics.jsonl, run_config.json, mlruns/)
    assert not out.exists() or not {p.name for p in out.iterdir()} & set(OUR_OUTPUTS)


# -- prepared datasets: ids beyond the vocabulary refused at start; the card describes the dataset trained on --------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory, gpt2_tokenizer):
    from spmdlm.data.tokenization import save_tokenizer
    from spmdlm.families import get_family
    from spmdlm.prepare import main as prepare

    folder = tmp_path_factory.mktemp("prepared")
    save_tokenizer(gpt2_tokenizer, folder / "tok", get_family("gpt2"), model_max_length=64)
    assert (
        prepare(
            [
                "--tokenizer",
                str(folder / "tok"),
                "--for_model",
                "gpt2",
                "--block_size",
                "16",
                "--out",
                str(folder / "ds"),
                "--workers",
                "1",
                "--validation_percentage",
                "0",
                str(FIXTURES / "overfit.txt"),
            ]
        )
        == 0
    )
    return folder / "ds"


def test_a_shard_with_an_id_beyond_the_vocabulary_is_refused_at_start(tmp_path, prepared, gpt2_tokenizer):
    import shutil

    import numpy as np

    from spmdlm.data.datasets import open_dataset
    from spmdlm.errors import DataError

    out = shutil.copytree(prepared, tmp_path / "ds")
    train, _, _ = open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")  # as prepared: fine
    tokens = np.memmap(train.paths[0], dtype=np.int32, mode="r+")
    tokens[40] = gpt2_tokenizer.get_vocab_size() + 7
    tokens.flush()
    with pytest.raises(
        DataError,
        match=f"--dataset_dir {out}: shard .* holds token id 307, outside the "
        "tokenizer's 300 ids \\(a damaged shard\\); prepare the dataset again",
    ):
        open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")


def test_a_large_datasets_ids_are_checked_at_each_shards_ends_only(tmp_path, prepared, gpt2_tokenizer, monkeypatch):
    """Above ID_SCAN_ALL_BYTES every start of every host would read the whole dataset: the first and last chunk of
    each shard are scanned (chunks of 8 tokens here), a bad id between them is left to the opt-in sha256 check."""
    import shutil

    import numpy as np

    from spmdlm.data import datasets
    from spmdlm.errors import DataError

    monkeypatch.setattr(datasets, "ID_SCAN_ALL_BYTES", 0)
    monkeypatch.setattr(datasets, "ID_CHECK_CHUNK", 8)
    out = shutil.copytree(prepared, tmp_path / "ds")
    path = datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")[0].paths[0]
    tokens = np.memmap(path, dtype=np.int32, mode="r+")
    assert len(tokens) > 3 * 8
    tokens[12] = 999  # the second chunk: not scanned
    tokens.flush()
    datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")
    tokens[len(tokens) - 1] = 999  # the last chunk: scanned
    tokens.flush()
    with pytest.raises(DataError, match="holds token id 999"):
        datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")


def test_the_model_card_describes_the_dataset_as_opened(tmp_path, prepared, gpt2_tokenizer):
    import shutil
    import types

    from spmdlm.cli.launch import parse_args
    from spmdlm.data.datasets import CARD_NAME
    from spmdlm.train import publish
    from spmdlm.train.stages import corpora

    out = shutil.copytree(prepared, tmp_path / "ds")
    args, _ = parse_args(["--dataset_dir", str(out)])
    objective = types.SimpleNamespace(record_length=17, preparation="stream")
    reading = corpora.Reading(args.data, args.control, gpt2_tokenizer, None, objective)
    data = corpora.prepare_data(reading, ([], []))
    card = json.loads((out / CARD_NAME).read_text())
    card["read"]["files"], card["splits"]["train"]["documents"] = 99, 12345  # prepared anew while training
    (out / CARD_NAME).write_text(json.dumps(card))
    prepared = types.SimpleNamespace(run=types.SimpleNamespace(args=args, sources=()), data=data)
    assert (
        publish._data_lines(prepared)[0] == f"- corpus: the prepared dataset `{out}` (1 files, 20 training documents)"
    )


# -- export/generate of checkpoints that do not restore: no folder or flag they do not have ----------------------
def test_read_only_restores_name_the_cause_not_damaged_checkpoints(monkeypatch, tmp_path):
    import types

    from spmdlm import checkpoint

    def restore(manager, step, *args, **kwargs):
        raise checkpoint.CheckpointError(f"the checkpoint at step {step} cannot be read (shape (64, 512) != (32, 512))")

    monkeypatch.setattr(checkpoint, "all_complete_steps", lambda manager, move_aside: [2, 4])
    monkeypatch.setattr(checkpoint, "restore", restore)
    manager = types.SimpleNamespace(directory=tmp_path / "checkpoints")
    with pytest.raises(checkpoint.CheckpointError) as refusal:
        checkpoint.restore_newest_good(manager, None, move_aside=False, model_only=True)
    message = str(refusal.value)
    assert message == (
        f"no checkpoint in {tmp_path / 'checkpoints'} can be restored into the model its "
        "run_config.json describes (the checkpoint at step 4 cannot be read (shape (64, 512) != "
        "(32, 512))); check that the checkpoints are this run's"
    )
    assert checkpoint.DAMAGED_DIR not in message and "--overwrite_output_dir" not in message
    assert not (tmp_path / checkpoint.DAMAGED_DIR).exists()
