"""What the log says of the held-out split: the validation split's padding line names it validation, and a single
document that leaves no held-out text says there is no evaluation."""

import test_dataset_dir

gpt2_tokenizer = test_dataset_dir.gpt2_tokenizer  # its module-scoped fixture, shared


def test_the_validation_split_s_padding_line_says_validation(caplog, tmp_path, gpt2_tokenizer):
    import logging

    from spmdlm.data.records import Cut
    from spmdlm.data.token_cache import prepare_split

    with caplog.at_level(logging.INFO, logger="spmdlm"):
        prepare_split(
            ["one line", "two more lines here"],
            gpt2_tokenizer,
            Cut(8, 0, "lines", pad_id=0),
            cache_dir=tmp_path,
            name="validation",
        )
    lines = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lines records of 8 tokens: validation 2 with"), lines


def test_one_document_that_leaves_no_held_out_text_says_so(caplog):
    import logging
    import types

    from spmdlm.cli.launch import parse_args
    from spmdlm.train.stages.corpora import tokenize_validation

    args, _ = parse_args(["--train_file", "x.txt", "--text_documents", "file"])
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        reading = types.SimpleNamespace(data=args.data, control=args.control)  # what the data stage reads of the run
        assert tokenize_validation(reading, [], False) is None
    assert "no evaluation: the held-out 5.0% of the documents is none of them" in caplog.text
