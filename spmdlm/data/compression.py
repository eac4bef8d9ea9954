"""One input file as text lines, for spmdlm.data.readers: .gz, .zst, .xz and .bz2 decompressed as they stream, the
encoding from a BOM (else UTF-8), a file that looks binary refused, bytes that are not UTF-8 replaced by U+FFFD and
counted.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import logging
import lzma
import re
from collections.abc import Iterator
from pathlib import Path

from spmdlm.errors import DataError

log = logging.getLogger(__name__)

COMPRESSION_SUFFIXES = {".gz", ".zst", ".xz", ".bz2"}
DATASETS_HINT = "pip install 'spmdlm[datasets]'"  # the extra that brings zstandard, pyarrow and datasets

BINARY_FIX = (
    "give text files (any suffix; plain, .gz, .zst, .xz or .bz2) or leave it out of the inputs "
    "(--text_format parquet if it is parquet)"
)
BINARY_PROBE = 8192  # bytes looked at to tell text from binary
MAX_INVALID_SHARE = 0.3  # a text file with more undecodable bytes than this in the probe is taken for binary
# A BOM says the encoding; the UTF-32 ones come first, as the UTF-32 LE BOM begins with the UTF-16 LE one.
BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
    (codecs.BOM_UTF8, "utf-8-sig"),
]
# Bytes that are not UTF-8, as the "surrogateescape" error handler decodes them: one per byte, so they can be counted.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def formats(path: Path) -> tuple[str, str | None]:
    """(format suffix, compression suffix or None): 'a.jsonl.gz' -> ('.jsonl', '.gz'), 'a.gz' -> ('', '.gz')."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES else None
    return (suffixes[-1] if suffixes else ""), compression


def _open_binary(path: Path):
    """(raw file, readable binary stream): .gz, .xz and .bz2 through the standard library, .zst through zstandard,
    else the file itself. A file without a compression suffix is sniffed by its magic bytes."""
    raw = path.open("rb")  # a local file, or a gs:// object read through gcsfs
    compression = formats(path)[1] or sniffed_compression(raw)
    if compression in _STDLIB_DECOMPRESSORS:
        return raw, _STDLIB_DECOMPRESSORS[compression](raw)
    if compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(
                f"{path}: reading .zst files needs zstandard: pip install zstandard (or {DATASETS_HINT})"
            ) from None
        return raw, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw, raw


# The first bytes of each compressed format (bzip2's: "BZh", the block size, then the block magic of pi's digits)
MAGIC_BYTES = {
    b"\x1f\x8b": ".gz",
    b"\xfd7zXZ\x00": ".xz",
    b"\x28\xb5\x2f\xfd": ".zst",
}
BZIP2_MAGIC = re.compile(rb"BZh[1-9]1AY&SY")


def sniffed_compression(raw) -> str | None:
    """The compression a file without its suffix (corpus.txt holding gzip) has, by its magic bytes; None: plain."""
    head = raw.read(10)
    raw.seek(0)
    if BZIP2_MAGIC.match(head):
        return ".bz2"
    return next((suffix for magic, suffix in MAGIC_BYTES.items() if head.startswith(magic)), None)


_STDLIB_DECOMPRESSORS = {
    ".gz": lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"),
    ".xz": lambda raw: lzma.LZMAFile(raw, mode="rb"),
    ".bz2": lambda raw: bz2.BZ2File(raw, mode="rb"),
}


def _decompression_errors(path: Path) -> tuple[type[BaseException], ...]:
    """What a damaged stream raises: EOFError when truncated; bz2 says any other damage with a bare OSError, so that
    is caught for .bz2 files only."""
    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile, lzma.LZMAError]
    if formats(path)[1] == ".bz2":
        errors.append(OSError)
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _bad_compressed(path: Path, e: BaseException) -> DataError:
    return DataError(
        f"{path}: cannot decompress ({str(e).partition(chr(10))[0] or type(e).__name__}); "
        "the file is truncated or not what its suffix says"
    )


def _encoding(path: Path) -> str:
    """The file's encoding from its BOM, else UTF-8; a file that looks binary is refused."""
    raw, f = _open_binary(path)
    try:
        with raw, f:
            head = f.read(BINARY_PROBE)
    except _decompression_errors(path) as e:
        raise _bad_compressed(path, e) from None
    encoding = next((encoding for bom, encoding in BOMS if head.startswith(bom)), "utf-8")
    if encoding in ("utf-16", "utf-32"):
        return encoding  # UTF-16/32 text is full of NUL bytes: no binary check
    if b"\0" in head:
        raise DataError(f"{path} looks binary (NUL bytes in its first {len(head)} bytes); {BINARY_FIX}")
    invalid = len(_ESCAPED_BYTE.findall(head.decode("utf-8", errors="surrogateescape")))
    if invalid > MAX_INVALID_SHARE * len(head):
        raise DataError(f"{path} looks binary ({invalid} of its first {len(head)} bytes are not UTF-8); {BINARY_FIX}")
    return encoding


def text_lines(path: Path, newline: str | None = None, stats=None) -> Iterator[str]:
    """The lines of a text file; bytes that are not UTF-8 become U+FFFD, with one warning per file. `stats` (a
    readers.ReadStats), if given, is shown the raw file being read and counts the replaced bytes."""
    encoding = _encoding(path)
    # UTF-8 files are read with escapes so the bad bytes can be counted; UTF-16/32 ones are rare enough to replace.
    errors = "replace" if encoding in ("utf-16", "utf-32") else "surrogateescape"
    invalid = 0
    raw, binary = _open_binary(path)
    if stats is not None:
        stats.reading = raw
    try:
        with raw, binary, io.TextIOWrapper(binary, encoding=encoding, errors=errors, newline=newline) as f:
            for line in f:
                line, count = _ESCAPED_BYTE.subn("\ufffd", line)
                invalid += count
                yield line
    except _decompression_errors(path) as e:
        raise _bad_compressed(path, e) from None
    finally:
        if stats is not None:
            stats.reading = None
            stats.invalid_bytes += invalid
    if invalid:
        log.warning(
            "%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD (convert the file to UTF-8, "
            "e.g. iconv -f latin1 -t utf-8)",
            path,
            invalid,
        )
