"""What a user reads on a first try: the PyTorch hint only where PyTorch is missing, a model card that names no
absolute local path, fill-mask labelled with the tokenizer's own mask token, and a glob that matches nothing called
so."""

import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from spmdlm import hf_export
from spmdlm.cli import generate
from spmdlm.data import readers
from spmdlm.errors import DataError
from spmdlm.families import get_family, load_config
from spmdlm.generation import mask_token
from spmdlm.train import publish


# -- the PyTorch hint --------------------------------------------------------------------------------------------------
def test_the_pytorch_hint_only_where_pytorch_is_missing(monkeypatch, tmp_path):
    family = get_family("roberta")
    assert importlib.util.find_spec("torch") is not None  # the test extra installs it
    assert hf_export.what_it_needs(family, tmp_path) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    hint = hf_export.what_it_needs(family, tmp_path)
    assert hf_export.TORCH_CPU_INSTALL in hint and f"--model_name_or_path {tmp_path}" in hint


# -- the model card names the Hub id or a relative path ----------------------------------------------------------------
def prepared(out: Path, hub_model_id: str | None = None, hub=None):
    """What the card's naming reads of a run: its output dir, --hub_model_id, the Hub repository once created."""
    output = SimpleNamespace(hub_model_id=hub_model_id)
    return SimpleNamespace(run=SimpleNamespace(out=out, args=SimpleNamespace(output=output)), hub=hub)


def usage_id(out: Path, **hub) -> str:
    return publish.usage_id(prepared(out, **hub), out / "hf")


def test_the_card_names_the_export_by_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert usage_id(Path("runs/gpt2-tiny-stdlib")) == "runs/gpt2-tiny-stdlib/hf"
    assert usage_id(tmp_path / "runs" / "mine") == "runs/mine/hf"  # below where the run started
    assert usage_id(tmp_path.parent / "other" / "run") == "run/hf"  # elsewhere: the output dir's name
    assert hf_export.card_path(tmp_path / "exports" / "b") == "exports/b"  # python -m spmdlm.export's card


def test_the_card_names_the_hub_id_when_there_is_one(tmp_path):
    assert usage_id(tmp_path / "run", hub_model_id="someone/tiny") == "someone/tiny"
    hub = SimpleNamespace(repo_id="someone/run")  # --push_to_hub: the repository's full id
    assert usage_id(tmp_path / "run", hub=hub) == "someone/run"
    code = hf_export.usage_snippet(get_family("gpt2"), usage_id(tmp_path / "run", hub=hub))
    assert 'model_id = "someone/run"' in code and str(tmp_path) not in code


# -- fill-mask: the tokenizer's own mask token -------------------------------------------------------------------------
@pytest.mark.parametrize("family,token", [("roberta", "<mask>"), ("modernbert", "[MASK]")])
def test_fill_mask_is_labelled_with_the_tokenizer_s_mask_token(family, token, capsys):
    config = load_config(get_family(family).default_preset, family)
    assert mask_token(config) == token
    records = [{"text": f"a {token} b", "mask": 0, "candidates": [{"token": "x", "id": 7, "probability": 0.5}]}]
    generate.show(argparse.Namespace(json=False, fill_mask=True), records, "", mask=mask_token(config))
    assert capsys.readouterr().out.splitlines() == [f"{token} 1:", "  0.5000  'x'"]


def test_fill_mask_s_help_names_each_mask_token():
    (action,) = [a for a in generate.parser()._actions if "--fill_mask" in a.option_strings]
    assert "roberta: <mask>" in action.help and "modernbert: [MASK]" in action.help


# -- a glob that matches nothing ---------------------------------------------------------------------------------------
def test_a_glob_that_matches_nothing_is_called_so(tmp_path):
    pattern = str(tmp_path / "corpus" / "*.txt")
    with pytest.raises(DataError) as raised:
        readers.expand_files(pattern)
    assert str(raised.value) == f"--train_file: the glob {pattern} matches no file; check its folder and pattern"
    with pytest.raises(DataError, match="nope.txt: no such file"):  # a path is still a path
        readers.expand_files(str(tmp_path / "nope.txt"))
