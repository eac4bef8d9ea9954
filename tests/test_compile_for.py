"""--compile_for: the real train and eval steps compiled for a TPU slice this machine does not have (libtpu), and
the multi-slice mesh (a CPU-only machine behaves the same with libtpu installed: test_errors)."""

import importlib.util
import json

import numpy as np
import pytest

from spmdlm.families import all_presets
from spmdlm.launch import main
from spmdlm.mesh import MeshError, make_mesh

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU,
    reason="libtpu is not installed (pip install -e '.[tpu]'; it is "
    "not in the test extra: 213 MB download, 684 MB installed)",
)


def compile_for(capsys, tmp_path, config, *flags) -> tuple[int, dict | None, str]:
    code = main(["--config_name", str(config), "--block_size", "32", "--output_dir", str(tmp_path / "out"), *flags])
    captured = capsys.readouterr()
    line = next((x for x in captured.out.splitlines() if x.startswith("estimate-json: ")), None)
    return code, json.loads(line.split(": ", 1)[1]) if line else None, captured.out + captured.err


@needs_libtpu
def test_gpt2_tiny_for_a_v5e_2x2_reports_memory_and_flops(capsys, tmp_path, tiny_gpt2_config):
    code, r, text = compile_for(
        capsys,
        tmp_path,
        tiny_gpt2_config,
        "--compile_for",
        "v5e:2x2",
        "--mesh",
        "data=2,fsdp=2",
        "--per_device_train_batch_size",
        "4",
        "--dtype",
        "bfloat16",
    )
    assert code == 0, text
    assert r["devices"] == 4 and r["hosts"] == 1 and r["chip"] == "v5e" and r["fits"] is True
    assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1} and r["global_batch"] == 16 and r["per_host_batch"] == 16
    for step in ("train", "eval"):
        assert r[step]["argument_bytes"] > 0 and r[step]["total_bytes"] > 0 and r[step]["xla_flops_per_device"] > 0
    assert r["analytic_flops_per_step"] > 0 and 0 < r["projected_mfu"] <= 1
    assert r["state_bytes_per_device"] < r["state_bytes_replicated"]  # fsdp shards the weight matrices
    assert "ESTIMATES" in text and "train step      per device: arguments" in text and "FLOPs/step" in text
    assert not (tmp_path / "out").exists()  # nothing written
    # fsdp's parameter all-gathers as the analytic model counts them (each layer's again in the backward pass)
    emitted, minimum = r["train"]["collectives"], r["collectives_minimum"]
    assert minimum["all-gather"]["bytes"] > 0 and minimum["all-to-all"] == {"count": 0, "bytes": 0}
    assert abs(emitted["all-gather"]["bytes"] / minimum["all-gather"]["bytes"] - 1) <= 0.1
    assert "all-gather" not in r["collectives_differ"]
    assert "collectives     train step, per device: emitted by XLA | analytic minimum" in text
    assert "    all-gather " in text


@needs_libtpu
def test_gpt2_124m_bf16_compiles_for_a_v3_8_with_the_einsums(capsys, tmp_path):
    """TPU v3's compiler cannot build the splash kernel's bfloat16 matmuls: auto keeps the einsums, splash is refused
    in one line (the recipes' reference hardware)."""
    code, r, text = compile_for(
        capsys,
        tmp_path,
        "gpt2",
        "--compile_for",
        "v3:2x2",
        "--dtype",
        "bfloat16",
        "--per_device_train_batch_size",
        "4",
        "--do_eval",
        "false",
    )
    assert code == 0, text
    assert r["chip"].startswith("v3") and r["parameters"] > 124e6 and r["attention"] == "xla" and r["fits"] is True
    assert "auto = xla, not splash: the TPU compiler (Mosaic) cannot build" in text and "Traceback" not in text
    code, r, text = compile_for(
        capsys, tmp_path, "gpt2", "--compile_for", "v3:2x2", "--dtype", "bfloat16", "--attention", "splash"
    )
    assert code == 2 and r is None and "Traceback" not in text
    assert text.strip().splitlines()[-1] == (
        "error: --attention splash: the TPU compiler (Mosaic) cannot build the "
        "splash kernel's bfloat16 matmuls for TPU v3: use --attention auto or "
        "xla, or --dtype float32"
    )


