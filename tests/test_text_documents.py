"""--text_documents: where a text file's documents end (line, blank_line, file), in the launcher, spmdlm.prepare and
spmdlm.tokenizer, and in what is tokenized (one EOS per document)."""

import json

import numpy as np
import pytest

from spmdlm import prepare
from spmdlm.cli import tokenizer
from spmdlm.data import readers, token_cache
from spmdlm.data.records import Cut
from spmdlm.data.tokenization import load_tokenizer
from spmdlm.run_args import RunArgs
from spmdlm.train.stages import corpora

# Three paragraphs, hard-wrapped, separated by one or more blank lines (one of them holding spaces).
TEXT = (
    "The keeper climbed the stair at dusk\nand lit the lamp before the fog\ncame in from the sea.\n"
    "\n"
    "Ships passed the point at night;\nnone of them stopped.\n"
    "\n  \n\n"
    "In spring the gulls came back\nto the rocks below the tower.\n"
)
PARAGRAPHS = [
    "The keeper climbed the stair at dusk\nand lit the lamp before the fog\ncame in from the sea.",
    "Ships passed the point at night;\nnone of them stopped.",
    "In spring the gulls came back\nto the rocks below the tower.",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wrapped")
    (folder / "a.txt").write_text("\n".join([TEXT] * 20))
    (folder / "b.txt").write_text("A second file\nof two lines.\n")
    return folder


def documents(corpus, text_documents):
    return list(readers.open_corpus([str(corpus)], text_documents=text_documents).documents())


def test_blank_line_documents_are_paragraphs_with_their_inner_newlines(corpus):
    assert documents(corpus, "blank_line") == PARAGRAPHS * 20 + ["A second file\nof two lines."]


def test_file_documents_are_whole_files_and_line_stays_the_default(corpus):
    whole = "\n".join([TEXT] * 20)
    assert documents(corpus, "file") == [whole.rstrip("\n"), "A second file\nof two lines."]
    lines = [line for line in (whole + "A second file\nof two lines.\n").splitlines() if line.strip()]
    assert documents(corpus, "line") == lines == list(readers.open_corpus([str(corpus)]).documents())


def test_the_launcher_reads_blank_line_documents_and_caches_them_apart(corpus, tmp_path, cache_dir):
    args = lambda mode: RunArgs.of(dict(train_file=str(corpus), text_documents=mode, validation_split_percentage=0.0))
    train, _ = corpora.read_corpora(args("blank_line").data)
    assert train == PARAGRAPHS * 20 + ["A second file\nof two lines."]
    tok = tokenizer_for(corpus, tmp_path)
    eos = tok.token_to_id("<|endoftext|>")
    # record length 1: no partial record is dropped, so every token of the stream is in the cache
    cached = {
        mode: token_cache.prepare_split(
            corpora.read_corpora(args(mode).data)[0],
            tok,
            Cut(1, eos),
            cache_dir=cache_dir,
            name="train",
        )
        for mode in ("line", "blank_line")
    }
    tokens = np.fromfile(cached["blank_line"].path, dtype="<i4")
    assert (tokens == eos).sum() == len(train)
    assert cached["line"].fingerprint != cached["blank_line"].fingerprint  # the key follows the documents


def tokenizer_for(corpus, tmp_path):
    out = tmp_path / "tok"
    assert (
        tokenizer.main(
            [
                "--for_model",
                "gpt2",
                "--vocab_size",
                "300",
                "--text_documents",
                "blank_line",
                "--out",
                str(out),
                str(corpus),
            ]
        )
        == 0
    )
    return load_tokenizer(out)


def test_prepare_writes_one_eos_per_blank_line_document(corpus, tmp_path):
    tok = tokenizer_for(corpus, tmp_path)
    out = tmp_path / "dataset"
    assert (
        prepare.main(
            [
                "--tokenizer",
                str(tmp_path / "tok"),
                "--for_model",
                "gpt2",
                "--block_size",
                "8",
                "--validation_percentage",
                "0",
                "--text_documents",
                "blank_line",
                "--out",
                str(out),
                str(corpus),
            ]
        )
        == 0
    )
    card = json.loads((out / "dataset.json").read_text())
    assert card["inputs"]["text_documents"] == "blank_line"
    expected = PARAGRAPHS * 20 + ["A second file\nof two lines."]
    eos = tok.token_to_id("<|endoftext|>")
    stream = np.concatenate([np.append(tok.encode(d, add_special_tokens=False).ids, eos) for d in expected])
    train = card["splits"]["train"]
    assert card["read"]["documents"] == train["documents"] == len(expected)
    assert train["tokens"] == len(stream) and (stream == eos).sum() == len(expected)
    shard = np.fromfile(out / train["shards"][0]["file"], dtype="<i4")
    np.testing.assert_array_equal(shard, stream[: len(shard)])  # the records are that stream, cut
