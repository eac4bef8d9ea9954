"""One config resolution: a preset, a JSON file, an HF config directory and --model_name_or_path all go through the
family's config checks, for training and for export alike (a config the model cannot reproduce is refused in one
line with exit 2, whichever way it comes in)."""

import dataclasses
import json

import pytest
from conftest import FIXTURES

from spmdlm import hf_export, launch
from spmdlm.cli.export import main as export_main
from spmdlm.errors import ConfigError
from spmdlm.families import checked_config, families, load_config, load_pretrained_config

LAYERDROP = {
    "model_type": "bart",
    "vocab_size": 512,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
    "encoder_layerdrop": 0.2,
}


@pytest.fixture
def layerdrop_dir(tmp_path):
    folder = tmp_path / "bart-layerdrop"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LAYERDROP))
    return folder


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--config_name", "--model_name_or_path"])
def test_the_launcher_refuses_layerdrop_by_either_flag(flag, layerdrop_dir, tmp_path, capsys):
    code = launch.main(
        [
            flag,
            str(layerdrop_dir),
            "--train_file",
            str(FIXTURES / "overfit.txt"),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
            "--mesh",
            "data=8",
        ]
    )
    assert "encoder_layerdrop 0.2 is not supported" in one_line_error(capsys, code)
    assert not (tmp_path / "out").exists()


def test_export_refuses_it_from_a_checkpoint_and_from_a_transformers_dir(layerdrop_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"checkpoint_format": 2, "model_config": LAYERDROP}))
    code = export_main(["--checkpoint", str(run), "--out", str(tmp_path / "hf")])
    assert "encoder_layerdrop 0.2 is not supported" in one_line_error(capsys, code)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError, match="encoder_layerdrop"):
        hf_export.load_hf(layerdrop_dir)


def test_every_source_runs_the_checks(layerdrop_dir, tmp_path):
    file = tmp_path / "bart.json"
    file.write_text(json.dumps(LAYERDROP))
    for source in (str(layerdrop_dir), str(file)):
        with pytest.raises(ConfigError, match="encoder_layerdrop"):
            load_config(source)
    with pytest.raises(ConfigError, match="encoder_layerdrop"):
        load_pretrained_config(layerdrop_dir)
    assert load_config("bart-tiny").encoder_layers == 2  # a shipped preset passes the same checks


# What a config.json leaves out means transformers' default to transformers; spmdlm must read it the same, or refuse.
SAID_FOR_SPMDLM = {"t5": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}}  # absent: refused


@pytest.mark.parametrize("model_type", sorted(families()))
def test_a_config_json_means_what_transformers_reads_from_it(model_type):
    import transformers

    said = SAID_FOR_SPMDLM.get(model_type, {})
    ours = checked_config({"model_type": model_type, **said}, None, "config.json")
    theirs = type(transformers.AutoConfig.for_model(model_type))(**said)
    # transformers 5's T5Config sets tie_word_embeddings true whatever it is given, keeping the truth in
    # scale_decoder_outputs (docs/architecture.md §5): compared as that
    quirk = {"tie_word_embeddings"} if model_type == "t5" else set()
    if quirk:
        assert theirs.scale_decoder_outputs is ours.tie_word_embeddings is False
    # transformers 5 reads an absent rope_scaling as its rope_parameters (the theta and the default type): compared
    # as what it means, the rotary frequencies of rope_theta unscaled
    if model_type in ("llama", "qwen3"):
        quirk.add("rope_scaling")
        assert ours.rope_scaling is None
        assert theirs.rope_scaling == {"rope_theta": ours.rope_theta, "rope_type": "default"}
    compared = [f.name for f in dataclasses.fields(ours) if hasattr(theirs, f.name) and f.name not in quirk]
    assert len(compared) >= 10
    as_read = lambda value: list(value) if isinstance(value, tuple) else value  # noqa: E731 (a JSON list either way)
    assert {name: as_read(getattr(ours, name)) for name in compared} == {
        name: as_read(getattr(theirs, name)) for name in compared
    }
    if said:  # what spmdlm cannot honour: refused in one line, not read differently
        with pytest.raises(ConfigError, match="^T5 feed_forward_proj 'relu' \\(absent: transformers' default\\)"):
            checked_config({"model_type": model_type}, None, "config.json")
        with pytest.raises(ConfigError, match="tie_word_embeddings is absent"):
            checked_config({"model_type": model_type, "feed_forward_proj": "gated-gelu"}, None, "config.json")
