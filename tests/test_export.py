"""Transformers interop for GPT-2: parity with real PyTorch models, lossless round trips, the export CLI."""

import json
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from conftest import FIXTURES
from spmdlm import export
from spmdlm.launch import main
from spmdlm.mesh import make_mesh

CONFIGS = {
    "odd-heads": dict(vocab_size=101, n_positions=40, n_embd=48, n_layer=2, n_head=3, layer_norm_epsilon=1e-6),
    "vocab-not-8": dict(vocab_size=257, n_positions=64, n_embd=40, n_layer=3, n_head=5, n_inner=72),
    "long-positions": dict(vocab_size=128, n_positions=128, n_embd=32, n_layer=1, n_head=2,
                           layer_norm_epsilon=1e-4, activation_function="gelu"),
}


def random_hf_gpt2(tmp_path: Path, name: str) -> Path:
    torch.manual_seed(len(name))
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIGS[name])).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped tensor shows up
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = tmp_path / name
    model.save_pretrained(path)
    return path


def ids_and_mask(vocab: int, shape=(8, 20)):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, shape)
    mask = np.ones(shape, dtype=np.int64)
    mask[1, 12:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    return ids, mask


def torch_logits(path: Path, ids, mask=None):
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_pytorch(tmp_path, name):
    path = random_hf_gpt2(tmp_path, name)
    ids, mask = ids_and_mask(CONFIGS[name]["vocab_size"])
    model, config = export.load_hf(path)
    assert config.n_layer == CONFIGS[name]["n_layer"]
    ours = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, torch_logits(path, ids), atol=1e-4, rtol=0)
    ours_masked = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    valid = mask.astype(bool)  # padded query positions are not compared: nothing reads them
    np.testing.assert_allclose(ours_masked[valid], torch_logits(path, ids, mask)[valid], atol=1e-4, rtol=0)


def test_logits_match_pytorch_on_a_sharded_mesh(tmp_path):
    path = random_hf_gpt2(tmp_path, "odd-heads")
    ids, mask = ids_and_mask(101)
    with jax.set_mesh(make_mesh("data=2,fsdp=2,tensor=2")):
        model, _ = export.load_hf(path)
        assert "fsdp" in str(model.h[0].mlp.wi.kernel[...].sharding.spec)
        ours = np.asarray(jax.jit(lambda m, x, a: m(x, attention_mask=a))(model, jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], torch_logits(path, ids, mask)[valid], atol=1e-4, rtol=0)


def test_save_hf_round_trip_is_bitwise_and_loads_cleanly(tmp_path):
    source = random_hf_gpt2(tmp_path, "vocab-not-8")
    model, config = export.load_hf(source)
    out = export.save_hf(model, config, tmp_path / "out")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert isinstance(reloaded, transformers.GPT2LMHeadModel)
    ids, _ = ids_and_mask(257)
    with torch.no_grad():
        theirs = reloaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(jnp.asarray(ids))), atol=1e-4, rtol=0)
    original, written = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert "lm_head.weight" not in written  # tied: written once
    assert set(written) == {k for k in original if k != "lm_head.weight"}
    for key, value in written.items():
        np.testing.assert_array_equal(value, original[key], err_msg=key)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == config.eos_token_id


STDLIB_JSON = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")


def train(out: Path, mesh: str, config: Path, cache_dir: Path, *extra) -> None:
    assert main(["--train_file", STDLIB_JSON, "--config_name", str(config), "--output_dir", str(out),
                 "--cache_dir", str(cache_dir), "--block_size", "32", "--global_batch_size", "16", "--mesh", mesh,
                 "--max_steps", "6", "--logging_steps", "3", "--learning_rate", "3e-3", "--max_eval_samples", "32",
                 "--per_device_eval_batch_size", "2", *extra]) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_gpt2_config, cache_dir):
    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, "data=8", tiny_gpt2_config, cache_dir)
    return out


