"""`--compile_for TOPOLOGY`: compile a run's train and eval steps for a TPU slice this machine does not have.

With libtpu installed (`pip install -e '.[tpu]'`), JAX describes the devices of any TPU slice by name
(`jax.experimental.topologies.get_topology_desc`, e.g. v3:2x2 = a v3-8, v5e:16x16 = a v5e-256) on a CPU-only
machine, and XLA compiles programs for them without running anything. This module builds the run's mesh over those
devices, its sharded state as shapes only (the shardings of the real initialiser), the objective's batch as shapes
(no data, no tokenizer file), compiles the real train step (dtype, remat, accumulation as the run would) and the eval
step, and reports per-device memory against the chip's HBM, FLOPs, a roofline MFU and compile times. Every number is
an estimate of XLA's compiler for that chip, not a measurement. Nothing is written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from spmdlm import devices
from spmdlm.data import pipeline
from spmdlm.data.batch_ramp import largest_stage
from spmdlm.data.objectives import Objective
from spmdlm.engine.state import DTYPES
from spmdlm.errors import ArgumentError, DoesNotFit
from spmdlm.families import objective_for_shapes
from spmdlm.mesh import MESH_AXES, batch_axis_size
from spmdlm.run_args import RunArgs
from spmdlm.train.compile_for import collectives
from spmdlm.train.stages.program import Model, setup_state
from spmdlm.train.stages.resolve import Run, resolve

GiB = 2**30


INSTALL_HINT = "pip install -e '.[tpu]'"


def use_cpu_backend() -> None:
    """This machine only compiles: its own accelerator, if any, is neither needed nor taken (unless JAX_PLATFORMS
    says otherwise). Before JAX initialises its backends."""
    if not os.environ.get("JAX_PLATFORMS", "").strip():
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")


def tpu_devices(topology: str, num_slices: int = 1) -> list:
    """The compile-only devices of `num_slices` slices of `topology` (e.g. 'v5e:16x16'), with one-line errors."""
    check_slice_name(topology)  # before libtpu: a user should not install it to learn that the name was wrong
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        raise ArgumentError(f"--compile_for needs libtpu, which is not installed: {INSTALL_HINT}")
    if num_slices < 1:
        raise ArgumentError(f"--num_slices must be at least 1, got {num_slices}")
    # Only compiled for, never run: another process may hold this machine's TPU (if any) and its lock file.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {"chip_config_name": "megacore"} if topology.lower().startswith("v4") else {}
    try:
        with _stderr_hidden():
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=num_slices, **kwargs)
    except Exception as e:  # libtpu's own message names the problem (unknown chip, shape not a slice)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArgumentError(
            f"--compile_for {topology}: {reason}; give a TPU slice as GENERATION:TOPOLOGY, {SLICE_EXAMPLES}"
        ) from None
    return list(desc.devices)


TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")
SLICE_EXAMPLES = "e.g. v3:2x2 (a v3-8), v4:2x2x4, v5e:16x16 (a v5e-256), v5p:4x4x4, v6e:8x8"


def check_slice_name(topology: str) -> None:
    """GENERATION:TOPOLOGY with a generation libtpu knows and 2 or 3 chip counts; libtpu judges the shape itself."""
    generation, _, shape = topology.partition(":")
    problem = None
    if generation.lower() not in TPU_GENERATIONS:
        problem = f"the TPU generation {generation!r} is not one of {', '.join(TPU_GENERATIONS)}"
    elif not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", shape):
        problem = f"the topology {shape!r} is not chips per dimension, as 2x2 or 2x2x4"
    if problem:
        raise ArgumentError(
            f"--compile_for {topology}: {problem}; give a TPU slice as GENERATION:TOPOLOGY, {SLICE_EXAMPLES}"
        )


@contextlib.contextmanager
def _stderr_hidden():
    """libtpu writes warnings about the TPU VM it is not running on (no TPU worker hostnames, accelerator type)
    straight to file descriptor 2 while it loads; they say nothing about compiling for a slice."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def per_device_bytes(state) -> int:
    """Bytes of one device's shards of an abstract sharded state (the fullest device)."""
    total = 0
    for leaf in jax.tree.leaves(state):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def global_bytes(state) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def estimate(args: RunArgs) -> dict[str, Any]:
    """Compile the run's train and eval steps for --compile_for x --num_slices; -> the numbers (estimates)."""
    slice_devices = tpu_devices(args.devices.compile_for, args.devices.num_slices)
    kind = slice_devices[0].device_kind
    chip = devices.chip(kind)
    run = resolve(args, time.perf_counter(), mesh_devices=slice_devices)
    objective = objective_for_shapes(run.family, run.config, flags=args.objective)
    start = time.perf_counter()
    model = setup_state(run, run.config, objective, 0, abstract=True)  # shapes and shardings, no arrays
    state, stepper = model.state, model.stepper
    init_seconds = time.perf_counter() - start
    mesh, stage = run.mesh, largest_stage(run.stages)  # a --batch_size_ramp's stage that needs the most memory
    hosts = len({d.process_index for d in slice_devices})
    eval_batch = args.control.per_device_eval_batch_size * batch_axis_size(mesh)
    result: dict[str, Any] = {
        "topology": args.devices.compile_for,
        "num_slices": args.devices.num_slices,
        "device_kind": kind,
        "chip": chip.name if chip else kind,
        "devices": len(slice_devices),
        "hosts": hosts,
        "devices_per_host": len(slice_devices) // hosts,
        "mesh": dict(mesh.shape),
        "mesh_spec": args.devices.mesh,
        "dcn_mesh": args.devices.dcn_mesh,
        "model_type": run.family.name,
        "config": run.config_source,
        "parameters": model.parameters,
        "dtype": args.model.dtype,
        "attention": run.attention,
        "remat": model.layer_plan.remat,
        "gradient_accumulation_steps": stage.accumulation,
        "global_batch": stage.global_batch,
        "per_host_batch": stage.global_batch // hosts,
        "per_device_batch": stage.per_device,
        "sequence_lengths": objective.sequence_lengths(),
        "eval_batch": eval_batch,
        "state_bytes_per_device": per_device_bytes(state),
        "state_bytes_replicated": global_bytes(state),
        "hbm_bytes_per_device": chip.hbm_bytes if chip else None,
        "peak_flops_per_device": chip.peak_flops if chip else None,
        "analytic_flops_per_step": run.family.train_flops_per_step(run.config, objective, stage.global_batch),
        "init_compile_seconds": init_seconds,
    }
    train_spec, eval_spec = (pipeline.batch_spec(objective, n) for n in (stage.global_batch, eval_batch))
    result["train"] = _compiled(lambda: stepper.lower_train(state, train_spec, grad_accum=stage.accumulation).compile())
    result["eval"] = (
        _compiled(lambda: stepper.lower_eval(state, eval_spec).compile())
        if args.control.evaluating and "error" not in result["train"]
        else None
    )
    result.update(roofline(result))
    result.update(collective_summary(run, objective, model, result["train"]))
    steps = [step for step in (result["train"], result["eval"]) if step]
    if any("error" in step for step in steps):
        result["fits"] = False  # XLA refused to compile it: more than the chip's HBM
    else:
        hbm = chip.hbm_bytes if chip else None
        result["fits"] = None if hbm is None else max(step["total_bytes"] for step in steps) <= hbm
    return result


