"""The parameters' exponential moving average (--ema_decay) and checkpoint averaging (spmdlm.export --average_last):
the average against a NumPy one of the recorded trajectory, sharded as the parameters, resumed bitwise, evaluated
as eval_ema_*, exported (loads in transformers, its logits ours); the mean of checkpoints against NumPy's."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdlm import checkpoint
from spmdlm.engine.optim import ema_params, learning_rate_schedule
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Stepper, Training
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family, load_config
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
