"""python -m spmdlm.evaluate refuses in one line (exit 2), before it evaluates or writes anything: an --output_file
in a folder that does not exist, a run folder holding an export (pointed to the export), a tokenizer larger than the
model, an empty --validation_file."""

from pathlib import Path

import pytest
from test_evaluate import evaluation_flags, transformers_checkpoint, words
from tokenizers import Tokenizer

from spmdlm.cli import evaluate


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("export")
    held_out = folder / "held_out.txt"
    held_out.write_text("\n".join(" ".join(words(40)) for _ in range(30)))
    return transformers_checkpoint("gpt2", folder / "model"), held_out


def evaluator_argv(gpt2_export, cache_dir, *extra: str) -> list[str]:
    model, held_out = gpt2_export
    return ["--model_name_or_path", str(model), *evaluation_flags("gpt2", cache_dir, held_out), *extra]


def test_the_evaluator_checks_the_output_folder_before_evaluating(capsys, tmp_path, cache_dir, gpt2_export):
    missing = tmp_path / "no-such-folder" / "results.json"
    code = evaluate.main(evaluator_argv(gpt2_export, cache_dir, "--output_file", str(missing)))
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"error: --output_file {missing}: the folder {missing.parent} does not exist; create it or give another path"
    ]
    assert "reading" not in err and not missing.parent.exists()


def test_a_folder_holding_an_export_is_pointed_to_it(capsys, tmp_path, cache_dir, gpt2_export):
    model, held_out = gpt2_export
    run = tmp_path / "run"
    run.mkdir()
    (run / "hf").symlink_to(model)
    code = evaluate.main(["--model_name_or_path", str(run), *evaluation_flags("gpt2", cache_dir, held_out)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1].endswith(f"give one of those; its export {run / 'hf'} is one")


def test_a_tokenizer_larger_than_the_model_is_refused_without_the_training_flag(
    capsys, tmp_path, cache_dir, gpt2_export
):
    tok = Tokenizer.from_file(str(gpt2_export[0] / "tokenizer.json"))
    tok.add_tokens([f"added{i}" for i in range(600)])
    assert tok.get_vocab_size() > 512  # the tiny GPT-2's vocab_size
    tok.save(str(tmp_path / "big.json"))
    code = evaluate.main(evaluator_argv(gpt2_export, cache_dir, "--tokenizer_name", str(tmp_path / "big.json")))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: the tokenizer has {tok.get_vocab_size()} tokens but the model has")
    assert "--vocab_size" not in err[-1]


# -- an empty --validation_file ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["0-bytes", "blank-lines"])
def test_an_empty_validation_file_is_named_as_empty_and_nothing_is_written(text, tmp_path, capsys):
    folder = transformers_checkpoint("gpt2", tmp_path / "hf")
    (tmp_path / "heldout.txt").write_text(text)
    capsys.readouterr()
    argv = ["--model_name_or_path", str(folder), "--validation_file", str(tmp_path / "heldout.txt")]
    assert evaluate.main([*argv, "--block_size", "32", "--output_file", str(tmp_path / "results.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "results.json").exists()
    named = f"error: --validation_file {tmp_path / 'heldout.txt'} is empty (no text, or only blank lines)"
    assert captured.err == f"{named}; give held-out text\n"
