"""The stability monitors (--monitor_every): one step's monitors against a NumPy/jax.grad recomputation (per-layer
and per-group gradient norms, update-to-parameter ratios, logits' max, z-loss), the same under accumulation and a
chunked loss; the plain step untouched between monitor steps; the warning's median rule; a run's records."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import read_metrics
from family_fixtures import STDLIB_JSON
from flax import nnx

from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Loss, Stepper, Training
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family, load_config
from spmdlm.launch import main
from spmdlm.mesh import make_mesh
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
    mesh = make_mesh("data=2", jax.devices()[:2])
    graphdef, state = build_train_state(
        GPT2, TINY_GPT2, mesh, optim=OPTIM, total_steps=4, compute=Compute("float32", "none")
    )
    training = Training(OPTIM, learning_rate_schedule(OPTIM, 4), grad_accum, monitor_every=monitor_every)
    stepper = Stepper(graphdef, state, mesh, GPT2.forward, loss=loss, training=training)
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    spec = {k: jax.ShapeDtypeStruct(ids.shape, ids.dtype) for k in ("input_ids", "labels")}
    if monitor_every == 1:
        stepper.compiled_monitor = stepper.lower_train(state, spec, monitor=True).compile()
    else:
        stepper.compile_train(state, spec)
    return stepper, state, jax.device_put({k: ids for k in spec}, stepper.batch_shardings(spec))


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

    grads, logits = jax.grad(loss_of, has_aux=True)(params)
    return by_path(grads), np.asarray(logits, np.float64), by_path(params)


@pytest.fixture(scope="module")
def monitored_step():
    stepper, state, batch = stepper_and_state(monitor_every=2)
    state, plain = stepper.train_step(state, batch, 0)  # step 1: not a monitor step
    grads, logits, before = recomputed(stepper.graphdef, state, batch)
    state, metrics = stepper.train_step(state, batch, 1)  # step 2: a monitor step
    after = by_path(nnx.state(nnx.merge(stepper.graphdef, state)[0], nnx.Param))
    return jax.device_get(plain), jax.device_get(metrics), grads, logits, before, after


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


def test_monitors_are_the_same_under_accumulation_and_a_chunked_loss(monitored_step):
    metrics = monitored_step[1]
    stepper, state, batch = stepper_and_state(monitor_every=1, grad_accum=2, loss=Loss(loss_chunk=8))
    state, _ = stepper.train_step(state, batch, 0)
    _, other = stepper.train_step(state, batch, 1)
    other = jax.device_get(other)
    assert sorted(other) == sorted(metrics)
    for key in (k for k in metrics if k.startswith("monitor/")):
        np.testing.assert_allclose(other[key], metrics[key], rtol=1e-5, err_msg=key)


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


@pytest.mark.parametrize("flag,value", [("monitor_every", -1), ("monitor_warn_factor", 1.0)])
def test_bad_monitor_flags_are_refused(flag, value):
    with pytest.raises(ArgumentError, match=f"--{flag}"):
        ReportingArgs(**{flag: value})


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
        assert "loss" not in record  # a record of its own, beside the step's train record
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (out / "plots" / "monitors.png").stat().st_size > 0 and (out / "loss_curve.png").is_file()
