"""Tokenizers: training per model type, transformers round trip (same ids), T5 sentinels, loading and errors."""

import json

import numpy as np
import pytest
import transformers

from spmdlm.data.tokenization import (
    TokenizerError,
    load_tokenizer,
    save_tokenizer,
    sentinel_ids,
    special_token_ids,
    train_tokenizer,
)
from spmdlm.errors import ConfigError
from spmdlm.families import families, get_family

MODEL_TYPES = ["gpt2", "roberta", "bart", "t5", "modernbert"]
VOCAB_SIZE = 600
# transformers 5 rebuilds a T5Tokenizer's pipeline from the vocab alone (dropping ours), so t5 saves as the
# generic class, which keeps tokenizer.json as written.
HF_CLASS = {
    "gpt2": transformers.GPT2TokenizerFast,
    "roberta": transformers.RobertaTokenizerFast,
    "bart": transformers.BartTokenizerFast,
    "t5": transformers.PreTrainedTokenizerFast,
    "modernbert": transformers.PreTrainedTokenizerFast,  # the class the released ModernBERT tokenizer names
}
PROBES = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 7 42 2024 3.14159 -17 1,000,000 and 12345678901234567890",
    "Punctuation!? (parens) [brackets] {braces} \"quotes\" 'single' — dashes – and… «guillemets»",
    "Unicode: café naïve Ærøskøbing straße Ωμέγα Привет 東京 データ 한국어 🙂🎉 e\u0301 ﬁ ½ Ⅻ",
    "  leading and trailing spaces  ",
    "runs   of    spaces\tand\ttabs\n\nnewlines\r\nCRLF\u00a0nbsp\u200bzero-width",
    "specials in text: <s> </s> <pad> <unk> <mask> <|endoftext|> <extra_id_0> <extra_id_99>",
    "",
    "x",
]


def corpus(n_sentences=400, seed=0):
    """Deterministic text with a rich vocabulary: made-up words, numbers, punctuation and non-ASCII letters."""
    rng = np.random.default_rng(seed)
    onsets = list("bcdfghjklmnprstvwz") + ["st", "tr", "sk", "ø", "æ", "ß", "ch", "qu"]
    vowels = list("aeiouy") + ["å", "é", "ü", "ei", "ou"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.integers(1, 4))) for _ in range(800)]
    sentences = []
    for _ in range(n_sentences):
        chosen = list(rng.choice(words, rng.integers(5, 16)))
        chosen[0] = chosen[0].capitalize()
        chosen.insert(rng.integers(1, len(chosen)), str(rng.integers(0, 100_000)))
        sentences.append(" ".join(chosen) + str(rng.choice([".", "!", "?", ";", ", and so on."])))
    return sentences


@pytest.fixture(scope="module")
def texts():
    return corpus()


@pytest.fixture(scope="module")
def trained(texts):
    return {model_type: train_tokenizer(get_family(model_type), texts, VOCAB_SIZE) for model_type in MODEL_TYPES}


def load_hf(path):
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def assert_same_ids(tok, hf):
    for text in PROBES:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids, text
        assert hf(text)["input_ids"] == tok.encode(text).ids, text


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_autotokenizer_round_trip(model_type, trained, tmp_path):
    tok = trained[model_type]
    save_tokenizer(tok, tmp_path, get_family(model_type), model_max_length=512)
    hf = load_hf(tmp_path)
    assert type(hf) is HF_CLASS[model_type]
    assert len(hf) == tok.get_vocab_size() == VOCAB_SIZE
    assert hf.model_max_length == 512
    assert_same_ids(tok, hf)
    for role, token_id in special_token_ids(tok, get_family(model_type)).items():
        assert getattr(hf, f"{role}_token_id") == token_id, role
    # Exactly the model's inputs: transformers 4.x's generic class (T5's) returned token_type_ids otherwise, which
    # the models then refused.
    names = ["input_ids", "attention_mask"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_input_names"] == names
    assert hf.model_input_names == names
    assert sorted(hf("def main(self):")) == sorted(hf(["a b", "c"])) == sorted(names)


@pytest.mark.parametrize("model_type, config_class", [("t5", transformers.T5Config), ("bart", transformers.BartConfig)])
def test_round_trip_from_an_exported_model_dir(model_type, config_class, trained, tmp_path):
    # With a config.json beside it, AutoTokenizer weighs the model type against tokenizer_class.
    config_class().save_pretrained(tmp_path)
    save_tokenizer(trained[model_type], tmp_path, get_family(model_type), model_max_length=128)
    hf = load_hf(tmp_path)
    assert type(hf) is HF_CLASS[model_type]
    assert_same_ids(trained[model_type], hf)


@pytest.mark.parametrize("model_type", ["gpt2", "t5"])
def test_lowercase_round_trip(model_type, texts, tmp_path):
    tok = train_tokenizer(get_family(model_type), texts, VOCAB_SIZE, lowercase=True)
    assert tok.encode("HeLLo WoRLD").ids == tok.encode("hello world").ids
    save_tokenizer(tok, tmp_path, get_family(model_type), model_max_length=128)
    hf = load_hf(tmp_path)
    assert type(hf) is transformers.PreTrainedTokenizerFast  # the GPT-2 class would drop the Lowercase step
    assert_same_ids(tok, hf)


def test_special_token_ids_per_model_type(trained, texts):
    assert special_token_ids(trained["gpt2"], get_family("gpt2")) == {
        "bos": 0,
        "eos": 0,
        "unk": 0,
        "pad": None,
        "mask": None,
    }
    roberta_style = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 4}
    assert special_token_ids(trained["roberta"], get_family("roberta")) == roberta_style
    assert special_token_ids(trained["bart"], get_family("bart")) == roberta_style
    assert special_token_ids(trained["t5"], get_family("t5")) == {
        "pad": 0,
        "eos": 1,
        "unk": 2,
        "bos": None,
        "mask": None,
    }
    # ModernBERT's five in the released tokenizer's order, first instead of after the pieces
    modernbert = {"unk": 0, "bos": 1, "eos": 2, "pad": 3, "mask": 4}
    assert special_token_ids(trained["modernbert"], get_family("modernbert")) == modernbert
    # Llama and Qwen3 train GPT-2's byte-level BPE with <|endoftext|> first (their round trips through transformers:
    # tests/test_llama.py, tests/test_continued_pretraining.py)
    for decoder in ("llama", "qwen3"):
        tok = train_tokenizer(get_family(decoder), texts, VOCAB_SIZE)
        assert special_token_ids(tok, get_family(decoder)) == {"bos": 0, "eos": 0, "unk": 0, "pad": None, "mask": None}
    assert set(families()) == {*MODEL_TYPES, "llama", "qwen3"}


