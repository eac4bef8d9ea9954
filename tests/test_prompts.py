"""Prompts: --sample_prompts splits at `|` but keeps the tokenizer's own special tokens (`<|endoftext|>`) whole, and
spmdlm.generate from a model folder without a tokenizer says in one line what to copy into it."""

import test_dataset_dir

gpt2_tokenizer = test_dataset_dir.gpt2_tokenizer  # its module-scoped fixture, shared


def test_sample_prompts_keep_the_tokenizer_s_own_bars(gpt2_tokenizer):
    from spmdlm.train.loop import split_prompts

    assert split_prompts("a<|endoftext|>b|c||", gpt2_tokenizer) == ["a<|endoftext|>b", "c"]
    assert split_prompts("def main(|import os", gpt2_tokenizer) == ["def main(", "import os"]


def test_generate_from_a_folder_without_a_tokenizer_says_what_to_copy(capsys, tmp_path, tiny_gpt2_config):
    from spmdlm.cli.generate import main as generate

    (tmp_path / "config.json").write_text(tiny_gpt2_config.read_text())
    assert generate(["--model_name_or_path", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(f"error: --model_name_or_path {tmp_path} has no tokenizer (tokenizer.json or ")
    assert err.strip().endswith(
        "sentencepiece.bpe.model): copy the tokenizer the model was trained with into it (a run's is "
        "OUTPUT_DIR/tokenizer.json)"
    )
    assert "vocab.json + merges.txt" in err and "\n" not in err.strip()
    assert "--tokenizer_name" not in err
