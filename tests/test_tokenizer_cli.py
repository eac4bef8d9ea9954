"""python -m spmdlm.tokenizer (all four families, loaded back by transformers with the same ids) and SentencePiece
spiece.model files as --tokenizer_name."""

import subprocess
import sys

import numpy as np
import pytest
import transformers

from spmdlm.cli.tokenizer import main
from spmdlm.data.tokenization import (
    load_tokenizer,
    save_tokenizer,
    sentinel_ids,
    special_token_ids,
    train_tokenizer,
)
from spmdlm.families import get_family

_RNG = np.random.default_rng(0)
_WORDS = ["".join(_RNG.choice(list("abcdefghijklmnoprstuvyæøåé"), _RNG.integers(2, 8))) for _ in range(300)]
LINES = [
    " ".join(_RNG.choice(_WORDS, _RNG.integers(4, 20))).capitalize() + _RNG.choice([".", "!", "?", ", 42."])
    for _ in range(600)
]
SAMPLES = LINES[:5] + [
    "Numbers 0 7 42 2024 3.14159 and… «quotes» — dashes",
    "Unicode: café naïve Ærøskøbing straße Привет 東京 🙂 ﬁ ½",
    "  leading and trailing  ",
    "specials in text: <s> </s> <pad> <unk> <mask> <extra_id_0> <extra_id_99>",
    "",
]
VOCAB = {"gpt2": 500, "roberta": 500, "bart": 500, "t5": 400}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text("\n".join(LINES[:400]) + "\n")
    (folder / "b.txt").write_text("\n".join(LINES[400:]) + "\n")
    return folder


def same_ids(tok, hf):
    for text in SAMPLES:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids, text
        assert hf(text)["input_ids"] == tok.encode(text).ids, text


@pytest.mark.parametrize("model", ["gpt2", "roberta", "bart", "t5"])
def test_cli_tokenizer_loads_in_transformers_with_the_same_ids(model, corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["--for_model", model, "--vocab_size", str(VOCAB[model]), "--out", str(out), str(corpus)]) == 0
    assert f"tokenizer for {model}, trained on 600 documents" in capsys.readouterr().out
    tok = load_tokenizer(out)  # what --tokenizer_name DIR gives
    # the library's tokenizer on the same text, streamed from the files in the same order
    assert tok.to_str() == train_tokenizer(get_family(model), LINES, VOCAB[model]).to_str()
    same_ids(tok, transformers.AutoTokenizer.from_pretrained(out, local_files_only=True))
    special_token_ids(tok, get_family(model))  # raises if one the family needs is missing
    if model == "t5":
        assert list(sentinel_ids(tok)) == list(range(tok.get_vocab_size() - 1, tok.get_vocab_size() - 101, -1))


def test_kind_picks_the_family_and_must_agree_with_it(corpus, tmp_path, capsys):
    assert main(["--kind", "unigram", "--vocab_size", "300", "--out", str(tmp_path / "u"), str(corpus)]) == 0
    assert "unigram tokenizer for t5" in capsys.readouterr().out
    assert (
        main(
            [
                "--kind",
                "unigram",
                "--for_model",
                "gpt2",
                "--vocab_size",
                "300",
                "--out",
                str(tmp_path / "x"),
                str(corpus),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        "error: --kind unigram does not fit --for_model gpt2, which uses bpe; leave out --kind\n"
    )
    assert main(["--kind", "unigram", "--vocab_size", "300", "--out", str(tmp_path / "u"), str(corpus)]) == 2
    assert "already holds a tokenizer.json; pass --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_missing_inputs_are_one_line_from_the_command_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmdlm.tokenizer",
            "--for_model",
            "gpt2",
            "--vocab_size",
            "300",
            "--out",
            str(tmp_path / "t"),
            str(tmp_path / "a.txt"),
            str(tmp_path / "b*.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"error: INPUTS: no such files: {tmp_path / 'a.txt'}, {tmp_path / 'b*.txt'}; check the "
        "paths (globs like 'data/*.txt' are allowed)\n"
    )


# -- SentencePiece models ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spiece_dir(corpus, tmp_path_factory):
    import sentencepiece

    folder = tmp_path_factory.mktemp("spiece")
    # T5's layout: <pad>=0, </s>=1, <unk>=2, no <s>; transformers appends the 100 <extra_id_k>.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus / "a.txt"),
        model_prefix=str(folder / "spiece"),
        vocab_size=250,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    return folder


def test_a_spiece_model_gives_the_ids_of_t5_tokenizer_fast(spiece_dir, tmp_path):
    import sentencepiece

    reference = transformers.T5TokenizerFast.from_pretrained(spiece_dir, local_files_only=True)
    assert len(reference) == 350
    by_file, by_dir = load_tokenizer(spiece_dir / "spiece.model"), load_tokenizer(spiece_dir)
    assert by_file.to_str() == by_dir.to_str()
    same_ids(by_file, reference)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spiece_dir / "spiece.model"))
    for text in LINES[:20]:  # and those of SentencePiece itself, plus T5's </s>
        assert by_file.encode(text).ids == processor.encode(text) + [1]
    assert special_token_ids(by_file, get_family("t5")) == {"pad": 0, "eos": 1, "unk": 2, "bos": None, "mask": None}
    assert sentinel_ids(by_file)[0] == 349 and sentinel_ids(by_file)[99] == 250
    # saved for a run's output dir: AutoTokenizer gives the same ids again
    save_tokenizer(by_file, tmp_path / "hf", get_family("t5"), model_max_length=512)
    same_ids(by_file, transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True))


def test_a_broken_spiece_model_is_one_line(tmp_path):
    from spmdlm.data.tokenization import TokenizerError

    (tmp_path / "spiece.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"^cannot read SentencePiece model .*spiece.model: [^\n]*$"):
        load_tokenizer(tmp_path)