def test_t5_sentinels_follow_google_layout(trained, tmp_path):
    tok = trained["t5"]
    ids = sentinel_ids(tok)
    assert ids.dtype == np.int32 and ids.shape == (100,)
    np.testing.assert_array_equal(ids, VOCAB_SIZE - 1 - np.arange(100))  # <extra_id_0> = len-1
    assert tok.encode("a <extra_id_7> b", add_special_tokens=False).ids.count(VOCAB_SIZE - 8) == 1
    save_tokenizer(tok, tmp_path, get_family("t5"), model_max_length=512)
    hf = load_hf(tmp_path)
    assert len(hf) == VOCAB_SIZE  # no second set of 100 extra ids
    assert hf.convert_tokens_to_ids([f"<extra_id_{k}>" for k in range(100)]) == ids.tolist()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["extra_ids"] == 0


def test_t5_pipeline(trained):
    tok = trained["t5"]
    encoding = tok.encode("year 2024, not 1999!")
    assert encoding.tokens[-1] == "</s>"  # EOS appended, nothing prepended
    assert [t for t in encoding.tokens if any(c.isdigit() for c in t)] == list("20241999")
    pieces = tok.get_vocab(with_added_tokens=False)  # the Unigram pieces, without specials and sentinels
    assert all(len(piece) == 1 for piece in pieces if any(c.isdigit() for c in piece))
    assert tok.encode("a     b").ids == tok.encode("a b").ids  # space runs collapse
    assert tok.encode("ﬁ").ids == tok.encode("fi").ids  # NFKC
    assert tok.encode("⁂", add_special_tokens=False).ids[-1] == 2  # unseen character -> <unk> = 2


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_training_is_deterministic(model_type, texts, trained):
    assert train_tokenizer(get_family(model_type), texts, VOCAB_SIZE).to_str() == trained[model_type].to_str()


def test_load_tokenizer_file_dir_and_missing(trained, tmp_path):
    save_tokenizer(trained["roberta"], tmp_path / "hf", get_family("roberta"), model_max_length=512)
    expected = trained["roberta"].encode(PROBES[3]).ids
    assert load_tokenizer(tmp_path / "hf").encode(PROBES[3]).ids == expected
    assert load_tokenizer(str(tmp_path / "hf" / "tokenizer.json")).encode(PROBES[3]).ids == expected
    missing = tmp_path / "nowhere"
    with pytest.raises(TokenizerError, match=f"{missing}.*tokenizer.json"):
        load_tokenizer(missing)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # a directory without one
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="broken.json"):
        load_tokenizer(tmp_path / "broken.json")


def test_wrong_tokenizer_for_model_type(trained, tmp_path):
    with pytest.raises(TokenizerError, match="no pad token '<pad>'.*--tokenizer_name"):
        special_token_ids(trained["gpt2"], get_family("t5"))
    with pytest.raises(TokenizerError, match="no bos token '<s>'"):
        special_token_ids(trained["gpt2"], get_family("roberta"))
    with pytest.raises(TokenizerError, match="100 sentinels.*<extra_id_0>"):
        sentinel_ids(trained["roberta"])
    with pytest.raises(TokenizerError, match="<extra_id_0>"):
        save_tokenizer(trained["roberta"], tmp_path / "out", get_family("t5"), model_max_length=512)
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize(
    "model_type, vocab_size, texts, match",
    [
        ("gpt2", 100, ["x"], "vocab_size 100"),
        ("t5", 100, ["x"], "vocab_size 100"),
        ("roberta", 600, [], "no training text"),
    ],
)
def test_training_errors(model_type, vocab_size, texts, match):
    with pytest.raises(TokenizerError, match=match):
        train_tokenizer(get_family(model_type), texts, vocab_size)


def test_an_unknown_family_is_refused_by_the_registry():
    with pytest.raises(ConfigError, match="model_type 'falcon' is not supported; choose one of bart, gpt2"):
        get_family("falcon")