@needs_libtpu
def test_the_splash_kernel_compiles_in_bf16_for_a_v5e(capsys, tmp_path):
    code, r, text = compile_for(
        capsys,
        tmp_path,
        "gpt2-tiny",
        "--compile_for",
        "v5e:2x2",
        "--block_size",
        "128",
        "--dtype",
        "bfloat16",
        "--do_eval",
        "false",
    )
    assert code == 0, text
    assert r["attention"] == "splash" and r["train"]["total_bytes"] > 0


@needs_libtpu
def test_a_step_that_cannot_fit_is_refused_with_the_numbers(capsys, tmp_path, tiny_gpt2_config):
    code, r, text = compile_for(
        capsys,
        tmp_path,
        tiny_gpt2_config,
        "--compile_for",
        "v5e:2x2",
        "--mesh",
        "data=4",
        "--per_device_train_batch_size",
        "131072",
        "--do_eval",
        "false",
    )
    assert code == 2 and r["fits"] is False
    error = text.strip().splitlines()[-1]
    assert error.startswith("error: estimate: the train step does not fit in HBM on v5e:2x2")
    assert "G" in error and "fsdp" in error and "131072" in error
    assert ("--gradient_checkpointing" in error) == (r["remat"] != "full")  # the layer plan may have chosen it


@needs_libtpu
def test_two_slices_make_a_hybrid_mesh_with_the_slices_outside():
    from spmdlm.train.compile_for.aot import tpu_devices

    devices = tpu_devices("v5e:4x4", 2)
    mesh = make_mesh("data=4,fsdp=8", devices)  # DCN defaults to data=2
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert mesh.devices.shape == (4, 8, 1)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # the slice is the outer part of data
    mesh = make_mesh("data=2,fsdp=16", devices, dcn_spec="fsdp=2")
    assert (np.vectorize(lambda d: d.slice_index)(mesh.devices)[:, :8] == 0).all()
    with pytest.raises(MeshError, match="tensor parallelism across slices"):
        make_mesh("data=2,tensor=16", devices, dcn_spec="tensor=2")
    with pytest.raises(MeshError, match="does not divide --mesh data=1"):
        make_mesh("fsdp=32", devices, dcn_spec="data=2")
    with pytest.raises(MeshError, match="one slice"):
        make_mesh("data=8", dcn_spec="data=2")  # this machine's 8 CPU devices


def test_without_libtpu_the_flag_says_how_to_get_it(monkeypatch):
    from spmdlm.errors import ArgumentError
    from spmdlm.train.compile_for import aot

    monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(ArgumentError, match=r"pip install -e '\.\[tpu\]'"):
        aot.tpu_devices("v5e:2x2")


