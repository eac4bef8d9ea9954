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
    assert "unknown axis" in run_failing(
        capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--mesh", "pipeline=8"
    )


def test_batch_not_divisible_by_the_batch_axes(capsys, out):
    message = run_failing(
        capsys,
        out,
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--mesh",
        "data=4,fsdp=2",
        "--global_batch_size",
        "12",
    )
    assert "not divisible by the 8 batch devices" in message


@pytest.mark.parametrize(
    "flags, said",
    [
        (("--batch_size_ramp", "0:16,100:20"), "entry 100:20: 20 sequences do not divide among the 8 batch devices"),
        (("--batch_size_ramp", "5:16"), "the first entry must be at step 0"),
        (("--batch_size_ramp", "0:16", "--gradient_accumulation_steps", "2"), "leave --gradient_accumulation_steps"),
    ],
)
def test_a_batch_size_ramp_that_cannot_work(capsys, out, flags, said):
    message = run_failing(capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--mesh", "data=8", *flags)
    assert said in message


def test_block_longer_than_positions(capsys, out, tiny_gpt2_config):
    message = run_failing(
        capsys,
        out,
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--config_name",
        str(tiny_gpt2_config),
        "--block_size",
        "128",
    )
    assert "longer than the model's n_positions 64" in message


def test_unknown_config(capsys, out):
    assert "no such preset" in run_failing(
        capsys, out, "--train_file", str(FIXTURES / "overfit.txt"), "--config_name", "gpt7-huge"
    )


def test_an_unreachable_hub_dataset_is_one_line(capsys, out, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets and huggingface_hub read the switches when imported: an earlier test of this worker may have imported
    # them with the Hub on (then this test waited ~23 s of retries before its line)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    assert "--dataset_name oscar: Couldn't reach 'oscar'" in run_failing(capsys, out, "--dataset_name", "oscar")


def test_non_empty_output_dir_is_not_clobbered(capsys, out, tiny_gpt2_config):
    message = run_failing(
        capsys,
        out,
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--config_name",
        str(tiny_gpt2_config),
        "--block_size",
        "16",
    )
    assert "--overwrite_output_dir" in message


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused(capsys, tmp_path, tiny_gpt2_config, cache_dir):
    out = tmp_path / "run"
    common = [
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--config_name",
        str(tiny_gpt2_config),
        "--output_dir",
        str(out),
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "1",
        "--max_steps",
        "2",
        "--cache_dir",
        str(cache_dir),
        "--export_hf",
        "false",
        "--validation_split_percentage",
        "0",
    ]
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
    from spmdlm.cli.export import main as export_main

    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 2
    assert "format 1 (spmdlm 0.1" in capsys.readouterr().err and not (tmp_path / "export").exists()
    # a run of the per-example data pipeline (no data_format): its data position cannot be restored, so no resume
    (out / "run_config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "data_format"}))
    assert main(common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "earlier data pipeline (format 1" in err[0] and "--model_name_or_path" in err[0]
    assert sorted(p.name for p in out.rglob("*")) == before
    (out / "run_config.json").write_text(json.dumps(saved))
    (out / "run_config.json").rename(tmp_path / "moved.json")  # checkpoints that cannot be checked: never deleted
    assert main(common) == 2
    assert "holds checkpoints but no run_config.json" in capsys.readouterr().err
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())


@pytest.mark.slow
def test_launcher_simulates_cpu_devices_and_says_so(tmp_path):
    """From a plain environment (no XLA_FLAGS, no JAX_PLATFORMS), libtpu installed or not: the mesh's CPU devices are
    simulated, and nothing tries (and fails) to start a TPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmdlm.launch",
            "--mesh",
            "data=2,fsdp=2",
            "--train_file",
            str(tmp_path / "missing.txt"),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert "simulating 4 CPU devices for --mesh data=2,fsdp=2" in result.stdout
    assert result.returncode == 2 and "no such file" in result.stderr
    assert "TPU" not in result.stderr and "libtpu" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_flag_prefix_is_not_taken_for_the_flag(capsys, out):
    assert "unrecognized arguments: --learning_rat" in run_failing(capsys, out, "--learning_rat", "1e-3")


def test_a_flag_of_another_family_is_an_error(capsys, out):
    message = run_failing(capsys, out, "--model_type", "t5", "--block_size", "256")
    assert "--block_size does not apply to t5" in message and "--max_seq_length" in message


def test_a_binary_train_file_is_refused(capsys, out):
    assert "/bin/ls looks binary" in run_failing(capsys, out, "--train_file", "/bin/ls")


def test_an_output_dir_that_is_a_file(capsys, out):
    assert "is a file" in run_failing(capsys, out, "--output_dir", str(out / "keep.txt"))


def test_a_damaged_run_config(capsys, out):
    (out / "run_config.json").write_text("{not json")
    message = run_failing_keeping(capsys, out, "run_config.json", "--train_file", str(FIXTURES / "overfit.txt"))
    assert "run_config.json is not valid JSON" in message


def run_failing_keeping(capsys, out, name, *argv) -> str:
    """As run_failing, for a dir that also holds `name`, which must be left as it was."""
    before = (out / name).read_bytes()
    code = main(["--output_dir", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert (out / name).read_bytes() == before and (out / "keep.txt").read_text() == "precious"
    return err[0]


def test_export_to_a_file(capsys, out):
    from spmdlm.cli.export import main as export_main

    (out / "run_config.json").write_text("{}")
    assert export_main(["--checkpoint", str(out), "--out", str(out / "keep.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --out {out / 'keep.txt'} is a file; give a directory"


def test_an_args_file_and_flags_combine_and_flags_win(tmp_path):
    from spmdlm.cli.launch import parse_args

    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"learning_rate": 1e-3, "max_steps": 10, "train_file": "a.txt"}))
    args, given = parse_args([str(args_file), "--learning_rate", "5e-4"])
    assert (args.optimization.learning_rate, args.control.max_steps, args.data.train_file) == (5e-4, 10, "a.txt")


def test_urls_other_than_gs_are_refused_in_one_line(capsys, out):  # gs:// itself: tests/test_gcs.py
    message = run_failing(capsys, out, "--train_file", "s3://bucket/corpus/*.txt")
    assert "only gs:// URLs are read and written" in message
