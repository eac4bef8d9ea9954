"""Reliability round 4 (issue 40): the numeric flags' one rule, and the edges of mixtures, prepared datasets,
trackers, generation and export that ended in tracebacks or wrong advice. Each refusal is one line, before work."""

import dataclasses
import json
import typing

import pytest

from spmdlm import config
from spmdlm.families import objective_flags
from spmdlm.launch import main

from test_reliability_inputs import FIXTURES, refused, small_run


# -- every numeric flag: finite, in range, refused before any output ---------------------------------------------
@pytest.mark.parametrize("flag, value, expected", [
    ("--num_train_epochs", "nan", "--num_train_epochs must be a finite number at least 0, got nan"),
    ("--num_train_epochs", "inf", "--num_train_epochs must be a finite number at least 0, got inf"),
    ("--spike_window", str(2**31), "--spike_window must be in [2, 100000], got 2147483648"),
    ("--adam_epsilon", "-1e-8", "--adam_epsilon must be above 0, got -1e-08 (e.g. 1e-8"),
    ("--adam_epsilon", "0", "--adam_epsilon must be above 0, got 0.0"),
    ("--adam_epsilon", "nan", "--adam_epsilon must be a finite number above 0, got nan"),
    ("--z_loss", "-1", "--z_loss must be at least 0, got -1.0 (0 = off"),
    ("--skip_step_on_spike", "nan", "--skip_step_on_spike must be a finite number at least 0, got nan"),
    ("--save_every_minutes", "nan", "--save_every_minutes must be a finite number at least 0, got nan (0 = off)"),
    ("--mean_noise_span_length", "inf", "--mean_noise_span_length must be a finite number at least 1, got inf"),
])
def test_numeric_flags_one_rule(capsys, tmp_path, cache_dir, tiny_gpt2_config, flag, value, expected):
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, f"{flag}={value}"))
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_every_numeric_flag_is_bounded():
    """A numeric flag added without bounds would be judged only as finite: each must say its range."""
    hints = typing.get_type_hints(config.RunArgs)
    numeric = {f.name for f in dataclasses.fields(config.RunArgs)
               if config._base_type(hints[f.name]) in (int, float)}
    assert numeric - set(config.FLAG_BOUNDS) == set()
    assert set(config.FLAG_BOUNDS) <= numeric
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
    path.write_text("sources:\n  - {name: a, train_file: a.txt, weight: 1e-3}\n  - {name: b, train_file: b.txt, "
                    "weight: 1}\n")  # YAML 1.1 reads 1e-3 as a string
    assert [s.weight for s in read_mixture_file(str(path))] == pytest.approx([1e-3 / 1.001, 1 / 1.001])
    path.write_text("sources:\n  - {name: a, train_file: a.txt, weight: 1.0e308}\n  - {name: b, train_file: b.txt, "
                    "weight: 1.0e308}\n")
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
    (folder / CARD_NAME).write_text(json.dumps({"format": CARD_FORMAT, "version": CARD_VERSION,
                                                "tokenizer": {"sha256": tokenizer_sha}}))
    return folder


def test_prepared_sources_of_two_tokenizers_get_advice_that_works(tmp_path):
    from spmdlm.data.mixture import read_mixture_file
    from spmdlm.errors import DataError
    from spmdlm.launch import parse_args
    from spmdlm.train.setup import read_sources

    fake_dataset(tmp_path / "a", "1" * 64), fake_dataset(tmp_path / "b", "2" * 64), fake_dataset(tmp_path / "c", "1" * 64)
    path = tmp_path / "mix.yaml"
    path.write_text("- {name: a, dataset_dir: a, weight: 1}\n- {name: c, dataset_dir: c, weight: 1}\n"
                    "- {name: b, dataset_dir: b, weight: 1}\n")
    args, _ = parse_args(["--data_mixture", str(path)])
    with pytest.raises(DataError) as refusal:
        read_sources(args, read_mixture_file(str(path)))
    assert str(refusal.value) == (f"--data_mixture {path} source b: {tmp_path / 'b'} was tokenized with another "
                                  f"tokenizer than source a's {tmp_path / 'a'}; a mixture's sources share one "
                                  f"tokenizer: prepare it again with --tokenizer {tmp_path / 'a' / 'tokenizer'}")


def test_a_prepared_dataset_is_not_read_as_text(tmp_path):
    from spmdlm.data.readers import expand_files
    from spmdlm.errors import DataError

    folder = fake_dataset(tmp_path / "prepared", "1" * 64)
    with pytest.raises(DataError, match=f"--train_file source x {folder}: is a dataset prepared by python -m "
                                        "spmdlm.prepare, not text; give it as --dataset_dir"):
        expand_files(f"{folder}", "--train_file source x")


# -- a damaged model.safetensors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_safetensors_is_one_line(tmp_path, tiny_gpt2_config, damage):
    import numpy as np
    from safetensors.numpy import save_file

    from spmdlm.errors import ExportError
    from spmdlm.export import load_hf

    (tmp_path / "config.json").write_text(tiny_gpt2_config.read_text())
    file = tmp_path / "model.safetensors"
    save_file({"transformer.wte.weight": np.zeros((512, 64), np.float32)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x10" + b"\x00" * 7 + b"{not json" + data)
    with pytest.raises(ExportError, match=f"{file} is truncated or damaged .*; export or download it again"):
        load_hf(tmp_path)