# A compiled module as XLA prints it: an all-gather repeated in an async start and done fusion (one channel), a
# reduce-scatter and a ring permute in a 12-trip layer loop, a combined all-reduce, and a conditional whose costlier
# branch counts.
HLO = """HloModule jit_train_fn, entry_computation_layout={(f32[16]{0})->f32[16]{0}}

%fused_start (param_0: bf16[2,4]) -> bf16[8,4] {
  %param_0 = bf16[2,4]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.1 = bf16[8,4]{1,0:T(8,128)(2,1)S(1)} all-gather(%param_0), channel_id=7, replica_groups=[1,4]<=[4]
}

%fused_done (param_0: bf16[2,4]) -> bf16[8,4] {
  %param_0 = bf16[2,4]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[8,4]{1,0} all-gather(%param_0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %x = bf16[2,4]{1,0} get-tuple-element(%p), index=2
  %g = f32[64]{0} get-tuple-element(%p), index=1
  %start = bf16[8,4]{1,0} fusion(%x), kind=kCustom, calls=%fused_start
  %done = bf16[8,4]{1,0} fusion(%start), kind=kCustom, calls=%fused_done
  %rs = f32[16]{0} reduce-scatter(%g), channel_id=8, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %cp = (bf16[2,4]{1,0}, bf16[2,4]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=13
  ROOT %t = (s32[], f32[64]) tuple(%i, %g)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  %gte = s32[] get-tuple-element(%p), index=0
  %constant.3 = s32[]{:T(128)} constant(12)
  ROOT %lt = pred[] compare(%gte, %constant.3), direction=LT
}

%small (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %ar.1 = f32[4]{0} all-reduce(%a), channel_id=10, replica_groups={{0,1}}, to_apply=%add
}

%large (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %ar.2 = f32[256]{0} all-reduce(%b), channel_id=11, replica_groups={{0,1}}, to_apply=%add
  ROOT %ar.3 = f32[256]{0} all-reduce(%ar.2), channel_id=12, replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (a: f32[16], b: bf16[8]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  %b = bf16[8]{0} parameter(1)
  %w = (s32[], f32[64]) while(%init), condition=%cond, body=%body
  %ar = (f32[16]{0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %c = f32[4]{0} conditional(%p, %a, %a), branch_computations={%small, %large}
}
"""


def test_the_collectives_of_a_compiled_module_are_counted_once_per_execution():
    from spmdlm.train.compile_for.collectives import differences, emitted

    counted = emitted(HLO)
    assert counted == {
        "all-gather": {"count": 12, "bytes": 12 * 8 * 4 * 2},  # one per loop trip, bf16
        "reduce-scatter": {"count": 12, "bytes": 12 * 64 * 4},  # its operand: the buffer it reduces
        "all-reduce": {"count": 1 + 2, "bytes": 16 * 4 + 8 * 2 + 2 * 256 * 4},
        "all-to-all": {"count": 0, "bytes": 0},
        "collective-permute": {"count": 12, "bytes": 12 * 2 * 4 * 2},  # what it sends
    }
    minimum = {kind: dict(value) for kind, value in counted.items()}
    minimum["all-gather"]["bytes"] = int(counted["all-gather"]["bytes"] / 1.05)  # within 10%
    minimum["reduce-scatter"]["bytes"] = counted["reduce-scatter"]["bytes"] * 2  # half of it emitted
    minimum["all-reduce"]["bytes"] = 0  # none expected
    assert differences(counted, minimum) == {"reduce-scatter": -0.5, "all-reduce": float("inf")}


@needs_libtpu
@pytest.mark.parametrize(
    "config,length,overrides,mesh",
    [
        # grouped key/value heads (8 for 32), Llama 3's RoPE scaling. Replicated (data=4) its 13.8 GiB of state
        # leave no room: the train step asked for 23.1 GiB of a v5e's 15.75 (measured); fsdp shards the state.
        ("llama-3.2-1b", 4096, {}, ("--mesh", "fsdp=4", "--gradient_checkpointing")),
        (
            "qwen3-tiny",
            512,
            {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1, "max_position_embeddings": 512},
            ("--mesh", "data=4"),
        ),
    ],
    ids=["llama-1b-4x4096", "qwen3-window"],
)
def test_llama_and_qwen3_compile_for_a_v5e_with_splash(capsys, tmp_path, config, length, overrides, mesh):
    """Issue 51: the Llama-1B preset at 4 x 4096 with the splash kernel; Qwen3's sliding window as splash's
    LocalMask."""
    if overrides:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**all_presets()[config], **overrides}))
        config = str(path)
    code, r, text = compile_for(
        capsys,
        tmp_path,
        config,
        "--compile_for",
        "v5e:2x2",
        *mesh,
        "--per_device_train_batch_size",
        "1",
        "--block_size",
        str(length),
        "--dtype",
        "bfloat16",
        "--attention",
        "splash",
        "--do_eval",
        "false",
    )
    assert code == 0, text
    assert r["attention"] == "splash" and r["train"]["total_bytes"] > 0 and r["global_batch"] == 4
