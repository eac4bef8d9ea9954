"""Training a tokenizer holds a piece of a long document at a time, not the whole: documents are cut into pieces as
the record writer cuts them, and the trained tokenizer is the same (the same word counts)."""

import pytest


# -- tokenizer training memory: documents cut into pieces, as the record writer does -------------------------------
@pytest.mark.parametrize("model", ["gpt2", "t5"])
def test_the_tokenizer_trainer_reads_long_documents_in_pieces(monkeypatch, model):
    import numpy as np

    from spmdlm.data import records
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.families import get_family

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), rng.integers(2, 7))) for _ in range(200)]
    doc = " ".join(rng.choice(words, 3000)) + "  double  spaces stay   whole. And\nlines too"
    whole = train_tokenizer(get_family(model), [doc], 400).to_str()
    monkeypatch.setattr(records, "PIECE_CHARS", 100)
    pieces = list(records.in_pieces([doc, "short"]))
    assert "".join(pieces[:-1]) == doc and pieces[-1] == "short" and len(pieces) > 100
    assert max(map(len, pieces)) < 120
    assert train_tokenizer(get_family(model), [doc], 400).to_str() == whole  # the same word counts
