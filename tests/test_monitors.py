"""The stability monitors (--monitor_every): one step's monitors against a NumPy/jax.grad recomputation (per-layer
and per-group gradient norms, update-to-parameter ratios, logits' max, z-loss; each layer's largest attention logit
and output RMS, scanned and per-layer stacks, einsums and a fused kernel), the same under accumulation and a chunked
loss; the plain step untouched between monitor steps; the warning's median rule; a run's records."""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import STDLIB_JSON, read_metrics
from flax import nnx

from spmdlm.engine import monitors
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Loss, Stepper, Training
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family, load_config
from spmdlm.launch import main
from spmdlm.mesh import make_mesh
from spmdlm.models import kernels, probes
from spmdlm.models.attention import Attention, make_attention_mask, set_attention
from spmdlm.models.stack import PER_LAYER, LayerStack, unstack
from spmdlm.run_args.sections import OptimizationArgs, ReportingArgs
from spmdlm.train.safety.stability import LEAST_HISTORY, WINDOW, StabilityWatch

GPT2 = get_family("gpt2")
TINY_GPT2 = load_config("gpt2-tiny", "gpt2").replace(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2)
OPTIM = OptimizationArgs(learning_rate=1e-2, optim="adamw")
# GPT-2's parameters by group, written out here rather than derived as the monitors derive them
GROUP_OF = {"wte": "embeddings", "wpe": "embeddings", "ln_f": "norms", "ln_1": "norms", "ln_2": "norms"}
GROUP_OF |= {"attn": "attention", "mlp": "mlp"}


def stepper_and_state(monitor_every: int, grad_accum: int = 1, loss: Loss = Loss()):
    """A tiny GPT-2's stepper, state and batch; with --monitor_every 1 only the monitor variant is compiled."""
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    training = Training(OPTIM, learning_rate_schedule(OPTIM, 4), grad_accum, monitor_every=monitor_every)
    return compiled(GPT2, TINY_GPT2, Compute("float32", "none"), {"input_ids": ids, "labels": ids}, training, loss)


def compiled(family, config, compute: Compute, batch: dict, training: Training, loss: Loss = Loss()):
    """(stepper, state, placed batch) of `family`'s model on a data=2 mesh, its train step compiled for `batch`;
    with --monitor_every 1 only the monitor variant."""
    mesh = make_mesh("data=2", jax.devices()[:2])
    graphdef, state = build_train_state(family, config, mesh, optim=OPTIM, total_steps=4, compute=compute)
    stepper = Stepper(graphdef, state, mesh, family.forward, loss=loss, training=training)
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    if training.monitor_every == 1:
        stepper.compiled_monitor = stepper.lower_train(state, spec, monitor=True).compile()
    else:
        stepper.compile_train(state, spec)
    return stepper, state, jax.device_put(batch, stepper.batch_shardings(spec))


def by_path(tree) -> dict[tuple, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {tuple(str(getattr(k, "key", "")) for k in p if hasattr(k, "key")): np.asarray(v) for p, v in leaves}


def recomputed(graphdef, state, batch):
    """The step's gradients by jax.grad of a cross-entropy written out here, and the logits they start from."""
    model = nnx.merge(graphdef, state, copy=True)[0]
    graph, params = nnx.split(model, nnx.Param)
    labels = np.asarray(batch["labels"])

    def loss_of(p):
        logits = GPT2.forward(nnx.merge(graph, p), batch).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, jnp.asarray(labels)[..., None], -1)), logits

    grads, logits = jax.jit(jax.grad(loss_of, has_aux=True))(params)  # one program, not op by op
    return by_path(grads), np.asarray(logits, np.float64), by_path(params)


