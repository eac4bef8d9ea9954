"""The command lines answer fast and helpfully: an unknown flag gets a "did you mean", and --help and argument errors
are answered from a remembered description of the verb's parser before JAX loads (spmdlm/cli/__init__.py), the same
text and exit status as the verb's own parse."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from spmdlm import cli
from spmdlm.cli import evaluate, export, generate, prepare, tokenizer
from spmdlm.cli.launch import build_parser, family_choices, main, parse_args
from spmdlm.errors import ArgumentError
from spmdlm.families import ENTRY_POINT_GROUP, families, family_names
from spmdlm.optimizers import OPTIMIZER_GROUP, SCHEDULE_GROUP

HEAVY = ("jax", "flax", "optax", "orbax", "grain", "transformers", "torch")  # what the quick answer must not import


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home of its own: the descriptions go to HOME/.cache/spmdlm/flags; the process's fingerprint afresh."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(cli, "_current", set())
    cli.fingerprint.cache_clear()
    yield tmp_path
    cli.fingerprint.cache_clear()


def one_line(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# -- did you mean ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "given,meant",
    [
        ("--lr", "--learning_rate"),
        ("--num_steps", "--max_steps"),
        ("--steps", "--max_steps"),
        ("--epochs", "--num_train_epochs"),
        ("--batch_size", "--per_device_train_batch_size or --global_batch_size"),
        ("--seq_len", "--max_seq_length or --block_size"),
        ("--learning_rat", "--learning_rate"),
        ("--max-steps", "--max_steps"),
        ("--Output_Dir", "--output_dir"),
    ],
)
def test_an_unknown_flag_names_the_flag_it_probably_meant(capsys, given, meant):
    line = one_line(capsys, main([given, "3"]))
    assert line == (
        f"error: unrecognized arguments: {given} 3; did you mean {meant}? (python -m spmdlm.launch --help lists the "
        "flags)"
    )


def test_several_unknown_flags_and_one_nothing_is_close_to():
    with pytest.raises(ArgumentError) as raised:
        parse_args(["--lr", "1", "--epochs", "2"])
    assert "did you mean --learning_rate for --lr, --num_train_epochs for --epochs?" in str(raised.value)
    with pytest.raises(ArgumentError) as raised:
        parse_args(["--zzzzqqq", "1"])
    assert str(raised.value) == "unrecognized arguments: --zzzzqqq 1 (python -m spmdlm.launch --help lists the flags)"


def test_an_arguments_file_key_gets_one_too(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"lr": 1e-3, "max_steps": 10}))
    with pytest.raises(ArgumentError, match=r"unknown keys lr; did you mean learning_rate\?"):
        parse_args([str(tmp_path / "args.json")])


@pytest.mark.parametrize(
    "verb,argv,meant",
    [
        (export.main, ["--checkpoint", "c", "--out", "o", "--stepp", "3"], "--step"),
        (generate.main, ["--model_name_or_path", "m", "--prompt", "x", "--max_tokens", "3"], "--max_new_tokens"),
        (prepare.main, ["--tokenizer", "t", "--for_model", "gpt2", "--out", "o", "--output", "x"], "--out"),
        (tokenizer.main, ["--vocab_size", "9", "--out", "o", "--model", "gpt2"], "--for_model"),
    ],
    ids=["export", "generate", "prepare", "tokenizer"],
)
def test_every_verb_answers_an_unknown_flag_in_one_line(capsys, verb, argv, meant):
    line = one_line(capsys, verb(argv))
    assert f"; did you mean {meant}? (python -m spmdlm." in line


def test_a_missing_flag_is_one_line_too(capsys):
    line = one_line(capsys, export.main(["--out", "o"]))
    assert line == (
        "error: the following arguments are required: --checkpoint (python -m spmdlm.export --help lists the flags)"
    )


# -- a parser as data --------------------------------------------------------------------------------------------------
PARSERS = {
    "launch": lambda: build_parser(family_choices()),
    "evaluate": evaluate.parser,
    "export": export.build_parser,
    "generate": generate.parser,
    "prepare": prepare.build_parser,
    "tokenizer": tokenizer.build_parser,
}


@pytest.mark.parametrize("verb", PARSERS)
def test_a_described_parser_prints_and_parses_as_the_verb_s(verb, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parser = PARSERS[verb]()
    rebuilt = cli.rebuild(json.loads(json.dumps(cli.describe(parser))))
    assert rebuilt.format_help() == parser.format_help()
    assert [a.option_strings for a in rebuilt._actions] == [a.option_strings for a in parser._actions]
    assert cli.verb_of(parser) == verb


# -- the quick answer --------------------------------------------------------------------------------------------------
def remembered(home, argv=("--max_steps", "3")):
    """The launcher's parser described as a command line leaves it (HOME/.cache/spmdlm/flags/launch.json)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "command_line_verb", lambda: "launch")
        parse_args(list(argv))
    path = home / ".cache" / "spmdlm" / "flags" / "launch.json"
    assert json.loads(path.read_text())["fingerprint"] == cli.fingerprint()
    return path


