"""Input checks: binary files, encodings, the text field of JSON/CSV records, and damaged token caches."""

import codecs
import json
import logging
import os
import re
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from spmdlm.data.readers import expand_files, read_documents
from spmdlm.data.records import Cut, record_source
from spmdlm.data.token_cache import prepare_split
from spmdlm.data.tokenization import train_tokenizer
from spmdlm.errors import DataError
from spmdlm.families import get_family
from spmdlm.storage import file_sha256

LINES = ["café crème brûlée", "naïve Ærøskøbing straße", "Привет 東京 🙂"]
_WORDS = np.random.default_rng(0).integers(0, 200, (60, 30))
DOCS = [f"document {i}: " + " ".join(f"w{w}" for w in row) for i, row in enumerate(_WORDS)]


def read(path: Path, **kwargs) -> list[str]:
    return list(read_documents([path], **kwargs))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- binary files and encodings ------------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/bin/ls").is_file(), reason="no /bin/ls")
def test_an_executable_given_as_train_file_is_refused():
    with pytest.raises(DataError, match=r"^/bin/ls looks binary .*give text files"):
        read(expand_files("/bin/ls")[0])


def test_nul_bytes_or_mostly_undecodable_bytes_mean_binary(tmp_path):
    (tmp_path / "nul.txt").write_bytes(b"hello\0world\n")
    (tmp_path / "noise.txt").write_bytes(bytes(range(128, 256)) * 40)
    with pytest.raises(DataError, match="nul.txt looks binary \\(NUL bytes"):
        read(tmp_path / "nul.txt")
    with pytest.raises(DataError, match="noise.txt looks binary \\(5120 of its first 5120 bytes"):
        read(tmp_path / "noise.txt")


BOMS = {
    "utf-16-le": codecs.BOM_UTF16_LE,
    "utf-16-be": codecs.BOM_UTF16_BE,
    "utf-32-le": codecs.BOM_UTF32_LE,
    "utf-32-be": codecs.BOM_UTF32_BE,
    "utf-8": codecs.BOM_UTF8,
}


@pytest.mark.parametrize("encoding", BOMS)
def test_a_bom_gives_the_encoding(tmp_path, caplog, encoding):
    path = tmp_path / "a.txt"
    path.write_bytes(BOMS[encoding] + "\n".join(LINES).encode(encoding))
    assert read(path) == LINES
    assert not warnings_of(caplog)


def test_utf16_as_python_writes_it_and_a_utf8_bom_in_json_lines(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join(LINES), encoding="utf-16")
    assert read(tmp_path / "a.txt") == LINES
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES), encoding="utf-8-sig")
    assert read(tmp_path / "a.jsonl") == LINES


def test_latin1_bytes_are_replaced_with_one_warning_per_file(tmp_path, caplog):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café\nnaïve crème\n".encode("latin-1"))
    assert read(path) == ["caf\ufffd", "na\ufffdve cr\ufffdme"]
    assert warnings_of(caplog) == [
        f"{path}: 3 bytes are not valid UTF-8 and were replaced by U+FFFD "
        "(convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8)"
    ]


# -- the text field of JSON and CSV records --------------------------------------------------------------------------


def test_json_lines_without_the_text_field_name_the_line_and_the_flag(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n\n{"id": 7, "body": "two"}\n')
    with pytest.raises(
        DataError,
        match=re.escape(f"{path}:3 has no 'text' field; pass --text_column NAME, NAME one of its fields: id, body"),
    ):
        read(path)


def test_text_column_picks_the_field_and_skips_empty_values(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"id": 1, "body": "one"}, {"id": 2, "body": 3}, {"id": 3, "body": None}, {"id": 4, "body": "  "}]
        )
    )
    assert read(path, text_column="body") == ["one", "3"]
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"body": "x"}, {"id": 2}]))
    with pytest.raises(DataError, match=re.escape(f"{array} record 1 has no 'body' field")):
        read(array, text_column="body")


def test_a_bad_json_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": \n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not JSON lines")):
        read(path)