def _compiled(compile_step) -> dict[str, Any]:
    """Memory and cost of `compile_step()`'s executable, or XLA's out-of-memory refusal as {'error': ...}."""
    start = time.perf_counter()
    try:
        compiled = compile_step()
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        if "Mosaic failed to compile" in text:  # a generation the kernel table (models/kernels.py) does not know
            reason = text.split("\n", 1)[0].split("Mosaic failed to compile TPU kernel: ", 1)[-1]
            raise ArgumentError(
                f"--compile_for: the TPU compiler rejected the fused attention kernel ({reason}); use --attention xla"
            ) from None
        if "RESOURCE_EXHAUSTED" not in text and "memory" not in text.lower():
            raise
        lines = [line.strip() for line in text.replace("RESOURCE_EXHAUSTED: ", "").splitlines() if line.strip()]
        return {"error": " ".join(lines[:3]).rstrip("."), "compile_seconds": time.perf_counter() - start}
    return {
        **devices.compiled_stats(compiled),
        "collectives": collectives.emitted(compiled.as_text()),
        "compile_seconds": time.perf_counter() - start,
    }


def collective_summary(run: Run, objective: Objective, model: Model, train: dict[str, Any]) -> dict[str, Any]:
    """The analytic minimum, and the kinds whose emitted bytes differ from it by over 10% (None: not compiled)."""
    minimum = minimum_collectives(run, objective, model)
    differ = sorted(collectives.differences(train["collectives"], minimum)) if "collectives" in train else None
    return {"collectives_minimum": minimum, "collectives_differ": differ}


