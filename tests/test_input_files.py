"""Text files as they are found on disk: compressed text without its suffix is read by its magic bytes (text that
merely starts alike stays text), and a symlink loop is named as one."""

import importlib

import pytest

from spmdlm.data.compression import text_lines
from spmdlm.data.readers import expand_files
from spmdlm.errors import DataError


@pytest.mark.parametrize("module", ["gzip", "bz2", "lzma"])
def test_compressed_text_without_its_suffix_is_read_by_its_magic_bytes(tmp_path, module):
    text = "a first line\nand a second one\n" * 50
    path = tmp_path / "corpus.txt"
    path.write_bytes(importlib.import_module(module).compress(text.encode()))
    assert "".join(text_lines(path)).split() == text.split()
    plain = tmp_path / "plain.txt"
    plain.write_text("BZh9 is how a bzip2 stream starts\n")  # text that merely starts alike stays text
    assert "".join(text_lines(plain)).split() == ["BZh9", "is", "how", "a", "bzip2", "stream", "starts"]


def test_a_symlink_loop_is_named_as_one(tmp_path):
    (tmp_path / "a.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    with pytest.raises(DataError, match=r"a\.txt: is a symlink loop \(it leads back to itself\); point it at a file"):
        expand_files(str(tmp_path / "a.txt"))