def test_csv_without_the_text_column_names_the_row_line(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('id,body\n1,"two\nlines"\n2,world\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:3 has no 'text' field; pass --text_column")):
        read(path)
    assert read(path, text_column="body") == ["two\nlines", "world"]


# -- the token cache -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(get_family("gpt2"), DOCS, 300)


def prepare(tokenizer, cache_dir, **kwargs):
    return prepare_split(DOCS, tokenizer, Cut(16, 0), cache_dir=cache_dir, name="train", **kwargs)


def records(split) -> list[np.ndarray]:
    source = record_source(split)
    return list(source.read(np.arange(len(source))))


def card_path(split):
    return split.path.parent / "dataset.json"


def truncate(split):
    data = split.path.read_bytes()
    split.path.write_bytes(data[: len(data) // 2])


def zero_the_middle(split):
    data = bytearray(split.path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    split.path.write_bytes(bytes(data))


def garble_the_card(split):
    card_path(split).write_text("{not json")


def rewrite_the_shard_entry(split, **changes):
    card = json.loads(card_path(split).read_text())
    card["splits"]["train"]["shards"][0].update(changes)
    card_path(split).write_text(json.dumps(card))


def remove_the_data(split):
    split.path.unlink()


def miscount_the_records(split):
    card = json.loads(card_path(split).read_text())
    card["splits"]["train"]["examples"] += 1
    card_path(split).write_text(json.dumps(card))


def truncate_and_forge_the_card(split):  # size and hash agree: only the record count finds the damage
    truncate(split)
    rewrite_the_shard_entry(split, bytes=split.path.stat().st_size, sha256=file_sha256(split.path))


def test_the_card_records_the_size_and_hash_of_the_data(tokenizer, tmp_path):
    split = prepare(tokenizer, tmp_path)
    train = json.loads(card_path(split).read_text())["splits"]["train"]
    assert train["shards"] == [
        {
            "file": split.path.name,
            "records": split.num_records,
            "bytes": split.path.stat().st_size,
            "sha256": file_sha256(split.path),
        }
    ]
    assert train["examples"] == split.num_records == len(records(split))
    assert train["documents"] == split.documents == len(DOCS)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (truncate, "bytes, .* expected"),
        (remove_the_data, "train-00000.tokens is missing"),
        (zero_the_middle, "does not match its sha256"),
        (garble_the_card, "dataset.json is unreadable"),
        (truncate_and_forge_the_card, "train-00000.tokens holds .* records, .* expected"),
        (miscount_the_records, "records, .* expected"),
    ],
)
def test_a_damaged_cache_is_rebuilt(tokenizer, tmp_path, caplog, damage, reason):
    split = prepare(tokenizer, tmp_path)
    original = records(split)
    damage(split)
    caplog.clear()
    assert prepare(tokenizer, tmp_path) == split
    [warning] = warnings_of(caplog)
    folder = re.escape(str(split.path.parent))
    assert re.fullmatch(f"the tokenized train cache {folder} is damaged \\(.*{reason}.*\\); rebuilding it", warning)
    rebuilt = records(split)
    assert len(rebuilt) == len(original) and all(np.array_equal(a, b) for a, b in zip(rebuilt, original))
    caplog.clear()
    prepare(tokenizer, tmp_path)  # the rebuilt cache checks out
    assert not warnings_of(caplog)


def test_temp_dirs_of_dead_preparations_on_this_host_are_removed(tokenizer, tmp_path):
    key = prepare(tokenizer, tmp_path).path.parent.name
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid belongs to no process
    host = socket.gethostname()
    dead = tmp_path / f".{key}.tmp-{host}-{child.pid}"
    alive = tmp_path / f".{key}.tmp-{host}-{os.getppid()}"
    elsewhere = tmp_path / f".{key}.tmp-otherhost-1"
    for path in (dead, alive, elsewhere):
        path.mkdir()
        (path / "train-00000.tokens").write_bytes(b"partial")
    prepare(tokenizer, tmp_path, overwrite_cache=True)
    assert not dead.exists() and alive.exists() and elsewhere.exists()


def test_an_unwritable_cache_dir_names_the_folder(tokenizer, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(
        DataError, match=re.escape(f"cannot write the token cache in {blocker}/sub/") + ".*pass a writable --cache_dir"
    ):
        prepare(tokenizer, blocker / "sub")
