"""Optimizer details the HF scripts got wrong: decay masked by parameter kind, Adafactor honouring weight decay."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spmdlm.engine.optim import learning_rate_schedule, make_optimizer
from spmdlm.engine.step import cross_entropy_sums
from spmdlm.models.layers import Dense, LayerNorm
from spmdlm.run_args.sections import OptimizationArgs


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.dense = Dense(4, 6, ("embed", "mlp"), rngs=rngs)
        self.norm = LayerNorm(6, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


@pytest.mark.parametrize("adafactor", [False, True])
def test_weight_decay_applies_to_matrices_only(adafactor):
    model = Tiny(nnx.Rngs(0))
    model.dense.bias[...] = jnp.ones(6)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    cfg = OptimizationArgs(learning_rate=0.1, weight_decay=0.5, adafactor=adafactor, lr_scheduler_type="constant")
    optimizer = nnx.Optimizer(model, make_optimizer(cfg, model, total_steps=10), wrt=nnx.Param)
    zero_grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    optimizer.update(model, zero_grads)  # no gradient: only weight decay can move a parameter
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    np.testing.assert_allclose(after["dense"]["kernel"], before["dense"]["kernel"] * (1 - 0.1 * 0.5), rtol=1e-6)
    for kind in (("dense", "bias"), ("norm", "scale"), ("norm", "bias")):
        np.testing.assert_array_equal(after[kind[0]][kind[1]], before[kind[0]][kind[1]])


def test_adam_epsilon_is_honoured():
    model = Tiny(nnx.Rngs(0))
    start = np.asarray(model.dense.kernel[...])
    moves = []
    for eps in (1e-8, 1.0):
        m = Tiny(nnx.Rngs(0))
        opt = nnx.Optimizer(
            m,
            make_optimizer(OptimizationArgs(learning_rate=0.1, adam_epsilon=eps, lr_scheduler_type="constant"), m, 10),
            wrt=nnx.Param,
        )
        # small gradients (~1e-3): eps 1 swamps them, eps 1e-8 does not
        grads = nnx.grad(lambda m: 1e-3 * (m(jnp.ones((2, 4))) * jnp.arange(6.0)).sum())(m)
        opt.update(m, grads)
        moves.append(float(np.abs(np.asarray(m.dense.kernel[...]) - start).max()))
    assert moves[1] < 0.5 * moves[0]


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
def test_schedules_warm_up_then_decay(kind):
    schedule = learning_rate_schedule(OptimizationArgs(learning_rate=1.0, warmup_steps=10, lr_scheduler_type=kind), 110)
    assert float(schedule(0)) == 0.0 and float(schedule(5)) == pytest.approx(0.5)
    assert float(schedule(10)) == pytest.approx(1.0)
    end = float(schedule(110))
    assert end == pytest.approx(1.0) if kind == "constant" else end == pytest.approx(0.0, abs=1e-6)


def test_z_loss_is_the_squared_log_partition():
    logits = jax.random.normal(jax.random.key(1), (2, 3, 7)) * 3
    labels = jnp.array([[1, 2, 3], [4, 5, -100]])
    sums = cross_entropy_sums(logits, labels, z_loss=1e-2)
    lse = jax.nn.logsumexp(logits, axis=-1)
    expected = 1e-2 * float(jnp.sum(jnp.square(lse) * (labels != -100)))
    assert float(sums["z_loss_sum"]) == pytest.approx(expected, rel=1e-6)
    assert float(cross_entropy_sums(logits, labels)["z_loss_sum"]) == 0.0


@pytest.mark.parametrize("scale", [0.1, 10.0])  # below the threshold (unchanged) and above it (clipped)
def test_clip_by_global_norm_matches_optax(scale):
    from spmdlm.engine.optim import clip_by_global_norm

    grads = {"a": jnp.arange(6.0).reshape(2, 3) * scale, "b": jnp.full((4,), -0.5) * scale}
    ours, ours_state = clip_by_global_norm(1.0).update(grads, clip_by_global_norm(1.0).init(grads))
    theirs, theirs_state = optax.clip_by_global_norm(1.0).update(grads, optax.clip_by_global_norm(1.0).init(grads))
    for key in grads:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6)
    if scale < 1:
        for key in grads:
            np.testing.assert_array_equal(ours[key], grads[key])
    else:
        np.testing.assert_allclose(float(optax.global_norm(ours)), 1.0, rtol=1e-6)
    # The same (empty) state as optax's: checkpoints written before keep their tree.
    assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
