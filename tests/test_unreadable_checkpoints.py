"""A checkpoint that cannot be read is named in one line with its cause, never with a traceback or wrong advice: a
damaged model.safetensors, a config.json whose vocab_size was edited, checkpoints that do not restore into the model
a read-only command (export, generate) builds, and the evaluator's fallback past damaged ones (one warning each)."""

import json
import logging

import pytest
from test_evaluate import transformers_checkpoint, words
from test_reliability import DAMAGE, flags

from spmdlm import checkpoint
from spmdlm.cli import evaluate
from spmdlm.cli.launch import main


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


# -- an edited vocab_size in config.json ---------------------------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [400, 600], ids=["below-the-tokenizer", "above-the-weights"])
def test_an_edited_vocab_size_is_named_not_blamed_on_the_tokenizer(vocab_size, tmp_path, capsys):
    folder = transformers_checkpoint("roberta", tmp_path / "hf")  # 512 embedding rows, a 512-token tokenizer
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    capsys.readouterr()
    argv = ["--model_name_or_path", str(folder), "--train_file", "/absent/corpus.txt", "--output_dir", "/absent/out"]
    assert main([*argv, "--max_seq_length", "32"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {folder}: config.json's vocab_size ({vocab_size}) does not match the checkpoint's embedding (512 "
        "rows); set it back to 512 (to add tokens, extend the tokenizer and pass it as --tokenizer_name: the "
        "embedding grows)\n"
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


# -- falling back from damaged checkpoints: one line each, no traceback ----------------------------------------------
def restore_leaving_orphans(restore):
    """The real restore; where it fails, what orbax's abandoned reads log when their callbacks find the event loop
    closed (timing-dependent on a loaded host, so sent here as they arrive: from asyncio and concurrent.futures)."""

    def restoring(*args, **kwargs):
        try:
            return restore(*args, **kwargs)
        except checkpoint.CheckpointError:
            closed = RuntimeError("Event loop is closed")
            for name, message in (("asyncio", "Exception in callback"), ("concurrent.futures", "exception calling")):
                for _ in range(5):
                    logging.getLogger(name).error(message, exc_info=(RuntimeError, closed, None))
            raise

    return restoring


@pytest.mark.slow
def test_the_evaluator_falls_back_past_damaged_checkpoints_in_one_line_each(
    tmp_path, cache_dir, tiny_gpt2_config, monkeypatch, capsys
):
    out = tmp_path / "run"
    assert main(flags(out, cache_dir, tiny_gpt2_config)) == 0  # checkpoints at steps 2 and 4
    held_out = tmp_path / "heldout.txt"
    held_out.write_text("\n".join(words(40)) + "\n")
    monkeypatch.setattr(checkpoint, "restore", restore_leaving_orphans(checkpoint.restore))
    argv = ["--model_name_or_path", str(out), "--validation_file", str(held_out), "--block_size", "16"]
    steps = sorted((out / "checkpoints").iterdir(), key=lambda step: int(step.name))
    DAMAGE["data_file_deleted"](steps[-1])
    capsys.readouterr()
    assert evaluate.main([*argv, "--max_eval_samples", "8"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert [line.split(" ", 2)[1] for line in err.splitlines()].count("WARNING") == 1
    assert [line for line in err.splitlines() if " INFO " not in line][0].endswith("trying the previous one")
    DAMAGE["data_file_deleted"](steps[0])  # all damaged: the two warnings and one short error line
    assert evaluate.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if " INFO " not in line]
    assert len(lines) == 3 and "Traceback" not in "\n".join(lines)
    assert lines[2].startswith(f"error: no checkpoint in {out / 'checkpoints'} can be restored")
    assert len(lines[2].removeprefix("error: ")) - len(str(out / "checkpoints")) <= 200  # less the folder it names
