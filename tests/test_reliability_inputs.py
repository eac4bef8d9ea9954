"""Inputs and leftovers that used to end in a traceback or in a silently useless run: one line (exit 2) or a warning.

Launcher runs are in-process on a tiny GPT-2 (block 32, 8 devices as data=8); the refusals stop before compiling.
"""

import json
import logging
import os

import pytest
from conftest import FIXTURES, read_metrics, run_argv, run_killed_after_first_checkpoint

from spmdlm.launch import main


def small_run(out, cache_dir, config, *extra) -> list[str]:
    flags = dict(block_size=32, per_device_train_batch_size=2, mesh="data=8", max_steps=4)
    return run_argv(out, config, cache_dir, *extra, train_file=FIXTURES / "overfit.txt", **flags)


def refused(capsys, *argv) -> str:
    """The run exits 2 with exactly one line on stderr and no traceback; -> that line."""
    code = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    return lines[0]


# -- 1: a metrics.jsonl / samples.jsonl torn by a crash ---------------------------------------------------------------
@pytest.mark.slow
def test_resume_drops_a_torn_last_line_of_metrics_and_samples(
    capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    out = tmp_path / "run"
    argv = small_run(
        out,
        cache_dir,
        tiny_gpt2_config,
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--sample_prompts",
        "def",
        "--sample_every",
        "1",
        "--no_export_hf",
    )
    run_killed_after_first_checkpoint(monkeypatch, lambda: main(argv))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # the crash hit mid-write: no newline
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "samples": [{"prompt": "de')
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()  # the launcher logs to stdout
    assert "Traceback" not in captured.out + captured.err
    records = read_metrics(out)  # every line is JSON again
    assert max(r["step"] for r in records) == 4 and [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3, 4]
    torn = [line for line in captured.out.splitlines() if "WARNING" in line and "torn" in line]
    assert len(torn) == 2 and any("metrics.jsonl" in m for m in torn) and any("samples.jsonl" in m for m in torn)


def test_report_readers_tolerate_torn_lines(tmp_path, caplog):
    from spmdlm.train.reporting.metrics_log import read_records, repair_torn_tail

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo{"step": 0, "event": "compile"}\n{"step": 3}\n{"step": 4, "l')
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        assert [r["step"] for _, r in read_records(path)] == [1, 3]
    assert len(caplog.records) == 1 and "dropped 2 unreadable lines" in caplog.records[0].getMessage()
    repair_torn_tail(path)
    assert path.read_text().endswith('{"step": 3}\n')
    path.write_text('{"step": 1}\n{"step": 2}')  # cut just before its newline: the record is whole, kept
    repair_torn_tail(path)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


# -- 2: a seed Grain refuses; an args file that does not parse --------------------------------------------------------
@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seed_out_of_range(capsys, tmp_path, cache_dir, tiny_gpt2_config, seed):
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--seed", seed))
    assert f"--seed must be in [0, {2**32 - 1}]" in line and seed in line
    assert not (tmp_path / "run").exists()


def test_largest_seed_is_accepted():
    from spmdlm.cli.launch import parse_args

    assert parse_args(["--seed", str(2**32 - 1)])[0].control.seed == 2**32 - 1


@pytest.mark.parametrize(
    "name, text, expected",
    [
        (
            "args.json",
            '{"max_steps": 4,, }',
            "is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 17",
        ),
        ("args.yaml", "max_steps: 4\n  seed: [1\n", "is not valid YAML: mapping values are not allowed here at line 2"),
        ("args.yml", "seed: [1, 2\n", "is not valid YAML:"),
    ],
)
def test_malformed_args_file(capsys, tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    line = refused(capsys, str(path), "--output_dir", str(tmp_path / "run"))
    assert str(path) in line and expected in line, line


def test_args_file_not_text(capsys, tmp_path):
    path = tmp_path / "args.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert "is not UTF-8 text" in refused(capsys, str(path))


# -- 3: optimiser values that cannot train --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--learning_rate", "-1", "--learning_rate must be at least 0, got -1.0 (a negative rate climbs the loss)"),
        ("--learning_rate", "nan", "--learning_rate must be a finite number at least 0, got nan"),
        ("--weight_decay", "-0.1", "--weight_decay must be at least 0, got -0.1 (0 = off)"),
        ("--max_grad_norm", "-1", "--max_grad_norm must be at least 0, got -1.0 (0 = no clipping)"),
        ("--warmup_steps", "-5", "--warmup_steps must be at least 0, got -5"),
    ],
)
def test_negative_optimiser_values(capsys, tmp_path, cache_dir, tiny_gpt2_config, flag, value, expected):
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, flag, value))
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_zero_learning_rate_is_allowed_with_a_warning(caplog, tmp_path, cache_dir, tiny_gpt2_config):
    from spmdlm.cli.launch import parse_args
    from spmdlm.train.stages import resolve as setup

    args, _ = parse_args(small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--learning_rate", "0"))
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        setup.resolve(args, 0.0)
    assert any("--learning_rate 0: training will not change the weights" in r.getMessage() for r in caplog.records)


# -- 4: a validation file that is a training file ---------------------------------------------------------------------
def test_validation_file_among_the_train_files_warns(caplog, tmp_path, cache_dir, tiny_gpt2_config):
    from spmdlm.cli.launch import parse_args
    from spmdlm.train.stages import corpora

    other = tmp_path / "other.txt"
    other.write_text("some other text\n")
    link = tmp_path / "same.txt"
    os.symlink(FIXTURES / "overfit.txt", link)  # the same file through another name
    argv = small_run(
        tmp_path / "run",
        cache_dir,
        tiny_gpt2_config,
        "--train_file",
        f"{other},{FIXTURES / 'overfit.txt'}",
        "--validation_file",
        str(link),
    )
    args, _ = parse_args(argv)
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        corpora.read_corpora(args.data)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the evaluation measures training data" in warnings[0] and str(link) in warnings[0]

    caplog.clear()
    args, _ = parse_args([*argv[:-1], str(other.with_name("held_out.txt"))])
    other.with_name("held_out.txt").write_text("held out text\n")
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        corpora.read_corpora(args.data)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- 5: evaluation only, with nothing held out ------------------------------------------------------------------------
def test_eval_only_with_nothing_held_out(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    line = refused(
        capsys,
        *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--do_eval", "--validation_split_percentage", "0"),
    )
    assert "nothing to evaluate" in line and "--validation_file" in line and "--validation_split_percentage" in line
    assert not (tmp_path / "run").exists()


def test_train_and_eval_with_nothing_held_out_still_trains():
    from spmdlm.cli.launch import parse_args

    args, _ = parse_args(["--do_train", "--do_eval", "--validation_split_percentage", "0"])
    assert args.control.training and args.control.evaluating


# -- 6: a FIFO as an input file ----------------------------------------------------------------------------------------
def test_fifo_train_file(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--train_file", str(fifo)))
    assert f"--train_file {fifo}: is not a regular file (a FIFO); give a file" in line
    assert not (tmp_path / "run").exists()


def test_fifo_in_a_directory_is_skipped(tmp_path, caplog):
    from spmdlm.data import readers

    (tmp_path / "a.txt").write_text("text\n")
    os.mkfifo(tmp_path / "b.txt")
    with caplog.at_level(logging.WARNING):
        assert readers.expand_files(str(tmp_path)) == [tmp_path / "a.txt"]
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
