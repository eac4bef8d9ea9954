"""A small rule-based sentence splitter (no downloaded models or data), for BART's sentence permutation.

`sentence_ends(text)` gives the end offset (exclusive) of every sentence. The rules:

- a newline ends a sentence (the sentence ends before it);
- a run of `.`, `!` or `?` (`.`, `?!`, `...`), optionally followed by closing quotes or brackets (`"')]”’»`), ends a
  sentence when whitespace follows and then a character that is not a lowercase letter. So "e.g. this" and "3.14"
  do not split, "He left. Then" and 'she said "Go!" And' do;
- whitespace after a boundary belongs to the next sentence (byte-level BPE glues a space to the word after it);
- sentences that would hold only whitespace (blank lines) are merged into the next one, and the last sentence
  always ends at len(text), trailing whitespace included (no ends at all for a text that is only whitespace).

Known misses, accepted for speed and simplicity: abbreviations before a capital ("Mr. Smith") split, and sentences
that end without punctuation or newline run on into the next one.

`mark_sentence_ends(offsets, ends)` turns the character ends into per-token flags: True at the last token of each
sentence, i.e. the last token that starts before the sentence's end offset (a token straddling a boundary, such as
a merged `."`, belongs to the sentence it starts in). Prepared "sentences" records carry those flags as the
`SENTENCE_END` bit of the token id (spmdlm.data.records).
"""

from __future__ import annotations

import re

import numpy as np

SENTENCE_END = 1 << 30  # flag bit on the last content token of each sentence in a prepared record

# Group 1 captures the first non-space character after the punctuation, to test it for lowercase (any script).
_BOUNDARY = re.compile(r"\n|[.!?]+[\"')\]”’»]*(?=\s+(\S))")


def sentence_ends(text: str) -> list[int]:
    """Sorted end offsets (exclusive) of the sentences of `text`; see the module docstring for the rules."""
    ends: list[int] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if match.group(0) == "\n":
            end = match.start()
        elif match.group(1).islower():
            continue  # "e.g. this", "approx. ten": not a sentence end
        else:
            end = match.end()
        if text[start:end].strip():  # skip empty or whitespace-only sentences (blank lines)
            ends.append(end)
            start = end
    if text.strip():
        if ends and not text[ends[-1] :].strip():
            ends[-1] = len(text)  # trailing whitespace joins the last sentence
        else:
            ends.append(len(text))
    return ends


def mark_sentence_ends(offsets: list[tuple[int, int]] | np.ndarray, ends: list[int]) -> np.ndarray:
    """bool[len(offsets)]: True at the last token of each sentence (the last token whose start < the end offset).

    `offsets` are one document's per-token (start, end) character offsets, in order, as tokenizers return them.
    """
    starts = (
        offsets[:, 0].astype(np.int64)
        if isinstance(offsets, np.ndarray)  # a long document's, in pieces
        else np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    )
    flags = np.zeros(len(offsets), dtype=bool)
    last = np.searchsorted(starts, np.asarray(ends, dtype=np.int64), side="left") - 1
    flags[last[last >= 0]] = True  # an end before the first token (none in practice) marks nothing
    return flags