def test_trained_export_gives_the_same_eval_loss_in_transformers(trained):
    hf_dir = trained / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    # Rebuild the held-out examples exactly as the run did and score them with PyTorch.
    from spmdlm.data import pipeline, sources
    from spmdlm.data.objectives.clm import CausalLM

    cache = next(p for p in Path(json.loads((trained / "run_config.json").read_text())["cache_dir"] or
                                 Path.home()).rglob("validation.json"))
    meta = json.loads(cache.read_text())
    split = sources.PreparedSplit(cache.with_suffix(".array_record"), meta["num_records"], meta["num_tokens"], 32 + 1)
    batches = list(pipeline.eval_batches(split, CausalLM(32), seed=42, global_batch=16, max_examples=32))
    total, count = 0.0, 0
    for batch in batches:
        with torch.no_grad():
            logits = model(torch.tensor(batch["input_ids"], dtype=torch.long)).logits
        labels = torch.tensor(batch["labels"], dtype=torch.long)
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100, reduction="sum").item()
        count += int((labels != -100).sum())
    assert total / count == pytest.approx(ours, abs=1e-4)
    text = "def load(fp):"
    ids = tokenizer(text, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == export_ids(trained, text)
    generated = model.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 8


def export_ids(run_dir: Path, text: str) -> list[int]:
    from spmdlm.data.tokenizer import load_tokenizer

    return load_tokenizer(run_dir).encode(text, add_special_tokens=False).ids


def test_export_cli_and_sharded_checkpoint_match(trained, tmp_path, tiny_gpt2_config, cache_dir):
    sharded = tmp_path / "sharded"
    train(sharded, "data=2,fsdp=2,tensor=2", tiny_gpt2_config, cache_dir, "--export_hf", "false")
    assert export.main(["--checkpoint", str(sharded), "--out", str(tmp_path / "a")]) == 0
    assert export.main(["--checkpoint", str(trained), "--out", str(tmp_path / "b"), "--step", "6",
                        "--mesh", "fsdp=8"]) == 0
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    # Adam turns float-rounding differences in near-zero gradients into lr-sized steps, so weights agree to
    # ~lr; what the cross-mesh tolerance bounds is the model's loss.
    print(f"largest weight difference between data=8 and data=2,fsdp=2,tensor=2 exports: {worst:.2e}")
    assert worst < 1e-3
    ids = np.random.default_rng(0).integers(0, 512, (4, 32))
    losses = []
    for name in ("a", "b"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            losses.append(model(torch.tensor(ids), labels=torch.tensor(ids)).loss.item())
    print(f"loss of the two exports on a random batch: {losses}")
    assert abs(losses[0] - losses[1]) / losses[1] < 1e-4
    assert (tmp_path / "a" / "tokenizer.json").exists()


def test_continued_pretraining_from_a_transformers_checkpoint(trained, tmp_path, cache_dir):
    out = tmp_path / "continued"
    code = main(["--model_name_or_path", str(trained / "hf"), "--train_file", STDLIB_JSON, "--output_dir", str(out),
                 "--cache_dir", str(cache_dir), "--block_size", "32", "--global_batch_size", "16", "--max_steps", "1",
                 "--learning_rate", "0", "--warmup_steps", "0", "--max_eval_samples", "32",
                 "--per_device_eval_batch_size", "2", "--export_hf", "false"])
    assert code == 0
    start = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    after = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert after == pytest.approx(start, abs=1e-5)  # lr 0: the loaded weights, unchanged


def test_export_errors_write_nothing(tmp_path, trained, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.main(["--checkpoint", str(empty), "--out", str(tmp_path / "x")]) == 2
    assert "no run_config.json" in capsys.readouterr().err
    assert export.main(["--checkpoint", str(trained), "--out", str(tmp_path / "x"), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at step 5" in err and "available: 6" in err
    assert not (tmp_path / "x").exists()
    bert = tmp_path / "bert"
    transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=32)).save_pretrained(bert)
    with pytest.raises(Exception, match=r"holds a 'bert' model \(BertForMaskedLM\)"):
        export.load_hf(bert)
    assert main(["--model_name_or_path", str(bert), "--train_file", str(FIXTURES / "overfit.txt"),
                 "--output_dir", str(tmp_path / "y")]) == 2
    assert "holds a 'bert' model" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
