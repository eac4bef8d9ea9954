"""The parameters' exponential moving average (--ema_decay) and checkpoint averaging (spmdlm.export --average_last):
the average against a NumPy one of the recorded trajectory, sharded as the parameters, resumed bitwise, evaluated
as eval_ema_*, exported (loads in transformers, its logits ours); the mean of checkpoints against NumPy's."""

import json
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from conftest import STDLIB_JSON, read_metrics, run_killed_after_first_checkpoint
from flax import nnx
from safetensors.numpy import load_file

from spmdlm import checkpoint, load
from spmdlm.cli.export import main as export_main
from spmdlm.engine.optim import ema_params, keep_average, learning_rate_schedule, skip_spikes
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Stepper, Training
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family, load_config
from spmdlm.launch import main
from spmdlm.mesh import make_mesh
from spmdlm.run_args.sections import OptimizationArgs

GPT2 = get_family("gpt2")
TINY_GPT2 = load_config("gpt2-tiny", "gpt2").replace(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
DECAY, STEPS = 0.8, 5


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.as_pure(tree))}


def stepper_and_state(optim: OptimizationArgs, mesh_spec: str = "data=2", steps: int = STEPS):
    mesh = make_mesh(mesh_spec, jax.devices()[: 2 if mesh_spec == "data=2" else 4])
    graphdef, state = build_train_state(
        GPT2, TINY_GPT2, mesh, optim=optim, total_steps=steps, compute=Compute("float32", "none")
    )
    training = Training(optim=optim, schedule=learning_rate_schedule(optim, steps))
    stepper = Stepper(graphdef, state, mesh, GPT2.forward, training=training)
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    spec = {k: jax.ShapeDtypeStruct(ids.shape, ids.dtype) for k in ("input_ids", "labels")}
    batch = jax.device_put({k: ids for k in spec}, stepper.batch_shardings(spec))
    stepper.compile_train(state, spec)
    return stepper, state, batch


def params_of(state) -> dict:
    return flat(state[0])


def average_of(graphdef, state):
    """The average in a train state (its optimizer merged: the state's own tree flattens the NamedTuples)."""
    return ema_params(nnx.merge(graphdef, state)[1].opt_state)


@pytest.mark.slow
def test_average_equals_numpy_ema_of_the_parameter_trajectory():
    optim = OptimizationArgs(learning_rate=1e-2, optim="adamw", ema_decay=DECAY, ema_start=1)
    stepper, state, batch = stepper_and_state(optim)
    trajectory = [params_of(state)]
    averages = []
    for step in range(STEPS):
        state, _ = stepper.train_step(state, batch, step)
        trajectory.append(params_of(state))
        averages.append(flat(average_of(stepper.graphdef, state)))
    expected = {k: v.astype(np.float64) for k, v in trajectory[1].items()}  # up to --ema_start: the parameters
    np.testing.assert_array_equal(averages[0][next(iter(expected))], trajectory[1][next(iter(expected))])
    for params, got in zip(trajectory[2:], averages[1:]):
        expected = {k: DECAY * expected[k] + (1 - DECAY) * params[k] for k in expected}
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=key)
    assert any(not np.allclose(trajectory[-1][k], averages[-1][k], atol=1e-4) for k in expected)  # it lags


@pytest.mark.slow
def test_average_is_sharded_like_the_parameters():
    optim = OptimizationArgs(optim="adamw", ema_decay=0.99)
    mesh = make_mesh("data=2,fsdp=2", jax.devices()[:4])
    graphdef, state = build_train_state(GPT2, TINY_GPT2, mesh, optim=optim, abstract=True)
    params = flat_leaves(state[0])
    average = flat_leaves(average_of(graphdef, state))
    assert any("fsdp" in str(v.sharding.spec) for v in params.values())
    assert average.keys() == params.keys()
    for key, leaf in average.items():
        assert leaf.sharding.spec == params[key].sharding.spec, key
        assert leaf.dtype == jnp.float32


def flat_leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(nnx.as_pure(tree))}


