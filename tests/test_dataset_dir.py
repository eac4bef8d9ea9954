"""Datasets prepared by python -m spmdlm.prepare as a run opens them (--dataset_dir, a mixture's dataset_dir
sources): a missing or half-written folder is named as such, one given as text is pointed to --dataset_dir, a
mixture's prepared sources must share one tokenizer (the advice names the tokenizer to prepare with), a token id
beyond the tokenizer is refused at start (every id of a small dataset, each shard's ends of a large one), and the
model card describes the dataset as it was opened."""

import json

import pytest
from test_reliability_inputs import FIXTURES

from spmdlm.data import datasets
from spmdlm.errors import DataError


def fake_dataset(folder, tokenizer_sha: str):
    from spmdlm.data.datasets import CARD_FORMAT, CARD_NAME, CARD_VERSION

    folder.mkdir()
    (folder / CARD_NAME).write_text(
        json.dumps({"format": CARD_FORMAT, "version": CARD_VERSION, "tokenizer": {"sha256": tokenizer_sha}})
    )
    return folder


def test_prepared_sources_of_two_tokenizers_get_advice_that_works(tmp_path):
    from spmdlm.cli.launch import parse_args
    from spmdlm.data.mixture import read_mixture_file
    from spmdlm.errors import DataError
    from spmdlm.train.stages.corpora import read_sources

    for name, sha in (("a", "1" * 64), ("b", "2" * 64), ("c", "1" * 64)):
        fake_dataset(tmp_path / name, sha)
    path = tmp_path / "mix.yaml"
    path.write_text(
        "- {name: a, dataset_dir: a, weight: 1}\n- {name: c, dataset_dir: c, weight: 1}\n"
        "- {name: b, dataset_dir: b, weight: 1}\n"
    )
    args, _ = parse_args(["--data_mixture", str(path)])
    with pytest.raises(DataError) as refusal:
        read_sources(args.data, read_mixture_file(str(path)))
    assert str(refusal.value) == (
        f"--data_mixture {path} source b: {tmp_path / 'b'} was tokenized with another "
        f"tokenizer than source a's {tmp_path / 'a'}; a mixture's sources share one "
        f"tokenizer: prepare it again with --tokenizer {tmp_path / 'a' / 'tokenizer'}"
    )


def test_a_prepared_dataset_is_not_read_as_text(tmp_path):
    from spmdlm.data.readers import expand_files
    from spmdlm.errors import DataError

    folder = fake_dataset(tmp_path / "prepared", "1" * 64)
    with pytest.raises(
        DataError,
        match=f"--train_file source x {folder}: is a dataset prepared by python -m "
        "spmdlm.prepare, not text; give it as --dataset_dir",
    ):
        expand_files(f"{folder}", "--train_file source x")


def test_a_missing_or_half_written_dataset_dir_is_named_so_not_as_a_missing_tokenizer(tmp_path):
    with pytest.raises(DataError, match=r"gone: no such directory; prepare one with python -m spmdlm.prepare"):
        datasets.tokenizer_dir(tmp_path / "gone")
    half = tmp_path / ".data.tmp-1234"
    (half / datasets.TOKENIZER_DIR).mkdir(parents=True)  # the tokenizer is written, the card (last) is not
    with pytest.raises(DataError, match=r"no dataset.json in it: an incomplete dataset \(a preparation that did not"):
        datasets.tokenizer_dir(half)


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    return train_tokenizer(get_family("gpt2"), FIXTURES.joinpath("overfit.txt").read_text().splitlines(), 300)


# -- prepared datasets: ids beyond the vocabulary refused at start; the card describes the dataset trained on --------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory, gpt2_tokenizer):
    from spmdlm.data.tokenization import save_tokenizer
    from spmdlm.families import get_family
    from spmdlm.prepare import main as prepare

    folder = tmp_path_factory.mktemp("prepared")
    save_tokenizer(gpt2_tokenizer, folder / "tok", get_family("gpt2"), model_max_length=64)
    assert (
        prepare(
            [
                "--tokenizer",
                str(folder / "tok"),
                "--for_model",
                "gpt2",
                "--block_size",
                "16",
                "--out",
                str(folder / "ds"),
                "--workers",
                "1",
                "--validation_percentage",
                "0",
                str(FIXTURES / "overfit.txt"),
            ]
        )
        == 0
    )
    return folder / "ds"


def test_a_shard_with_an_id_beyond_the_vocabulary_is_refused_at_start(tmp_path, prepared, gpt2_tokenizer):
    import shutil

    import numpy as np

    from spmdlm.data.datasets import open_dataset
    from spmdlm.errors import DataError

    out = shutil.copytree(prepared, tmp_path / "ds")
    train, _, _ = open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")  # as prepared: fine
    tokens = np.memmap(train.paths[0], dtype=np.int32, mode="r+")
    tokens[40] = gpt2_tokenizer.get_vocab_size() + 7
    tokens.flush()
    with pytest.raises(
        DataError,
        match=f"--dataset_dir {out}: shard .* holds token id 307, outside the "
        "tokenizer's 300 ids \\(a damaged shard\\); prepare the dataset again",
    ):
        open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")


def test_a_large_datasets_ids_are_checked_at_each_shards_ends_only(tmp_path, prepared, gpt2_tokenizer, monkeypatch):
    """Above ID_SCAN_ALL_BYTES every start of every host would read the whole dataset: the first and last chunk of
    each shard are scanned (chunks of 8 tokens here), a bad id between them is left to the opt-in sha256 check."""
    import shutil

    import numpy as np

    from spmdlm.data import datasets
    from spmdlm.errors import DataError

    monkeypatch.setattr(datasets, "ID_SCAN_ALL_BYTES", 0)
    monkeypatch.setattr(datasets, "ID_CHECK_CHUNK", 8)
    out = shutil.copytree(prepared, tmp_path / "ds")
    path = datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")[0].paths[0]
    tokens = np.memmap(path, dtype=np.int32, mode="r+")
    assert len(tokens) > 3 * 8
    tokens[12] = 999  # the second chunk: not scanned
    tokens.flush()
    datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")
    tokens[len(tokens) - 1] = 999  # the last chunk: scanned
    tokens.flush()
    with pytest.raises(DataError, match="holds token id 999"):
        datasets.open_dataset(out, tokenizer=gpt2_tokenizer, record_length=17, mode="stream")


def test_the_model_card_describes_the_dataset_as_opened(tmp_path, prepared, gpt2_tokenizer):
    import shutil
    import types

    from spmdlm.cli.launch import parse_args
    from spmdlm.data.datasets import CARD_NAME
    from spmdlm.train import publish
    from spmdlm.train.stages import corpora

    out = shutil.copytree(prepared, tmp_path / "ds")
    args, _ = parse_args(["--dataset_dir", str(out)])
    objective = types.SimpleNamespace(record_length=17, preparation="stream")
    reading = corpora.Reading(args.data, args.control, gpt2_tokenizer, None, objective)
    data = corpora.prepare_data(reading, ([], []))
    card = json.loads((out / CARD_NAME).read_text())
    card["read"]["files"], card["splits"]["train"]["documents"] = 99, 12345  # prepared anew while training
    (out / CARD_NAME).write_text(json.dumps(card))
    prepared = types.SimpleNamespace(run=types.SimpleNamespace(args=args, sources=()), data=data)
    assert (
        publish._data_lines(prepared)[0] == f"- corpus: the prepared dataset `{out}` (1 files, 20 training documents)"
    )
