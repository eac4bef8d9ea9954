"""Loss spikes (--skip_step_on_spike) and checkpoint cadence (--save_every_minutes, --keep_every_n_steps)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import read_metrics, run_argv

from spmdlm import checkpoint
from spmdlm.data import pipeline
from spmdlm.engine.optim import SPIKE_HISTORY, SpikeState, skip_spikes
from spmdlm.launch import main


def run(out: Path, config: Path, cache_dir: Path, *extra: str) -> int:
    flags = dict(block_size=32, per_device_train_batch_size=2, mesh="data=8", learning_rate="3e-3", warmup_steps=2)
    flags |= dict(logging_steps=1, do_train=True, export_hf=False, seed=7)
    return main(run_argv(out, config, cache_dir, *extra, **flags))


# -- the transform ---------------------------------------------------------------------------------------------------
def test_a_spike_changes_nothing_and_a_normal_step_goes_through():
    tx = skip_spikes(optax.sgd(0.1, momentum=0.9), z=3.0, window=16)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(lambda g, s, loss: tx.update(g, s, params, loss=loss))
    rng = np.random.default_rng(0)
    for _ in range(SPIKE_HISTORY):  # the window fills before anything is judged
        _, state = update({"w": jnp.asarray(rng.normal(1.0, 0.1, 3))}, state, 2.0 + 0.01 * rng.normal())
    assert int(state.accepted) == SPIKE_HISTORY and int(state.skipped) == 0

    for grads, loss in (({"w": jnp.ones(3)}, 9.0), ({"w": 50.0 * jnp.ones(3)}, 2.0), ({"w": jnp.ones(3)}, jnp.nan)):
        updates, after = update(grads, state, loss)  # a high loss, a high gradient norm, a loss that is not finite
        assert not np.asarray(updates["w"]).any()
        for old, new in zip(jax.tree.leaves(state.inner), jax.tree.leaves(after.inner)):  # momentum untouched
            np.testing.assert_array_equal(old, new)
        np.testing.assert_array_equal(after.losses, state.losses)
        assert int(after.skipped) == int(state.skipped) + 1 and int(after.consecutive) == int(state.consecutive) + 1
        state = after

    updates, state = update({"w": jnp.ones(3)}, state, 2.0)
    assert np.asarray(updates["w"]).all() and int(state.consecutive) == 0 and int(state.skipped) == 3
    assert isinstance(state, SpikeState) and int(state.accepted) == SPIKE_HISTORY + 1


# -- through the launcher --------------------------------------------------------------------------------------------
@pytest.fixture
def corrupt_train_batches(monkeypatch):
    """Make the train batches numbered `steps` (1-based) garbage: every label one token, which the model finds
    unlikely, so the loss and the gradient jump."""

    def corrupting(steps):
        calls = {"n": 0}
        real = pipeline.to_global

        def to_global(batch, mesh):
            if "labels" in batch:
                calls["n"] += 1
                if calls["n"] in steps:
                    batch = {**batch, "labels": np.full_like(batch["labels"], 511)}
            return real(batch, mesh)

        monkeypatch.setattr(pipeline, "to_global", to_global)

    return corrupting


@pytest.mark.slow
def test_a_corrupted_batch_is_skipped_and_the_run_goes_on(
    tmp_path, tiny_gpt2_config, cache_dir, capsys, corrupt_train_batches
):
    corrupt_train_batches({14})  # after the window's SPIKE_HISTORY steps
    assert (
        run(
            tmp_path / "spiky",
            tiny_gpt2_config,
            cache_dir,
            "--max_steps",
            "16",
            "--save_steps",
            "8",
            "--skip_step_on_spike",
            "4",
        )
        == 0
    )
    said = [line.split("WARNING ")[1] for line in capsys.readouterr().out.splitlines() if "loss spikes" in line]
    assert said == ["1 step up to step 14 skipped as loss spikes (their updates not applied); 1 in all"]
    logged = read_metrics(tmp_path / "spiky")
    assert [m["skipped_steps"] for m in logged if "loss" in m] == [0] * 13 + [1] * 3  # counted in metrics.jsonl
    assert all(np.isfinite(m["loss"]) for m in logged if "loss" in m)
    assert checkpoint.make_manager(tmp_path / "spiky", read_only=True).all_steps()[-1] == 16


@pytest.mark.slow
def test_consecutive_spikes_stop_the_run_as_a_divergence(
    tmp_path, tiny_gpt2_config, cache_dir, capsys, corrupt_train_batches
):
    corrupt_train_batches(set(range(13, 20)))
    code = run(
        tmp_path / "diverging",
        tiny_gpt2_config,
        cache_dir,
        "--max_steps",
        "20",
        "--save_steps",
        "12",
        "--skip_step_on_spike",
        "4",
        "--max_consecutive_skips",
        "3",
    )
    assert code == 3
    assert "3 steps in a row were skipped as loss spikes" in capsys.readouterr().err
    # the checkpoint before the spikes is kept; nothing after them was saved
    assert checkpoint.make_manager(tmp_path / "diverging", read_only=True).all_steps() == [12]


@pytest.mark.slow
def test_checkpoints_every_few_seconds_and_every_nth_kept(tmp_path, tiny_gpt2_config, cache_dir):
    out = tmp_path / "cadence"
    assert (
        run(
            out,
            tiny_gpt2_config,
            cache_dir,
            "--max_steps",
            "8",
            "--save_steps",
            "1000",
            "--save_every_minutes",
            "0.0001",
            "--save_total_limit",
            "2",
            "--keep_every_n_steps",
            "3",
        )
        == 0
    )
    # saved at every step (the minutes pass between steps); the latest two and the multiples of 3 stay
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [3, 6, 7, 8]