@pytest.fixture(scope="module")
def monitored_step():
    stepper, state, batch = stepper_and_state(monitor_every=2)
    state, plain = stepper.train_step(state, batch, 0)  # step 1: not a monitor step
    grads, logits, before = recomputed(stepper.graphdef, state, batch)
    state, metrics = stepper.train_step(state, batch, 1)  # step 2: a monitor step
    after = by_path(nnx.state(nnx.merge(stepper.graphdef, state)[0], nnx.Param))
    return jax.device_get(plain), jax.device_get(metrics), grads, logits, before, after


@pytest.mark.slow
def test_monitors_equal_a_numpy_recomputation(monitored_step):
    plain, metrics, grads, logits, before, after = monitored_step
    assert not any(k.startswith("monitor/") for k in plain) and "logits_max" not in plain
    layers = np.zeros(TINY_GPT2.n_layer)
    groups: dict[str, list] = {}
    for path, grad in grads.items():
        group = next(GROUP_OF[name] for name in path if name in GROUP_OF)
        sums = groups.setdefault(group, [0.0, 0.0, 0.0])
        update = after[path].astype(np.float64) - before[path]
        sums[0] += np.sum(np.square(grad, dtype=np.float64))
        sums[1] += np.sum(np.square(update))
        sums[2] += np.sum(np.square(before[path], dtype=np.float64))
        if "layers" in path:
            layers += np.sum(np.square(grad, dtype=np.float64).reshape(len(layers), -1), axis=1)
    np.testing.assert_allclose(metrics["monitor/grad_norm/layer"], np.sqrt(layers), rtol=1e-5)
    assert sorted(k.split("/")[-1] for k in metrics if k.startswith("monitor/update_ratio/")) == sorted(groups)
    for group, (grad, update, weight) in groups.items():
        np.testing.assert_allclose(metrics[f"monitor/grad_norm/{group}"], np.sqrt(grad), rtol=1e-5, err_msg=group)
        np.testing.assert_allclose(metrics[f"monitor/update_ratio/{group}"], np.sqrt(update / weight), rtol=1e-5)
    np.testing.assert_allclose(metrics["monitor/logits_max"], logits.max(), rtol=1e-5)
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    np.testing.assert_allclose(metrics["monitor/z_loss"], np.mean(lse**2), rtol=1e-5)
    assert metrics["monitor/update_ratio/mlp"] > 0


@pytest.mark.slow
def test_monitors_are_the_same_under_accumulation_and_a_chunked_loss(monitored_step):
    metrics = monitored_step[1]
    stepper, state, batch = stepper_and_state(monitor_every=1, grad_accum=2, loss=Loss(loss_chunk=8))
    state, _ = stepper.train_step(state, batch, 0)
    _, other = stepper.train_step(state, batch, 1)
    other = jax.device_get(other)
    assert sorted(other) == sorted(metrics)
    for key in (k for k in metrics if k.startswith("monitor/")):
        np.testing.assert_allclose(other[key], metrics[key], rtol=1e-5, err_msg=key)


# -- what the forward pass records (models/probes.py): each layer's largest attention logit, its output's RMS --------
# Tiny models without dropout (the recomputation runs without it), by family: an encoder, a decoder with grouped
# key/value heads and QK-norm, an encoder-decoder (cross-attention; T5's position bias in the logits).
PROBED = {
    "roberta": load_config("roberta-tiny", "roberta").replace(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ),
    "qwen3": load_config("qwen3-tiny", "qwen3").replace(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
    ),
    "t5": load_config("t5-v1_1-tiny", "t5").replace(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, dropout_rate=0.0,
    ),
}  # fmt: skip


