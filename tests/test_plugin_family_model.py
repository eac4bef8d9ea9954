"""The out-of-tree OPT family (tests/plugins/spmdlm_opt) against transformers' OPTForCausalLM, both ways, in fp32.

Its rename table is walked here directly (`TABLE.expand`), since the family is not registered with spmdlm.

What is compared: logits at every position of an unpadded batch, and at the real (mask 1) positions of a
right-padded batch. Those are exactly the positions where OPT's mask-derived positions (cumsum(mask) - 1) equal
ours (0..T-1); padded positions' logits are read by nobody (and OPT gives them position -1, i.e. row 1). With right
padding, causality alone already hides the pads from real tokens, so a left-padded batch checks the padding mask:
there transformers is given our positions (position_ids 0..T-1) explicitly, and its real positions are compared.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent / "plugins"))  # the plugin package; tests/plugins is no package

from spmdlm_opt import TABLE, TINY, OPTConfig, OPTForCausalLM, forward_flops  # noqa: E402

from spmdlm.mesh import make_mesh  # noqa: E402
from spmdlm.models.hf_config import ConfigError  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESH = "data=2,fsdp=2,tensor=2"
CONFIG = OPTConfig.from_dict(TINY)


def batches(config: OPTConfig) -> dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """name -> (our batch, what transformers gets besides it)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, config.vocab_size, (4, 17))
    right = np.ones(ids.shape, np.int64)
    right[1, 11:] = 0  # right padding, as tokenizers pad
    right[3, 4:] = 0
    left = right[:, ::-1].copy()
    pad = lambda mask: {"input_ids": np.where(mask == 1, ids, config.pad_token_id), "attention_mask": mask}
    ours_positions = {"position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()}
    return {
        "unpadded": ({"input_ids": ids}, {}),
        "right_padded": (pad(right), {}),
        "left_padded": (pad(left), ours_positions),
    }


def build_ours(config: OPTConfig, seed: int = 0) -> OPTForCausalLM:
    return OPTForCausalLM(config, rngs=nnx.Rngs(seed))  # under the caller's mesh: parameters born sharded


def params_by_path(model) -> dict[str, nnx.Variable]:
    return {".".join(str(p) for p in path): var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}


def fill_from_torch(model, state_dict: dict) -> None:
    """HF tensors -> our parameters through TABLE (the layouts' second element), keeping each one's sharding."""
    variables = params_by_path(model)
    rules = list(TABLE.expand(model.config))
    assert {rule.ours for rule in rules} == set(variables)  # the table covers every parameter
    used = {rule.hf for rule in rules}
    assert sorted(set(state_dict) - used) == ["lm_head.weight"]  # only the tied head is left out
    staged = {name: np.array(var.get_value()) for name, var in variables.items()}
    for rule in rules:
        value = state_dict[rule.hf].detach().numpy().astype(np.float32)
        if rule.layer is None:
            staged[rule.ours] = rule.layout[1](value, staged[rule.ours].shape)
        else:
            staged[rule.ours][rule.layer] = rule.layout[1](value, staged[rule.ours].shape[1:])
    for name, var in variables.items():
        var.set_value(jax.device_put(staged[name], var.get_value().sharding))


def to_torch(model) -> dict:
    """Our parameters -> HF tensors through TABLE (the layouts' first element)."""
    variables = params_by_path(model)
    out = {}
    for rule in TABLE.expand(model.config):
        value = np.asarray(variables[rule.ours].get_value())
        out[rule.hf] = torch.from_numpy(rule.layout[0](value if rule.layer is None else value[rule.layer]).copy())
    return out


def perturbed_hf_model(config: OPTConfig):
    """A random transformers OPT with every parameter perturbed (so a swapped or dropped tensor shows)."""
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**config.to_hf_dict())).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if "layer_norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    return model


def hf_logits(model, batch: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()


def our_logits(model, batch: dict) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, b: m(**b))(model, {k: jnp.asarray(v) for k, v in batch.items()}))


def assert_close_where_compared(ours, theirs, batch, name):
    read = batch.get("attention_mask", np.ones(batch["input_ids"].shape)).astype(bool)
    assert np.abs(theirs[read]).max() > 0.1, name  # not trivially small
    np.testing.assert_allclose(ours[read], theirs[read], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_transformers_weights_give_the_same_logits():
    hf = perturbed_hf_model(CONFIG)
    with jax.set_mesh(make_mesh(MESH)):
        ours = build_ours(CONFIG)
        specs = [str(v.get_value().sharding.spec) for v in params_by_path(ours).values()]
        assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)  # the logical axes apply
        fill_from_torch(ours, hf.state_dict())
        for name, (batch, hf_extra) in batches(CONFIG).items():
            assert_close_where_compared(our_logits(ours, batch), hf_logits(hf, {**batch, **hf_extra}), batch, name)


@pytest.mark.slow
def test_our_weights_load_into_transformers(tmp_path):
    from safetensors.torch import save_file

    with jax.set_mesh(make_mesh(MESH)):
        ours = build_ours(CONFIG, seed=1)
        key = jax.random.key(1)
        for var in params_by_path(ours).values():  # biases are born 0 and gains 1: perturb everything
            key, sub = jax.random.split(key)
            value = var.get_value()
            var.set_value(value + 0.05 * jax.random.normal(sub, value.shape, value.dtype))
        tensors = to_torch(ours)
        (tmp_path / "config.json").write_text(json.dumps({**CONFIG.to_hf_dict(), "dtype": "float32"}))
        save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        hf, info = transformers.OPTForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
        hf.eval()
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert hf.lm_head.weight.data_ptr() == hf.model.decoder.embed_tokens.weight.data_ptr()  # re-tied
        for name, value in hf.state_dict().items():
            torch.testing.assert_close(
                value,
                tensors["model.decoder.embed_tokens.weight" if name == "lm_head.weight" else name],
                rtol=0,
                atol=0,
                msg=name,
            )
        for name, (batch, hf_extra) in batches(CONFIG).items():
            assert_close_where_compared(our_logits(ours, batch), hf_logits(hf, {**batch, **hf_extra}), batch, name)


def test_config_refuses_what_is_not_modelled():
    assert CONFIG.word_embed_proj_dim == CONFIG.hidden_size and CONFIG.max_length == 130
    assert transformers.OPTConfig(**CONFIG.to_hf_dict()).word_embed_proj_dim == CONFIG.hidden_size
    for change, words in [
        ({"do_layer_norm_before": False}, "do_layer_norm_before"),
        ({"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
        ({"activation_function": "gelu"}, "activation_function"),
        ({"enable_bias": False}, "enable_bias"),
        ({"layer_norm_elementwise_affine": False}, "elementwise_affine"),
        ({"tie_word_embeddings": False}, "untied"),
        ({"num_attention_heads": 5}, "divisible"),
    ]:
        with pytest.raises(ConfigError, match=words):
            OPTConfig.from_dict({**TINY, **change})


def test_forward_flops_count_the_matmuls():
    d, ff, vocab, layers, seq = 64, 128, 512, 2, 16
    parts = forward_flops(CONFIG, {"input": seq})
    assert parts["dense"] == seq * layers * 2 * (4 * d * d + 2 * d * ff)
    assert parts["attention"] == seq * layers * 2 * 2 * seq * d / 2
    assert parts["lm_head"] == seq * 2 * d * vocab
    assert forward_flops(CONFIG, {"input": seq}, full_causal_square=True)["attention"] == 2 * parts["attention"]
