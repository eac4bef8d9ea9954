"""What an export directory holds, as transformers and the file system see it: loading messages, tokenizer ids,
file modes, and no transformers import on the export path."""

import importlib.metadata
import logging
import os
import stat
import subprocess
import sys
import warnings

import jax
import pytest
import transformers
from conftest import FIXTURES, REPO
from flax import nnx

from spmdlm.data.tokenization import special_token_ids, train_tokenizer
from spmdlm.families import get_family, load_config
from spmdlm.families.t5.model import T5ForConditionalGeneration
from spmdlm.hf_export import hf_config_dict, save_hf


@pytest.fixture(scope="module")
def t5_tokenizer():
    return train_tokenizer(get_family("t5"), FIXTURES.joinpath("overfit.txt").read_text().splitlines(), 300)


@pytest.fixture(scope="module")
def t5_model(t5_tokenizer):
    config = load_config("t5-v1_1-tiny", vocab_size=t5_tokenizer.get_vocab_size(), num_layers=1, num_decoder_layers=1)
    # Jitted, with the rbg generator: far quicker to compile on CPU than eager threefry init.
    model = nnx.jit(lambda: T5ForConditionalGeneration(config, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))))()
    return model, config


@pytest.fixture(scope="module")
def t5_export(t5_model, t5_tokenizer, tmp_path_factory):
    model, config = t5_model
    return save_hf(model, config, tmp_path_factory.mktemp("t5-export"), t5_tokenizer)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_t5_export_loads_with_no_tying_warning_of_its_own(t5_export):
    torch = pytest.importorskip("torch")
    logger, records = logging.getLogger("transformers"), _Records()  # transformers' loggers do not propagate
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.AutoModelForSeq2SeqLM.from_pretrained(t5_export)
    finally:
        logger.removeHandler(records)
        transformers.logging.set_verbosity(verbosity)
    assert [str(w.message) for w in caught] == []
    # transformers 5 forces T5Config.tie_word_embeddings to True whatever config.json says, so it warns about the
    # untied head of every T5 v1.1 checkpoint, its own save_pretrained output included. Nothing else may warn.
    forced = transformers.T5Config(tie_word_embeddings=False).tie_word_embeddings
    assert len(records.messages) == int(forced), records.messages
    assert all("tie shared.weight to lm_head.weight" in m for m in records.messages), records.messages
    assert model.encoder.embed_tokens.weight.data_ptr() == model.shared.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    assert not model.config.scale_decoder_outputs


def test_t5_export_tokenizer_ids_match_ours(t5_export, t5_tokenizer):
    hf = transformers.AutoTokenizer.from_pretrained(t5_export, local_files_only=True)
    # The generic class: T5TokenizerFast rebuilds the pipeline without our normalizer and pre-tokenizer.
    assert type(hf) is transformers.PreTrainedTokenizerFast
    ids = special_token_ids(t5_tokenizer, get_family("t5"))
    assert (hf.pad_token_id, hf.eos_token_id, hf.unk_token_id) == (ids["pad"], ids["eos"], ids["unk"])
    texts = [
        "The lighthouse keeper lit the lamp.",
        "a <extra_id_0> b <extra_id_1> c <extra_id_99>",
        "year 2024, not 1999! ﬁ  ⁂",
        "",
    ]
    for text in texts:
        ours = t5_tokenizer.encode(text).ids
        assert hf(text)["input_ids"] == ours and ours[-1] == ids["eos"], text
        assert hf.decode(ours) == t5_tokenizer.decode(ours, skip_special_tokens=False), text
    assert ids["unk"] in t5_tokenizer.encode(texts[2]).ids  # ⁂ is not in the corpus
    assert (
        hf.decode(hf("The lighthouse keeper lit the lamp.")["input_ids"], skip_special_tokens=True)
        == "The lighthouse keeper lit the lamp."
    )
    batch = hf([texts[0], ""], padding=True)["input_ids"]
    assert batch[0] == t5_tokenizer.encode(texts[0]).ids
    assert batch[1] == [ids["eos"]] + [ids["pad"]] * (len(batch[0]) - 1)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_export_files_have_the_mode_of_a_new_file(t5_model, t5_tokenizer, tmp_path, umask):
    model, config = t5_model
    previous = os.umask(umask)
    try:
        out = save_hf(model, config, tmp_path / "hf", t5_tokenizer)
        (tmp_path / "new").write_text("")
    finally:
        os.umask(previous)
    expected = stat.S_IMODE((tmp_path / "new").stat().st_mode)
    modes = {path.name: oct(stat.S_IMODE(path.stat().st_mode)) for path in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(expected)}, modes


@pytest.mark.slow
def test_export_does_not_import_transformers(tmp_path):
    # Importing transformers where torch is absent prints "PyTorch was not found" to the user.
    script = f"""
import importlib.metadata, json, sys
import jax
from flax import nnx
from spmdlm.hf_export import hf_config_dict, save_hf
from spmdlm.families import load_config
from spmdlm.families.t5.model import T5ForConditionalGeneration
config = load_config("t5-v1_1-tiny", vocab_size=128, num_layers=1, num_decoder_layers=1)
save_hf(T5ForConditionalGeneration(config, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))), config, {str(tmp_path)!r})
assert "transformers" not in sys.modules
written = json.load(open({str(tmp_path / "config.json")!r}))["transformers_version"]
assert written == importlib.metadata.version("transformers"), written
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_config_without_transformers_installed_has_no_version(t5_model, monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert "transformers_version" not in hf_config_dict(t5_model[1])