def probed_batch(family: str) -> dict[str, np.ndarray]:
    """Random ids (3.. so no pad id) with right padding in two rows: masked keys the largest logit must skip."""
    rng = np.random.default_rng(1)
    ids, decoder_ids = (rng.integers(3, 64, (4, n)).astype(np.int32) for n in (16, 12))
    mask = np.ones_like(ids)
    mask[1, 10:], mask[3, 5:] = 0, 0
    if family == "t5":
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids, "labels": decoder_ids}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def per_layer_copy(graphdef, state) -> nnx.Module:
    """The model of `state` on the host, every stack applied layer by layer without remat, attention by einsums:
    called eagerly, each layer sees concrete arrays."""
    model = nnx.merge(graphdef, jax.device_get(state), copy=True)[0]
    for stack in [node for _, node in nnx.iter_graph(model) if isinstance(node, LayerStack)]:
        if not stack.per_layer:
            stack.layers, stack.per_layer = nnx.List(unstack(stack.layers, stack.count)), True
        stack.remat = "none"
    return set_attention(model, "xla")


def largest_logit(attention: Attention, x, context=None, *, mask=None, bias=None, positions=None, **_) -> float:
    """q·kᵀ·scale (+ bias) of one attention call in float64 NumPy, from its input and its projections, at its
    largest over the (query, key) pairs the mask allows."""
    if attention.qkv is not None:
        q, k = (attention.heads(attention.qkv(x)[..., i, :]) for i in (0, 1))
    else:
        q, (k, _) = attention._queries(x), attention.keys_values(x if context is None else context)
    if attention.rope is not None:
        positions = np.arange(x.shape[1])[None] if positions is None else positions
        q, k = attention.rope(q, positions), attention.rope(k, positions)
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)  # each key/value head serves its group of query heads
    scores = np.einsum("bthd,bshd->bhts", q, k) * attention.scale + (0.0 if bias is None else np.asarray(bias))
    allowed = True if mask is None else np.asarray(mask.array(q.shape[1], k.shape[1]))
    return float(np.max(np.where(allowed, scores, -np.inf)))


def recomputed_probes(family, graphdef, state, batch, monkeypatch) -> dict[str, np.ndarray]:
    """Each layer's largest attention logit and output RMS by the monitors' names, from an eager forward pass whose
    attention inputs and layer outputs are captured as they go by."""
    model = per_layer_copy(graphdef, state)
    stacks = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, LayerStack)}
    where = {}  # id of a layer or of an attention in it -> (its stack's label, its index)
    for path, stack in stacks.items():
        for i, layer in enumerate(stack.layers):
            label = f"{path[0]}/" if len(stacks) > 1 else ""
            where.update({id(node): (label, i) for _, node in nnx.iter_graph(layer)})
    calls, outputs = [], []
    attend, layer_class = Attention.__call__, type(next(iter(stacks.values())).layers[0])
    run_layer = layer_class.__call__

    def spy_layer(self, *args, **kwargs):
        outputs.append((self, run_layer(self, *args, **kwargs)))
        return outputs[-1][1]

    with monkeypatch.context() as patched:
        patched.setattr(
            Attention, "__call__", lambda self, *a, **kw: calls.append((self, a, kw)) or attend(self, *a, **kw)
        )
        patched.setattr(layer_class, "__call__", spy_layer)
        family.forward(model, batch)
    want: dict[str, dict[int, float]] = {}
    for attention, args, kwargs in calls:
        label, i = where[id(attention)]
        name = "cross_attn_logit_max" if attention.cross else "attn_logit_max"
        want.setdefault(f"monitor/{name}/{label}layer", {})[i] = largest_logit(attention, *args, **kwargs)
    for layer, out in outputs:
        label, i = where[id(layer)]
        rms = np.sqrt(np.mean(np.square(np.asarray(out, np.float64))))
        want.setdefault(f"monitor/act_rms/{label}layer", {})[i] = rms
    return {key: np.array([values[i] for i in sorted(values)]) for key, values in want.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,unroll,implementation",
    [("roberta", 1, "dot_product"), ("qwen3", PER_LAYER, "xla"), ("t5", 1, "xla")],
)
def test_each_layers_largest_attention_logit_and_output_rms_equal_a_recomputation(
    name, unroll, implementation, monkeypatch
):
    """Scanned (under remat) and per-layer stacks; the einsums and a fused kernel (`dot_product`, whose largest
    logit is computed beside it)."""
    family, batch = get_family(name), probed_batch(name)
    training = Training(OPTIM, learning_rate_schedule(OPTIM, 4), monitor_every=1)
    stepper, state, placed = compiled(
        family, PROBED[name], Compute("float32", "dots", unroll, implementation), batch, training
    )
    want = recomputed_probes(family, stepper.graphdef, state, batch, monkeypatch)
    _, metrics = stepper.train_step(state, placed, 0)
    got = {
        k: np.asarray(v)
        for k, v in metrics.items()
        if k.startswith(("monitor/act_rms/", "monitor/attn_", "monitor/cross_"))
    }
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def test_the_largest_logit_beside_a_kernel_is_the_masked_maximum_block_by_block():
    """kernels.logit_max with blocks that do not divide the length: grouped heads, a bias, padding, packed segments,
    causality and a sliding window, against the whole score matrix in NumPy."""
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(2, 11, 4, 8)).astype(np.float32), rng.normal(size=(2, 11, 2, 8)).astype(np.float32)
    bias = rng.normal(size=(1, 4, 11, 11)).astype(np.float32)
    valid = np.arange(11)[None] < np.array([[11], [7]])
    segments = np.array([[1] * 6 + [2] * 5, [1] * 4 + [2] * 7])
    mask = make_attention_mask(jnp.asarray(valid), causal=True, q_segments=segments, kv_segments=segments)
    mask = dataclasses.replace(mask, window=(3, 0))
    scores = np.einsum("bthd,bshd->bhts", q.astype(np.float64), np.repeat(k, 2, axis=2).astype(np.float64)) * 0.5
    allowed = np.asarray(mask.array(11, 11))
    want = np.max(np.where(allowed, scores + bias, -np.inf))
    got = kernels.logit_max(jnp.asarray(q), jnp.asarray(k), mask, jnp.asarray(bias), 0.5, block=4)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert want < np.max(scores + bias)  # the mask did hide the largest score