def minimum_collectives(run: Run, objective: Objective, model: Model) -> dict[str, dict[str, int]]:
    """The analytic minimum of the train step's collectives on this mesh (spmdlm/train/compile_for/collectives.py)."""
    lengths = objective.sequence_lengths()
    return collectives.analytic_minimum(
        collectives.model_parameters(model.graphdef, model.state),
        dict(run.mesh.shape),
        remat=model.layer_plan.remat,
        compute_dtype=DTYPES[run.args.model.dtype],
        batch_per_device=largest_stage(run.stages).per_device,
        lengths=lengths,
        head_length=objective.label_capacity or lengths.get("decoder", lengths["input"]),
        accumulation=largest_stage(run.stages).accumulation,
    )


def roofline(r: dict[str, Any]) -> dict[str, Any]:
    """Seconds per train step if each device ran at its peak FLOP/s or its HBM bandwidth, whichever binds (or XLA's
    own cost_analysis 'optimal_seconds' when it gives one and it is longer), and the MFU that implies. An upper bound
    on speed: communication is not modelled, and XLA counts a scanned layer's FLOPs and bytes once, so the executed
    FLOPs are taken as the larger of XLA's count and the model's (x 4/3 with remat)."""
    chip = devices.chip(r["device_kind"])
    train = r["train"]
    per_device = r["analytic_flops_per_step"] / r["devices"]
    if chip is None or not per_device or "error" in train:
        return {"roofline_seconds": None, "roofline_bound": None, "projected_mfu": None}
    executed = max(train.get("xla_flops_per_device") or 0.0, per_device * (4 / 3 if r["remat"] == "full" else 1.0))
    compute = executed / r["peak_flops_per_device"]
    memory = (train.get("xla_bytes_accessed_per_device") or 0.0) / chip.hbm_bytes_per_s
    seconds, bound = max((compute, "compute at peak"), (memory, "HBM traffic at full bandwidth"))
    if (train.get("xla_optimal_seconds") or 0.0) > seconds:  # both are lower bounds on the step time
        seconds, bound = train["xla_optimal_seconds"], "XLA's optimal_seconds"
    return {
        "roofline_seconds": seconds,
        "roofline_bound": bound,
        "projected_mfu": per_device / (r["peak_flops_per_device"] * seconds),
    }


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= 0.1 * GiB else f"{b / 2**20:.1f} MiB"


