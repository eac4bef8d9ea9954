"""Bad input: one clear line on stderr, exit code 2, and nothing in the output dir touched."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO
from spmdlm.launch import main


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "keep.txt").write_text("precious")
    return path


def run_failing(capsys, out, *argv) -> str:
    code = main(["--output_dir", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    return err[0]


def test_missing_train_file(capsys, out, tmp_path):
    assert "no such file" in run_failing(capsys, out, "--train_file", str(tmp_path / "missing.txt"))


def test_empty_corpus(capsys, out, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert "no text" in run_failing(capsys, out, "--train_file", str(empty))


def test_mesh_not_matching_the_devices(capsys, out):
    message = run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--mesh", "data=3")
    assert "needs 3 devices but 8 are available" in message


def test_unknown_mesh_axis(capsys, out):
    assert "unknown axis" in run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"),
                                         "--mesh", "pipeline=8")


def test_batch_not_divisible_by_the_batch_axes(capsys, out):
    message = run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--mesh", "data=4,fsdp=2",
                          "--global_batch_size", "12")
    assert "not divisible by the 8 batch devices" in message


def test_block_longer_than_positions(capsys, out, tiny_gpt2_config):
    message = run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--config_name",
                          str(tiny_gpt2_config), "--block_size", "128")
    assert "longer than the model's n_positions 64" in message


def test_unknown_config(capsys, out):
    assert "no such preset" in run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"),
                                           "--config_name", "gpt7-huge")


def test_hub_datasets_are_refused(capsys, out):
    assert "--train_file" in run_failing(capsys, out, "--dataset_name", "oscar")


def test_non_empty_output_dir_is_not_clobbered(capsys, out, tiny_gpt2_config):
    message = run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--config_name",
                          str(tiny_gpt2_config), "--block_size", "16")
    assert "--overwrite_output_dir" in message


def test_resuming_with_other_settings_is_refused(capsys, tmp_path, tiny_gpt2_config, cache_dir):
    out = tmp_path / "run"
    common = ["--train_file", str(FIXTURES / "overfit.txt"), "--config_name", str(tiny_gpt2_config),
              "--output_dir", str(out), "--block_size", "16", "--per_device_train_batch_size", "1", "--max_steps",
              "2", "--cache_dir", str(cache_dir), "--export_hf", "false", "--validation_split_percentage", "0"]
    assert main(common) == 0
    before = sorted(p.name for p in out.rglob("*"))
    capsys.readouterr()
    assert main([*common, "--seed", "1"]) == 2
    assert "other settings (seed)" in capsys.readouterr().err
    assert main([*common, "--vocab_size", "1024"]) == 2
    assert "other settings (model config)" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before
    # a checkpoint of spmdlm 0.1 (per-layer parameters; its run_config has no checkpoint_format): one line
    saved = json.loads((out / "run_config.json").read_text())
    (out / "run_config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "checkpoint_format"}))
    assert main(common) == 2
    assert "format 1 (spmdlm 0.1" in capsys.readouterr().err
    from spmdlm.export import main as export_main

    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 2
    assert "format 1 (spmdlm 0.1" in capsys.readouterr().err and not (tmp_path / "export").exists()
    (out / "run_config.json").write_text(json.dumps(saved))
    (out / "run_config.json").rename(tmp_path / "moved.json")  # checkpoints that cannot be checked: never deleted
    assert main(common) == 2
    assert "holds checkpoints but no run_config.json" in capsys.readouterr().err
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())


def test_launcher_simulates_cpu_devices_and_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "spmdlm.launch", "--mesh", "data=2,fsdp=2", "--train_file",
         str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert "simulating 4 CPU devices for --mesh data=2,fsdp=2" in result.stdout
    assert result.returncode == 2 and "no such file" in result.stderr
    assert not (tmp_path / "out").exists()