def test_layers_are_numbered_in_order_across_a_list_of_stacks_and_within_a_period():
    """Llama's runs of full and sliding layers (stacks of one list) count on; an encoder-decoder's stacks are named;
    a layer of several attentions (a ModernBERT period) gives them consecutive numbers, in the order they ran."""
    first, second = jnp.array([1.0, 2.0]), jnp.array([3.0])
    runs = monitors.by_stack_group({("stacks", 10): second, ("stacks", 2): first})
    assert list(runs) == [""] and runs[""].tolist() == [1, 2, 3]
    assert sorted(monitors.by_stack_group({("decoder", "block"): second, ("encoder", "block"): first})) == [
        "decoder/",
        "encoder/",
    ]
    period = probes.LayerRecords(lambda layer, x, key: x)
    period.names = (probes.LOGIT_MAX, probes.LOGIT_MAX, probes.OUTPUT_SQUARE_MEAN)
    recorded = period.per_layer([jnp.array([0.0, 10.0]), jnp.array([1.0, 11.0]), jnp.array([5.0, 6.0])])
    assert {name: v.tolist() for name, v in recorded.items()} == {
        probes.LOGIT_MAX: [0, 1, 10, 11],
        probes.OUTPUT_SQUARE_MEAN: [5, 6],
    }


