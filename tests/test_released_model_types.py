"""Released model types of our architectures continue, evaluate and export as themselves: an xlm-roberta or mt5
checkpoint trains, exports with its own model_type and architecture and reloads in transformers with the same
logits; an mT5 saved by transformers 5 reads with its own head; camembert reads as roberta; what cannot be read as
released (an mT5 head tied to shared, umt5) is refused naming why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from family_fixtures import FIXTURES
from safetensors import safe_open
from test_evaluate import evaluation_flags, words
from test_families import assert_close_where_read, our_logits

from spmdlm import hf_export
from spmdlm.cli import evaluate
from spmdlm.cli.launch import main
from spmdlm.data.tokenization import save_tokenizer, train_tokenizer
from spmdlm.errors import ConfigError
from spmdlm.families import checked_config, get_family

# -- released model types of our architectures ------------------------------------------------------------------------
RELEASED = {  # model_type -> (family, its transformers model and config classes, the Auto class that loads it)
    "xlm-roberta": ("roberta", transformers.XLMRobertaForMaskedLM, transformers.XLMRobertaConfig, "MaskedLM"),
    "mt5": ("t5", transformers.MT5ForConditionalGeneration, transformers.MT5Config, "Seq2SeqLM"),
}


def released_checkpoint(model_type: str, folder: Path, head: str = "as released"):
    """A random transformers model saved as its model_type ships, with a tokenizer trained here. An mT5's `head`: "as
    released" (its own lm_head, config.json saying untied, as google/mt5-* are), "as saved" (its own, config.json as
    transformers 5 writes it: tied), "tied" (shared's, as transformers 5 creates the model, saved as it is)."""
    family, model_class, config_class, _ = RELEASED[model_type]
    fixture = FIXTURES[family]
    given = ("model_type", "feed_forward_proj", "tie_word_embeddings")
    values = {k: v for k, v in fixture.tiny_config.items() if k not in given}
    if family == "t5":
        values.update(tie_word_embeddings=False, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = model_class(config_class(**values)).eval()
    if head != "tied":
        fixture.prepare_hf(model)
    model.save_pretrained(folder)
    if family == "t5" and head == "as released":  # config.json says untied (transformers 5 writes its forced `true`)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    save_tokenizer(train_tokenizer(get_family(family), words(), 400), folder, get_family(family), 64)
    return model


def logits(model, family: str) -> np.ndarray:
    batch = FIXTURES[family].make_batch(model.config.to_dict(), np.random.default_rng(0))
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(RELEASED))
def test_a_released_model_type_continues_evaluates_and_exports_as_itself(model_type, tmp_path, cache_dir):
    family, model_class, _, auto = RELEASED[model_type]
    folder, out, held_out = tmp_path / "checkpoint", tmp_path / "out", tmp_path / "heldout.txt"
    model = released_checkpoint(model_type, folder)
    held_out.write_text("\n".join(words(60)) + "\n")
    flags = list(FIXTURES[family].run_flags)
    flags[flags.index("--learning_rate") + 1] = "0"
    argv = ["--model_name_or_path", str(folder), "--train_file", str(held_out), "--output_dir", str(out)]
    assert main([*argv, "--cache_dir", str(cache_dir), *flags, "--global_batch_size", "8", "--max_steps", "1"]) == 0
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["model_type"] == model_type and exported["architectures"] == [model_class.__name__]
    reloaded = getattr(transformers, f"AutoModelFor{auto}").from_pretrained(out / "hf").eval()
    assert type(reloaded) is model_class
    np.testing.assert_allclose(logits(reloaded, family), logits(model, family), rtol=0, atol=1e-5)
    if model_type == "xlm-roberta":  # the evaluator reads it as shipped (its loader is the one mT5's run took)
        results = tmp_path / "results.json"
        evaluate_argv = ["--model_name_or_path", str(folder), "--output_file", str(results)]
        assert evaluate.main([*evaluate_argv, *evaluation_flags(family, cache_dir, held_out)]) == 0
        assert np.isfinite(json.loads(results.read_text())["loss"])


@pytest.mark.slow
def test_an_mt5_saved_by_transformers_5_reads_with_its_own_head_and_one_tied_to_shared_is_refused(tmp_path, capsys):
    folder = tmp_path / "as-saved"
    model = released_checkpoint("mt5", folder, head="as saved")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True  # transformers 5's words
    assert "lm_head.weight" in safe_open(folder / "model.safetensors", "np").keys()
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()  # untied: the logits of the saved model
    np.testing.assert_allclose(logits(theirs, "t5"), logits(model, "t5"), rtol=0, atol=1e-6)
    ours, config = hf_export.load_hf(folder)
    assert config.model_type == "mt5"
    batch = FIXTURES["t5"].make_batch(model.config.to_dict(), np.random.default_rng(0))
    assert_close_where_read(our_logits(ours, batch), logits(model, "t5"), batch, "t5")
    exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_export.save_hf(ours, config, tmp_path / "hf"))
    assert type(exported) is transformers.MT5ForConditionalGeneration
    np.testing.assert_allclose(logits(exported.eval(), "t5"), logits(model, "t5"), rtol=0, atol=1e-5)

    tied = tmp_path / "tied"  # as transformers 5 creates an mT5: its head is shared, so the file has none
    released_checkpoint("mt5", tied, head="tied")
    assert "lm_head.weight" not in safe_open(tied / "model.safetensors", "np").keys()
    capsys.readouterr()
    argv = ["--model_name_or_path", str(tied), "--train_file", "/absent/corpus.txt", "--output_dir", "/absent/out"]
    assert main([*argv, "--max_seq_length", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tied}: this mt5 checkpoint has its lm_head tied to shared (no lm_head.weight")
    assert err.count("\n") == 1 and "model.lm_head.weight = torch.nn.Parameter(" in err


def test_camembert_reads_as_roberta_and_umt5_is_refused_naming_why():
    config = checked_config({**FIXTURES["roberta"].tiny_config, "model_type": "camembert"}, None, "ckpt")
    assert get_family(config.model_type).name == "roberta"
    assert config.to_hf_dict()["architectures"] == ["CamembertForMaskedLM"]
    assert config.to_hf_dict()["model_type"] == "camembert"
    with pytest.raises(ConfigError, match=r"^ckpt holds a 'umt5' model: .*its own relative position bias[^\n]*$"):
        checked_config({**FIXTURES["t5"].tiny_config, "model_type": "umt5"}, None, "ckpt")
