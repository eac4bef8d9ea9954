"""--attention: which implementation a run gets on each platform, the fallbacks with their reasons, and the
refusals. The numerics of every implementation that runs on the CPU are in test_families."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from jax._src import hardware_utils

from spmdlm import devices
from spmdlm.launch import main
from spmdlm.models import attention, kernels
from spmdlm.models.attention import AttentionMask, make_attention_mask
from spmdlm.models.layers import add_broadcast

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
    "platform, dtype, training, dropout, biased, expected, note",
    [
        ("cpu", BF16, True, 0.0, False, "xla", None),
        ("gpu", BF16, True, 0.0, False, "cudnn", None),
        ("gpu", BF16, True, 0.0, True, "cudnn", None),  # cuDNN takes T5's bias, and its gradient
        ("gpu", F32, True, 0.0, False, "xla", "needs --dtype bfloat16"),
        ("gpu", BF16, True, 0.1, False, "xla", "attention dropout is 0.1"),
        ("gpu", BF16, False, 0.1, False, "cudnn", None),  # evaluation only: no dropout
        ("tpu", F32, True, 0.0, False, "splash", None),
        ("tpu", BF16, True, 0.0, True, "splash", "relative-position bias keeps xla"),
        ("tpu", BF16, True, 0.1, True, "xla", "attention dropout is 0.1"),
    ],
)
def test_auto_picks_the_platforms_kernel_where_it_applies(platform, dtype, training, dropout, biased, expected, note):
    chosen, said = attention.resolve(
        "auto", platform=platform, dtype=dtype, training=training, dropout=dropout, biased=biased
    )
    assert chosen == expected
    assert (said is None) if note is None else (note in said)


@pytest.mark.parametrize(
    "requested, platform, dtype, dropout, message",
    [
        ("cudnn", "cpu", BF16, 0.0, "needs an NVIDIA GPU with CUDA JAX (pip install -e '.[cuda]')"),
        ("splash", "gpu", BF16, 0.0, "needs a TPU"),
        ("cudnn", "gpu", F32, 0.0, "add --dtype bfloat16"),
        ("cudnn", "gpu", BF16, 0.1, "attention dropout is 0.1"),
        ("dot_product", "cpu", F32, 0.1, "attention dropout is 0.1"),
        ("flash", "cpu", F32, 0.0, "choose one of auto, xla, dot_product, cudnn, splash"),
    ],
)
def test_an_explicit_choice_that_cannot_run_is_refused_with_the_fix(requested, platform, dtype, dropout, message):
    with pytest.raises(ValueError) as raised:
        attention.resolve(requested, platform=platform, dtype=dtype, training=True, dropout=dropout, biased=False)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "device_kind, dtype, expected",
    [
        ("TPU v3", BF16, "xla"),
        ("TPU v2", BF16, "xla"),
        ("TPU v3", F32, "splash"),
        ("TPU v4", BF16, "splash"),
        ("TPU v5 lite", BF16, "splash"),
    ],
)
def test_auto_keeps_the_einsums_where_the_tpu_compiler_rejects_the_kernel(device_kind, dtype, expected):
    kw = dict(training=True, dropout=0.0, biased=False, device_kind=device_kind)
    chosen, said = attention.resolve("auto", platform="tpu", dtype=dtype, **kw)
    assert chosen == expected
    assert (said is None) if expected == "splash" else (f"splash kernel's bfloat16 matmuls for {device_kind}" in said)
    if expected == "xla":
        with pytest.raises(ValueError, match="use --attention auto or xla, or --dtype float32"):
            attention.resolve("splash", platform="tpu", dtype=dtype, **kw)


def test_explicit_choices_that_can_run_are_kept():
    kw = dict(training=True, dropout=0.0, biased=False)
    assert attention.resolve("xla", platform="tpu", dtype=BF16, **{**kw, "dropout": 0.1}) == ("xla", None)
    assert attention.resolve("cudnn", platform="gpu", dtype=BF16, **kw) == ("cudnn", None)
    assert attention.resolve("splash", platform="tpu", dtype=F32, **kw) == ("splash", None)
    assert attention.resolve("dot_product", platform="cpu", dtype=F32, **kw) == ("dot_product", None)


def qkv(length=128, dtype=F32):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (2, length, 2, 8), dtype) for k in keys]


@pytest.mark.parametrize(
    "implementation, call, reason",
    [
        ("splash", dict(bias=jnp.zeros((1, 2, 128, 128))), "takes no additive bias"),
        ("splash", dict(length=96), "not multiples of the kernel's 128-wide blocks"),
        ("cudnn", dict(), "takes bfloat16/float16, not float32"),
        ("cudnn", dict(mask=AttentionMask(dense=jnp.ones((2, 1, 128, 128), bool))), "an explicit mask"),
    ],
)
def test_a_call_a_kernel_cannot_take_falls_back_to_the_einsums_once_said(implementation, call, reason, caplog):
    kernels._say_once.cache_clear()
    q, k, v = qkv(call.get("length", 128))
    with caplog.at_level(logging.INFO, logger="spmdlm.models.kernels"):
        for _ in range(2):
            assert (
                kernels.fused(
                    implementation, q, k, v, call.get("mask", make_attention_mask(causal=True)), call.get("bias"), 1.0
                )
                is None
            )
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and reason in said[0] and "xla einsums" in said[0]


def test_mask_parts_build_the_einsums_mask():
    valid = jnp.array([[1, 1, 0], [0, 1, 1]], bool)
    mask = make_attention_mask(valid, causal=True).array(3, 3)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert mask[1, 0].tolist() == [[False, False, False], [False, True, False], [False, True, True]]
    assert make_attention_mask().array(3, 3) is None


def test_the_launcher_refuses_a_kernel_this_machine_lacks_and_warns_of_an_unused_gpu(
    tmp_path, capsys, monkeypatch, caplog
):
    """One line and exit 2 before anything is written; a GPU that CPU-only JAX leaves idle is said, with the
    install command (JAX_PLATFORMS, which the tests set, is a choice and silences it)."""
    monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: True)
    monkeypatch.delenv("JAX_PLATFORMS")
    assert devices.unused_nvidia_gpu()
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        assert main(["--attention", "cudnn", "--output_dir", str(out), "--mesh", "data=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --attention cudnn: the cudnn kernel needs an NVIDIA GPU with CUDA JAX (pip install -e "
        "'.[cuda]'), and this run's devices are cpu; use --attention auto or xla"
    ]
    assert [r.getMessage() for r in caplog.records if "NVIDIA GPU" in r.getMessage()] == [
        "this machine has an NVIDIA GPU but JAX has only its CPU backend, so this run computes on the CPU; for the "
        "GPU: pip install -e '.[cuda]' (JAX with its CUDA plugin)"
    ]
    assert not out.exists()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not devices.unused_nvidia_gpu()


@pytest.mark.parametrize(
    "x_shape, y_shape",
    [
        ((4, 3, 5, 6), (1, 3, 5, 6)),  # T5's position bias over the batch
        ((4, 3, 5, 6), (1, 3, 1, 6)),  # two broadcast axes
        ((2, 7, 11), (11,)),  # a bias of lower rank: over batch and length
        ((4, 3, 5, 6), (4, 3, 5, 6)),  # nothing broadcast
    ],
)
def test_add_broadcast_has_the_plain_sums_gradients(x_shape, y_shape):
    x = jax.random.normal(jax.random.key(0), x_shape)
    y = jax.random.normal(jax.random.key(1), y_shape)
    ours = jax.grad(lambda a, b: jnp.sum(jnp.sin(add_broadcast(a, b))), (0, 1))(x, y)
    plain = jax.grad(lambda a, b: jnp.sum(jnp.sin(a + b)), (0, 1))(x, y)
    assert jnp.array_equal(add_broadcast(x, y), x + y)
    assert ours[1].shape == y_shape
    for a, b in zip(ours, plain):
        assert jnp.allclose(a, b, rtol=1e-6, atol=1e-6)