def test_a_layer_past_the_factor_of_its_median_is_warned_about(caplog):
    watch = StabilityWatch(4.0)
    calm = {"monitor/grad_norm/layer_0": 1.0, "monitor/grad_norm/layer_1": 2.0, "monitor/grad_norm/attention": 1.0}
    for step in range(1, LEAST_HISTORY + 1):  # the first records are history only, however large
        assert watch.check({"step": step, **calm, "monitor/grad_norm/layer_0": 0.9 + 0.1 * (step % 3)}) == []
    assert watch.check({"step": 6, **calm, "monitor/grad_norm/layer_1": 7.9}) == []  # 3.95x: below the factor
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        grown = watch.check({"step": 7, **calm, "monitor/grad_norm/layer_1": 9.0, "monitor/grad_norm/attention": 99})
    assert [g.split()[0] for g in grown] == ["monitor/grad_norm/layer_1"]  # a group's norm is not judged
    assert "step 7" in caplog.text and "4.5x its median 2" in caplog.text and "--monitor_warn_factor 4" in caplog.text
    for step in range(8, 8 + WINDOW):  # the median follows the last WINDOW records: a new level stops the warnings
        watch.check({"step": step, **calm, "monitor/grad_norm/layer_1": 9.0})
    assert watch.check({"step": 30, **calm, "monitor/grad_norm/layer_1": 30.0}) == []
    resumed = StabilityWatch(4.0)  # a resumed run: the records before the checkpoint are its history
    for step in range(1, LEAST_HISTORY + 1):
        resumed.remember({"step": step, **calm})
    assert [g.split()[0] for g in resumed.check({"step": 6, **calm, "monitor/grad_norm/layer_0": 5.0})] == [
        "monitor/grad_norm/layer_0"
    ]


def test_a_layers_attention_logit_past_the_factor_of_its_median_is_warned_about(caplog):
    watch = StabilityWatch(4.0)
    calm = {
        "monitor/attn_logit_max/decoder/layer_0": 6.0,
        "monitor/cross_attn_logit_max/decoder/layer_0": 3.0,
        "monitor/attn_logit_max/encoder/layer_1": -0.5,  # a median at or below 0: no multiple of it is growth
        "monitor/act_rms/decoder/layer_0": 1.0,  # not judged
    }
    for step in range(1, LEAST_HISTORY + 1):
        assert watch.check({"step": step, **calm}) == []
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        grown = watch.check({"step": 6, **{key: 9.0 * abs(value) for key, value in calm.items()}})
    assert [g.split()[0] for g in grown] == [
        "monitor/attn_logit_max/decoder/layer_0",
        "monitor/cross_attn_logit_max/decoder/layer_0",
    ]
    assert "monitor/attn_logit_max/decoder/layer_0 54 (9.0x its median 6)" in caplog.text


@pytest.mark.parametrize("flag,value", [("monitor_every", -1), ("monitor_warn_factor", 1.0)])
def test_bad_monitor_flags_are_refused(flag, value):
    with pytest.raises(ArgumentError, match=f"--{flag}"):
        ReportingArgs(**{flag: value})


@pytest.mark.slow
def test_a_run_logs_the_monitors_on_monitor_steps_only(tmp_path, tiny_gpt2_config, cache_dir):
    out = tmp_path / "run"
    args = [*("--train_file", STDLIB_JSON, "--config_name", str(tiny_gpt2_config), "--output_dir", str(out))]
    args += [*("--cache_dir", str(cache_dir), "--block_size", "32", "--global_batch_size", "16", "--mesh", "data=8")]
    args += [*("--max_steps", "4", "--logging_steps", "1", "--save_steps", "4", "--do_eval", "false")]
    assert main([*args, "--monitor_every", "2", "--report_to", "none"]) == 0
    records = read_metrics(out)
    monitored = [r for r in records if any(k.startswith("monitor/") for k in r)]
    assert [r["step"] for r in monitored] == [2, 4]
    layers = json.loads(tiny_gpt2_config.read_text())["n_layer"]
    for record in monitored:
        assert {f"monitor/grad_norm/layer_{i}" for i in range(layers)} <= record.keys()
        assert {"monitor/update_ratio/attention", "monitor/logits_max", "monitor/z_loss"} <= record.keys()
        for name in ("attn_logit_max", "act_rms"):
            assert {f"monitor/{name}/layer_{i}" for i in range(layers)} <= record.keys()
        assert "loss" not in record  # a record of its own, beside the step's train record
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (out / "plots" / "monitors.png").stat().st_size > 0 and (out / "loss_curve.png").is_file()
