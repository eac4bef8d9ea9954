"""BART denoising pretraining end to end: a tiny model trained on a small text reconstructs a masked sentence with
transformers' generate on the export, and sentence ends reach the records as flags."""

import json

import numpy as np

from conftest import FIXTURES, read_metrics
from spmdlm.data import sources
from spmdlm.data.objectives.denoising import SENTENCE_END
from spmdlm.data.tokenizer import train_tokenizer
from spmdlm.launch import main

TINY = {"model_type": "bart", "vocab_size": 512, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256,
        "max_position_embeddings": 64, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}


def test_bart_trains_and_its_export_generates(tmp_path, cache_dir):
    config = tmp_path / "bart-micro.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "bart"
    assert main(["--config_name", str(config), "--train_file", str(FIXTURES / "overfit.txt"),  # no --model_type
                 "--output_dir", str(out), "--cache_dir", str(cache_dir), "--max_seq_length", "48",
                 "--mesh", "data=2,fsdp=4", "--per_device_train_batch_size", "1", "--validation_file",
                 str(FIXTURES / "overfit.txt"), "--max_steps", "100", "--learning_rate", "3e-3", "--warmup_steps",
                 "10", "--lr_scheduler_type", "constant", "--logging_steps", "25", "--eval_steps", "50",
                 "--save_steps", "1000", "--seed", "2"]) == 0
    metrics = read_metrics(out)
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    print("bart train loss", [round(x, 3) for x in losses], "eval", [round(m["eval_loss"], 3) for m in evals])
    assert losses[-1] < 0.5 * losses[0] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert json.loads((out / "run_config.json").read_text())["model_config"]["model_type"] == "bart"

    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert isinstance(tokenizer, transformers.BartTokenizerFast) and tokenizer.mask_token_id == 4
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out / "hf").eval()
    assert model.generation_config.decoder_start_token_id == 2 and model.generation_config.forced_eos_token_id == 2
    inputs = tokenizer("The sea was grey, the wind came from the<mask>.", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=20, num_beams=2, do_sample=False)
    assert generated.shape[1] > 2 and generated[0, 0] == 2  # starts from decoder_start_token_id


def test_sentence_ends_are_flagged_in_prepared_records(tmp_path):
    docs = ["One sentence here. Another one follows! And a third?", "Second document without punctuation"]
    tok = train_tokenizer("bart", docs * 5, 300)
    split = sources.prepare_split(docs, tok, record_length=8, separator_id=2, cache_dir=tmp_path, name="train",
                                  mode="sentences")
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(split.path))
    stream = np.concatenate([np.frombuffer(r, np.int32) for r in reader.read_all()])
    ids, ends = stream & (SENTENCE_END - 1), (stream & SENTENCE_END) != 0
    expected = []
    for doc in docs:
        enc = tok.encode(doc, add_special_tokens=False)
        expected += enc.ids + [2]
    np.testing.assert_array_equal(ids, np.asarray(expected[: len(ids)]))
    decoded_ends = [tok.decode(ids[: i + 1].tolist()).rstrip()[-1] for i in np.flatnonzero(ends)]
    assert decoded_ends[:3] == [".", "!", "?"]  # the last token of each sentence carries the flag