@pytest.mark.slow
def test_resumed_average_equals_the_uninterrupted_one_bitwise(tmp_path):
    optim = OptimizationArgs(learning_rate=1e-2, optim="adamw", ema_decay=DECAY)
    stepper, state, batch = stepper_and_state(optim)

    def steps(state, start, stop):
        for step in range(start, stop):
            state, _ = stepper.train_step(state, batch, step)
        return state

    whole = steps(jax.tree.map(jnp.copy, state), 0, STEPS)
    first = steps(state, 0, 2)
    manager = checkpoint.make_manager(str(tmp_path), async_save=False)
    checkpoint.save(manager, 2, first, iter(grain.MapDataset.range(4).to_iter_dataset()), {})
    manager.wait_until_finished()
    restored, _ = checkpoint.restore(manager, 2, checkpoint.abstract_of(first))
    checkpoint.close(manager)
    resumed = steps(restored, 2, STEPS)
    expected, got = flat(average_of(stepper.graphdef, whole)), flat(average_of(stepper.graphdef, resumed))
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_decay_outside_zero_one_is_refused(decay):
    with pytest.raises(ArgumentError, match="--ema_decay"):
        OptimizationArgs(ema_decay=decay)


def test_schedule_free_refuses_an_average():
    with pytest.raises(ArgumentError, match="--ema_decay with --optim schedule_free_adamw"):
        OptimizationArgs(optim="schedule_free_adamw", ema_decay=0.9).check()


# -- a run with --ema_decay: evaluated, exported, averaged -------------------------------------------------------------
def launch_ema_run(out: Path, config: Path, cache_dir: Path, *extra: str) -> int:
    return main(
        [
            *("--train_file", STDLIB_JSON, "--config_name", str(config), "--output_dir", str(out)),
            *("--cache_dir", str(cache_dir), "--block_size", "32", "--global_batch_size", "16", "--mesh", "data=8"),
            *("--max_steps", "6", "--save_steps", "2", "--eval_steps", "3", "--logging_steps", "3"),
            *("--learning_rate", "3e-3", "--max_eval_samples", "16", "--per_device_eval_batch_size", "2"),
            *("--ema_decay", "0.5", "--ema_start", "1", "--seed", "3", *extra),
        ]
    )


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, tiny_gpt2_config, cache_dir) -> Path:
    out = tmp_path_factory.mktemp("ema") / "run"
    assert launch_ema_run(out, tiny_gpt2_config, cache_dir) == 0
    return out


