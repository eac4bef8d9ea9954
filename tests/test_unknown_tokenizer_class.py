"""A checkpoint's tokenizer_config.json naming a tokenizer_class transformers does not have: the one-line error names
that class and the fix, and lists transformers' choices whole (it was cut off after "from one of:")."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from spmdlm.data.tokenization import load_tokenizer
from spmdlm.errors import TokenizerError


def bpe_files(folder):
    """vocab.json + merges.txt of a tiny byte-level BPE: transformers converts them by the tokenizer's class."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the cat sees the dog"] * 10, trainer)
    folder.mkdir()
    tok.model.save(str(folder))
    return folder


def test_an_unknown_tokenizer_class_is_named_with_the_whole_list(tmp_path):
    folder = bpe_files(tmp_path / "ckpt")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NonesuchTokenizer"}))
    with pytest.raises(TokenizerError) as refusal:
        load_tokenizer(folder)
    line = str(refusal.value)
    assert "\n" not in line, line
    assert "tokenizer_class 'NonesuchTokenizer', which this transformers does not have" in line, line
    assert not line.rstrip().endswith("from one of:"), line
    assert "(1) a `tokenizers` library serialization file" in line and "(3)" in line, line


def test_a_known_class_still_converts(tmp_path):
    folder = bpe_files(tmp_path / "ckpt")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    assert "Ġwor" in load_tokenizer(folder).get_vocab()