def quick(capsys, argv) -> tuple[int | None, str, str]:
    try:
        cli.answer_early("launch", argv)
        code = None  # goes on to the verb
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["--lr", "3"],
        ["--max_steps", "three"],
        ["--learning_rate", "-1"],
        ["--seed", "inf"],
        ["--do_train", "maybe"],
        ["--model_type"],
        ["ARGS"],  # an arguments file with a key of another tool
    ],
)
def test_the_quick_answer_is_the_verb_s_own(home, capsys, argv):
    remembered(home)
    (home / "args.yaml").write_text("num_steps: 3\n")
    argv = [str(home / "args.yaml") if a == "ARGS" else a for a in argv]
    code, out, err = quick(capsys, argv)
    assert (code, out) == (2, "")
    assert err.splitlines() == [one_line(capsys, main(argv))]


def test_help_is_answered_whole_and_a_good_command_line_goes_on(home, capsys):
    remembered(home)
    assert quick(capsys, ["--help"]) == (0, build_parser(family_choices()).format_help(), "")
    (home / "args.json").write_text(json.dumps({"learning_rate": 1e-3}))
    for argv in (["--max_steps", "3", "--no_do_eval"], [str(home / "args.json"), "--block_size", "64"]):
        assert quick(capsys, argv) == (None, "", "")


def test_a_stale_or_damaged_description_is_not_used(home, capsys):
    path = remembered(home)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "fingerprint", lambda: "of other code")
        assert quick(capsys, ["--lr", "3"]) == (None, "", "")  # the verb itself answers
    path.write_text("{not json")
    assert quick(capsys, ["--lr", "3"]) == (None, "", "")


def test_a_library_call_writes_no_description(home):
    parse_args(["--max_steps", "3"])
    assert not (home / ".cache").exists()


def test_python_m_launch_answers_without_loading_jax(home):
    """The process-level point: a fresh `python -m spmdlm.launch --help` (and an unknown flag) imports none of JAX,
    Flax, transformers or torch once the launcher's parser is remembered."""
    remembered(home)
    env = {**os.environ, "HOME": str(home), "COLUMNS": "100"}
    run = lambda *argv: subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spmdlm.launch", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    shown = run("--help")
    imported = {line.split("|")[-1].strip().split(".")[0] for line in shown.stderr.splitlines() if "|" in line}
    assert shown.returncode == 0 and shown.stdout == build_parser(family_choices()).format_help()
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    refused = run("--lr", "3")
    errors = [line for line in refused.stderr.splitlines() if not line.startswith("import time:")]
    assert refused.returncode == 2 and len(errors) == 1 and "did you mean --learning_rate?" in errors[0]


# -- the registries, as the quick answer and the lists see them --------------------------------------------------------
def test_the_family_names_listed_without_loading_equal_the_registry():
    assert family_names() == list(families())


def test_the_fingerprint_covers_every_registry_s_plugins():
    assert set(cli.ENTRY_POINT_GROUPS) == {ENTRY_POINT_GROUP, OPTIMIZER_GROUP, SCHEDULE_GROUP}


def test_the_evaluator_s_quick_answer_is_its_own(home, capsys):
    argv = ["--model_name_or_path", str(home), "--validation_file", "x", "--block_sizes", "3"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "command_line_verb", lambda: "evaluate")
        with pytest.raises(ArgumentError):
            evaluate.parse(argv)  # the evaluator describes its parser and the launcher's
    with pytest.raises(SystemExit) as answered:
        cli.answer_early("evaluate", argv)
    err = capsys.readouterr().err
    assert answered.value.code == 2
    assert err.splitlines() == [one_line(capsys, evaluate.main(argv))]
    assert "unrecognized arguments: --block_sizes 3; did you mean --block_size?" in err
