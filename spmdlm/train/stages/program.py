"""The state stage: the sharded model and optimizer state (spmdlm/engine/state.py), its steps
(spmdlm/engine/evaluation.py make_stepper) and the layer plan they run, as one frozen `Model`; then the train step
compiled, and refused before anything is written when it cannot fit (the memory gate).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm import devices, hf_export
from spmdlm.data import pipeline
from spmdlm.data.batch_ramp import largest_stage
from spmdlm.data.objectives import Objective
from spmdlm.engine.evaluation import byte_lengths, loss_of, make_stepper
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.engine.plan import LayerPlan, plan_layers
from spmdlm.engine.state import DTYPES, Compute, build_train_state, count_parameters
from spmdlm.engine.step import Stepper, Training
from spmdlm.errors import ArgumentError, RunError
from spmdlm.mesh import batch_axis_size, idle_axes
from spmdlm.train.reporting.report import Reporter
from spmdlm.train.stages.resolve import Run

log = logging.getLogger("spmdlm")


@dataclasses.dataclass(frozen=True)
class Model:
    """The model's graph, its sharded train state as built (abstract when a checkpoint fills it), the compiled steps
    around them, and --remat and --scan_unroll as resolved (`layer_plan`)."""

    graphdef: Any
    state: Any
    stepper: Stepper
    layer_plan: LayerPlan
    parameters: int


def setup_state(run: Run, config, objective: Objective, total_steps: int, *, tokenizer=None, abstract: bool) -> Model:
    """`abstract`: shapes and shardings only, nothing allocated — the target a resume restores into (a fresh init
    would be a second copy) and all that compiling for another machine needs. A fresh state from
    --model_name_or_path gets that checkpoint's weights. `tokenizer`: for bits per byte (None: --compile_for)."""
    args = run.args
    # the schedule counts final-batch steps with a ramp, and continues a resumed run whose length changed
    optim, steps = args.optimization, run.schedule_length(max(total_steps, 1))
    layer_plan = choose_layer_plan(run, config, objective)
    graphdef, state = build_train_state(
        run.family,
        config,
        run.mesh,
        optim=optim,
        total_steps=steps,
        seed=args.control.seed,
        compute=Compute(args.model.dtype, layer_plan.remat, layer_plan.scan_unroll, run.attention),
        abstract=abstract,
    )
    check_mesh_use(state, run)
    if args.model.model_name_or_path and not abstract:
        state = hf_export.load_hf_into_state(args.model.model_name_or_path, graphdef, state, run.checkpoint_config)
    schedule = learning_rate_schedule(optim, steps)
    training = Training(optim, schedule, run.stages[0].accumulation, args.control.seed, args.reporting.monitor_every)
    stepper = make_stepper(
        graphdef,
        state,
        run.mesh,
        run.family.forward,
        loss_of(objective, optim),
        byte_lengths(tokenizer, config.vocab_size),
        training,
    )
    return Model(graphdef, state, stepper, layer_plan, count_parameters(graphdef, state))


def check_mesh_use(state, run: Run) -> None:
    """A tensor axis that shards nothing only replicates the work; an idle fsdp axis is plain data parallelism."""
    idle = idle_axes(state, run.mesh)
    if "tensor" in idle:
        raise ArgumentError(
            f"--mesh {run.args.devices.mesh}: the tensor axis ({run.mesh.shape['tensor']}) divides none of the "
            "model's sharded dimensions (heads x head size, MLP width, vocabulary), so it would only repeat the same "
            "work; use a tensor size that divides them, or give those devices to data/fsdp"
        )
    if "fsdp" in idle:
        log.warning(
            "--mesh %s: the fsdp axis (%d) divides no parameter dimension, so parameters are replicated "
            "(plain data parallelism)",
            run.args.devices.mesh,
            run.mesh.shape["fsdp"],
        )


def choose_layer_plan(run: Run, config, objective: Objective) -> LayerPlan:
    """--remat and --scan_unroll for this run (spmdlm/engine/plan.py), each `auto` one said in a line."""
    args, mesh = run.args, run.mesh
    device = mesh.devices.flat[0]
    lengths = objective.sequence_lengths()
    model = nnx.eval_shape(lambda: run.family.make_model(config, rngs=nnx.Rngs(0)))
    plan = plan_layers(
        args.optimization.remat,
        args.optimization.scan_unroll,
        model,
        platform=device.platform,
        itemsize=jnp.dtype(DTYPES[args.model.dtype]).itemsize,
        tokens_per_device=run.per_device_batch * sum(lengths.values()),
        memory_bytes=devices.memory_per_device(device),
    )
    for flag, why in plan.reasons.items():
        log.info("--%s auto = %s", flag, why)
    return plan


def log_model(run: Run, model: Model, total_steps: int) -> None:
    """The run's shape in one line."""
    stage = run.stages[-1]
    log.info(
        "model %s (config %s): %.2fM parameters | mesh %s | global batch %d (%d per device x %d batch devices "
        "x %d accumulation)%s | %d steps",
        run.family.name,
        run.config_source,
        model.parameters / 1e6,
        dict(run.mesh.shape),
        stage.global_batch,
        stage.per_device,
        batch_axis_size(run.mesh),
        stage.accumulation,
        f" at the end of --batch_size_ramp {run.ramp.spec()}" if run.ramp.ramps else "",
        total_steps,
    )


def compile_step(model: Model, objective: Objective, run: Run, reporter: Reporter) -> dict[str, Any]:
    """The train step compiled and refused before anything is written when it cannot fit (the output dir is left
    as it was): a batch-size ramp's largest stage (`largest_stage`); the others compile as they start."""
    stage = largest_stage(run.stages)
    with reporter.goodput.span("compile"):
        stats = model.stepper.compile_train(
            model.state, pipeline.batch_spec(objective, stage.global_batch), stage.accumulation
        )
    check_memory(stats, stage.per_device)
    reporter.compile_stats(stats)
    return stats


def check_memory(stats: dict[str, Any], per_device_batch: int) -> None:
    """Refuse a step that cannot fit before running it: an out-of-memory crash (or the kernel's OOM killer) later
    says nothing about what to change."""
    need = stats.get("total_bytes", 0)
    capacity, what = devices.device_memory_bytes()
    if what == "host":  # CPU devices share the RAM this process may still use, not the host's total
        capacity, what = devices.host_memory()
    local = jax.local_device_count()
    if not capacity or need * (1 if what == "device" else local) <= capacity:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    shared = (
        f"the device's {gib(capacity)}"
        if what == "device"
        else f"{gib(capacity)} of {what} shared by {local} CPU devices"
    )
    raise RunError(
        f"the train step needs {gib(need)} per device (arguments {gib(stats.get('argument_bytes', 0))}, temporaries "
        f"{gib(stats.get('temp_bytes', 0))}) but has {shared}; try a smaller --per_device_train_batch_size (now "
        f"{per_device_batch}) or sequence length, "
        "--gradient_checkpointing, fsdp (--mesh fsdp=N), --dtype bfloat16, or a smaller --config_name"
    )