@pytest.mark.slow
def test_the_average_is_evaluated_beside_the_parameters_and_the_card_says_which_is_exported(ema_run):
    evals = [m for m in read_metrics(ema_run) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [3, 6]
    for m in evals:
        assert {"eval_ema_loss", "eval_ema_perplexity", "eval_ema_accuracy"} <= m.keys()
        assert m["eval_ema_loss"] != m["eval_loss"]
    results = json.loads((ema_run / "eval_results.json").read_text())
    assert results["eval_ema_loss"] == pytest.approx(evals[-1]["eval_ema_loss"])
    card = (ema_run / "hf" / "README.md").read_text()
    assert "weights: the trained parameters (raw); their moving average (--ema_decay 0.5 from step 1" in card


def our_logits(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(GPT2.forward(model, {"input_ids": jnp.asarray(ids)}))


@pytest.mark.slow
def test_the_average_exports_and_its_logits_in_transformers_are_ours(ema_run, tmp_path):
    mesh = make_mesh("data=-1")
    assert export_main(["--checkpoint", str(ema_run), "--out", str(tmp_path / "ema"), "--weights", "ema"]) == 0
    ours, _, _, steps, what = load.load_weights(ema_run, None, mesh, load.Weights("ema"))
    raw = load.load_run(ema_run, None, mesh)[0]
    assert steps == [6] and "moving average" in what
    assert (
        "moving average of the parameters (--ema_decay 0.5) of the checkpoint at step 6"
        in (tmp_path / "ema" / "README.md").read_text()
    )
    ids = np.random.default_rng(0).integers(0, 512, (2, 32))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ema").eval()
    with torch.no_grad():
        logits = theirs(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits, our_logits(ours, ids), rtol=0, atol=1e-4)
    assert np.max(np.abs(logits - our_logits(raw, ids))) > 1e-3  # the average, not the parameters


def model_params(model) -> dict:
    return flat(nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_three_checkpoints_average_to_their_numpy_mean_and_the_card_names_them(ema_run, tmp_path):
    mesh = make_mesh("data=-1")
    each = [model_params(load.load_run(ema_run, step, mesh)[0]) for step in (2, 4, 6)]
    mean, _, _, steps, _ = load.load_weights(ema_run, None, mesh, load.Weights(average_last=3))
    assert steps == [2, 4, 6]
    got = model_params(mean)
    assert got.keys() == each[0].keys()
    for key in got:
        expected = np.mean([params[key].astype(np.float64) for params in each], axis=0)
        np.testing.assert_allclose(got[key], expected, rtol=0, atol=1e-6, err_msg=key)
    assert export_main(["--checkpoint", str(ema_run), "--out", str(tmp_path / "mean"), "--average_steps", "2,4,6"]) == 0
    card = (tmp_path / "mean" / "README.md").read_text()
    assert "the mean of the parameters of the 3 checkpoints at steps 2, 4, 6" in card
    exported = load_file(tmp_path / "mean" / "model.safetensors")["transformer.wte.weight"]
    np.testing.assert_allclose(exported, next(v for k, v in got.items() if "wte" in k), rtol=0, atol=0)


def test_averaging_refuses_steps_the_run_did_not_save(ema_run, tmp_path, capsys):
    assert export_main(["--checkpoint", str(ema_run), "--out", str(tmp_path / "x"), "--average_steps", "2,5"]) == 2
    assert "--average_steps: no checkpoint at step 5" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(ema_run), "--out", str(tmp_path / "y"), "--average_last", "9"]) == 2
    assert "--average_last 9: the run has 3 checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_run_resumes_its_average_bitwise_and_keeps_its_decay(
    ema_run, tmp_path, monkeypatch, tiny_gpt2_config, cache_dir, capsys
):
    killed = tmp_path / "killed"
    run_killed_after_first_checkpoint(monkeypatch, lambda: launch_ema_run(killed, tiny_gpt2_config, cache_dir))
    assert [p.name for p in (killed / "checkpoints").iterdir() if p.name.isdigit()] == ["2"]
    assert launch_ema_run(killed, tiny_gpt2_config, cache_dir, "--ema_decay", "0.6") != 0
    assert "ema_decay/ema_start" in capsys.readouterr().err
    assert launch_ema_run(killed, tiny_gpt2_config, cache_dir) == 0
    mesh = make_mesh("data=-1")
    average = lambda run: model_params(load.load_weights(run, 6, mesh, load.Weights("ema"))[0])
    expected, got = average(ema_run), average(killed)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    for steps, error in (("2", "give two steps or more"), ("2,x", "separated by commas")):
        assert export_main(["--checkpoint", str(ema_run), "--out", str(tmp_path / "z"), "--average_steps", steps]) == 2
        assert error in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "xyz")


def test_a_skipped_step_leaves_the_average_as_it_was():
    tx = skip_spikes(keep_average(optax.sgd(0.1), DECAY, 0), z=3.0, window=16)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(lambda g, s, loss: tx.update(g, s, params, loss=loss))
    _, skipped = update({"w": jnp.ones(3)}, state, jnp.nan)
    np.testing.assert_array_equal(skipped.inner.average["w"], np.ones(3))
    assert int(skipped.inner.count) == 0 and int(skipped.skipped) == 1
    _, taken = update({"w": jnp.ones(3)}, state, 2.0)  # params 1 - 0.1 = 0.9: the average 0.8 x 1 + 0.2 x 0.9
    np.testing.assert_allclose(taken.inner.average["w"], np.full(3, 0.98), rtol=1e-6)
    assert int(taken.inner.count) == 1