def _duration(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def _step_memory(step: dict[str, Any], hbm: int | None) -> str:
    if "error" in step:
        return f"does not compile: XLA: {step['error']}"
    share = f" of {_size(hbm)} HBM ({100 * step['total_bytes'] / hbm:.0f}%)" if hbm else ""
    return (
        f"per device: arguments {_size(step['argument_bytes'])}, temporaries {_size(step['temp_bytes'])}, "
        f"total {_size(step['total_bytes'])}{share}"
    )


def report(r: dict[str, Any]) -> list[str]:
    """The estimate as lines for a terminal."""
    train, evaluation = r["train"], r["eval"]
    mesh = ", ".join(f"{a}={r['mesh'][a]}" for a in MESH_AXES)
    slices = f" x {r['num_slices']} slices" if r["num_slices"] > 1 else ""
    per_device = r["analytic_flops_per_step"] / r["devices"]
    lines = [
        f"spmdlm --compile_for {r['topology']}{slices}: ESTIMATES from XLA's compiler for {r['device_kind']}; "
        "nothing was run",
        f"  devices         {r['devices']} x {r['chip']} on {r['hosts']} host(s), {r['devices_per_host']} per host",
        f"  mesh            {mesh}"
        + (f" (across slices: {r['dcn_mesh'] or 'data=' + str(r['num_slices'])})" if r["num_slices"] > 1 else ""),
        f"  model           {r['model_type']} ({r['config']}): {r['parameters'] / 1e6:.1f}M parameters, "
        f"{r['dtype']}, attention {r['attention']}, remat {r['remat']}",
        f"  batch           global {r['global_batch']} x {' + '.join(map(str, r['sequence_lengths'].values()))} "
        f"tokens = {r['per_device_batch']} per device x {r['mesh']['data'] * r['mesh']['fsdp']} batch devices x "
        f"{r['gradient_accumulation_steps']} accumulation; {r['per_host_batch']} per host",
        f"  state           {_size(r['state_bytes_per_device'])} per device of parameters and optimizer state "
        f"({_size(r['state_bytes_replicated'])} in all)",
        f"  train step      {_step_memory(train, r['hbm_bytes_per_device'])}",
    ]
    if evaluation:
        lines.append(
            f"  eval step       {_step_memory(evaluation, r['hbm_bytes_per_device'])} (batch {r['eval_batch']})"
        )
    xla = train.get("xla_flops_per_device")
    lines.append(
        f"  FLOPs/step      model {r['analytic_flops_per_step']:.3g} ({per_device:.3g} per device)"
        + (f"; XLA {xla:.3g} per device (it counts a scanned layer once)" if xla else "")
    )
    if r.get("roofline_seconds"):
        lines.append(
            f"  roofline        {_duration(r['roofline_seconds'])}/step (bound: {r['roofline_bound']}; "
            f"{r['peak_flops_per_device'] / 1e12:.1f} TFLOP/s bf16 peak per device; communication not "
            f"modelled) -> MFU at most {100 * r['projected_mfu']:.0f}%"
        )
    lines.append(
        f"  compile         train step {train['compile_seconds']:.1f} s"
        + (f", eval step {evaluation['compile_seconds']:.1f} s" if evaluation else "")
        + f", state {r['init_compile_seconds']:.1f} s (on this machine)"
    )
    lines += collective_lines(r)
    if r["fits"] is not None:
        use = max((step.get("total_bytes", 0) for step in (train, evaluation) if step), default=0)
        tight = r["fits"] and use > 0.9 * r["hbm_bytes_per_device"]
        lines.append(
            f"  fits in HBM     {'yes' if r['fits'] else 'NO'}"
            + (" (less than 10% to spare for the runtime: a smaller micro-batch is safer)" if tight else "")
        )
    return lines


def collective_lines(r: dict[str, Any]) -> list[str]:
    """The train step's collectives per device, emitted against the analytic minimum, and where they differ."""
    emitted, minimum = r["train"].get("collectives"), r.get("collectives_minimum")
    if not emitted or not minimum:
        return []
    lines = ["  collectives     train step, per device: emitted by XLA | analytic minimum for the mesh (docs/tpu.md)"]
    off = collectives.differences(emitted, minimum)
    for kind in collectives.KINDS:
        got, want = emitted[kind], minimum[kind]
        if not (got["count"] or want["count"]):
            continue
        note = ""
        if kind in off:
            note = "  <- none expected" if off[kind] == float("inf") else f"  <- {100 * off[kind]:+.0f}% (over 10%)"
        lines.append(
            f"    {kind:<15}{got['count']:>6} x, {_size(got['bytes']):>10} | {want['count']:>6} x, "
            f"{_size(want['bytes']):>10}{note}"
        )
    permutes = emitted.get(collectives.PERMUTE)
    if permutes and permutes["count"]:
        lines.append(
            f"    {collectives.PERMUTE:<15}{permutes['count']:>6} x, {_size(permutes['bytes']):>10} | not modelled: "
            "rings that carry all-gathers or reduce-scatters within the matmuls"
        )
    return lines


def refusal(r: dict[str, Any], args: RunArgs) -> str:
    """One line: which step does not fit, by how much, and what to change."""
    hbm = r["hbm_bytes_per_device"]
    train, evaluation = r["train"], r["eval"]
    too_big = lambda step: bool(step) and ("error" in step or step["total_bytes"] > hbm)
    name, step = ("train", train) if too_big(train) else ("eval", evaluation)
    if "error" in step:
        numbers = f"XLA: {step['error']}"
    else:
        numbers = (
            f"{_size(step['total_bytes'])} per device (arguments {_size(step['argument_bytes'])}, "
            f"temporaries {_size(step['temp_bytes'])}) but a {r['chip']} device has {_size(hbm)} of HBM"
        )
    tries = []
    if name == "eval":
        tries.append(f"a smaller --per_device_eval_batch_size (now {args.control.per_device_eval_batch_size})")
    else:
        if r["remat"] != "full":
            tries.append("--gradient_checkpointing")
        if r["mesh"]["fsdp"] == 1:
            tries.append(
                "fsdp (e.g. --mesh data=N,fsdp=M) to shard the parameters and optimizer state "
                f"({_size(r['state_bytes_per_device'])} per device now)"
            )
        tries.append(
            f"a smaller --per_device_train_batch_size (now {r['per_device_batch']}), with "
            "--gradient_accumulation_steps to keep the global batch"
        )
        if args.model.dtype != "bfloat16":
            tries.append("--dtype bfloat16")
    return (
        f"estimate: the {name} step does not fit in HBM on {r['topology']} (--mesh {r['mesh_spec']}): {numbers}; "
        f"try {', '.join(tries)}"
    )


def run_compile_for(args: RunArgs) -> dict[str, Any]:
    """The --compile_for command: print the estimate (and one JSON line), refuse a step that does not fit."""
    r = estimate(args)
    print("\n".join(report(r)), flush=True)
    print("estimate-json: " + json.dumps(r, default=float), flush=True)
    if r["fits"] is False:
        raise DoesNotFit(refusal(r, args))
    return r
