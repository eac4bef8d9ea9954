"""Inputs as people have them: text is text whatever the file is called (no suffix, `.0`, `.dat`, `.fortunes`), in
directories and globs; each compressed form; JSON lines; `--text_format` to say it outright; binary refused."""

import bz2
import gzip
import json
import lzma

import pytest
import zstandard

from spmdlm.data import readers
from spmdlm.errors import DataError

LINES = ["Der Mensch ist frei geboren", "und überall liegt er in Ketten", "Apache License, Version 2.0"]
COMPRESSORS = {
    ".gz": gzip.compress,
    ".xz": lzma.compress,
    ".bz2": bz2.compress,
    ".zst": lambda data: zstandard.ZstdCompressor().compress(data),
}


def documents(*inputs, **kwargs) -> list[str]:
    return list(readers.open_corpus([str(i) for i in inputs], **kwargs).documents())


def test_text_files_of_any_name_in_a_directory_and_a_glob_are_read(tmp_path):
    files = {"README": LINES[0], "Apache-2.0": LINES[2], "words.dat": LINES[1], "de.fortunes": "Wer A sagt"}
    (tmp_path / "corpus").mkdir()
    for name, line in files.items():
        (tmp_path / "corpus" / name).write_text(line + "\n")
    (tmp_path / "corpus" / ".hidden").write_text("never read\n")
    assert documents(tmp_path / "corpus") == [files[name] for name in sorted(files)]  # sorted by path
    assert documents(f"{tmp_path}/corpus/*.0", f"{tmp_path}/corpus/*.dat") == [LINES[2], LINES[1]]


@pytest.mark.parametrize("suffix", COMPRESSORS)
def test_each_compressed_form_of_text_and_json_lines(tmp_path, suffix):
    compress = COMPRESSORS[suffix]
    (tmp_path / f"notes{suffix}").write_bytes(compress("\n".join(LINES).encode()))
    (tmp_path / f"records.jsonl{suffix}").write_bytes(
        compress("\n".join(json.dumps({"text": t}) for t in LINES).encode())
    )
    assert documents(tmp_path / f"notes{suffix}") == LINES
    assert documents(tmp_path / f"records.jsonl{suffix}") == LINES
    if suffix == ".zst":
        return  # zstandard's stream reader ends a truncated frame silently (known, not checked here)
    (tmp_path / f"cut{suffix}").write_bytes(compress(("\n".join(LINES) * 200).encode())[:60])
    with pytest.raises(DataError, match=rf"cut\{suffix}: cannot decompress \(.*\); the file is truncated"):
        documents(tmp_path / f"cut{suffix}")


def test_text_format_says_what_the_suffix_does_not(tmp_path):
    (tmp_path / "export.dat").write_text("\n".join(json.dumps({"body": t}) for t in LINES))
    assert documents(tmp_path / "export.dat") == [json.dumps({"body": t}) for t in LINES]  # text by default
    assert documents(tmp_path / "export.dat", text_format="json", text_column="body") == LINES
    (tmp_path / "table.0").write_text("id,text\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(LINES)))
    assert documents(tmp_path / "table.0", text_format="csv") == LINES
    manifest = readers.open_corpus([str(tmp_path / "table.0")], text_format="csv").manifest()
    assert manifest["text_format"] == "csv"
    assert "text_format" not in readers.open_corpus([str(tmp_path / "table.0")]).manifest()


def test_a_binary_file_among_text_is_refused_in_one_line_naming_it(tmp_path):
    (tmp_path / "a").write_text(LINES[0] + "\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    with pytest.raises(DataError) as refused:
        documents(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'logo.png'} looks binary (NUL bytes")
    assert "leave it out of the inputs" in message
