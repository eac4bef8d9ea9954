"""Training-step throughput of one spmdlm model on a synthetic batch of its objective's real shapes.

    python benchmarks/bench_train.py --model gpt2 --config gpt2-tiny --mesh data=1 --steps 10
    python benchmarks/bench_train.py --model gpt2 --config benchmarks/gpt2-d768-l4.json --seq_len 256 \
        --batch_size 4 --steps 4 --warmup 1 --compare attention=dot_product --compare jit=nnx

Prints ONE JSON line: tokens/s (median/min/max over the measured steps), step and compile time, peak host RSS,
per-device memory of the compiled step, analytic and XLA FLOPs per step, MFU against the device's peak (measured
with a large matmul on CPU), versions, device kind and the settings.

`--compare KEY=VALUE[,KEY=VALUE]` (repeatable) adds variants of the base settings — `jit` (jax | flat | nnx),
`attention` (the model's option: xla | dot_product | cudnn), `donate` (1 | 0), `xla` (XLA compiler options,
`name:value;name:value`). All variants are built up front and their steps are interleaved round-robin in the same
process, so a machine shared with other work slows them alike; the JSON gains `variants` with each one's numbers
and its speed relative to the base. Everything goes through spmdlm's public surface: `build_train_state`,
`Stepper.lower_train` (compiler options, donation), `Stepper.train_fn`, `devices.compiled_stats`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from spmdlm.models.attention import IMPLEMENTATIONS as ATTENTIONS

# Importing jax starts no backend: the device flags (prepare_devices) are read when the first one starts.
from spmdlm.models.stack import REMAT_POLICIES


def _families():
    from spmdlm.families import families

    return families()


def default_config(model: str) -> str:
    """The family's tiny preset (gpt2-tiny, roberta-tiny, t5-v1_1-tiny, bart-tiny)."""
    return _families()[model].quickstart["config_name"]


def parse_args(argv=None, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model family: " + " | ".join(_families()))
    p.add_argument("--config", help="preset name in models/, a JSON file or an HF config dir (default: tiny preset)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (HF name), e.g. --set n_layer=4; repeatable",
    )
    p.add_argument("--mesh", default="data=-1", help="e.g. data=1, data=8, fsdp=-1 (CPU devices are simulated)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--batch_size", type=int, default=8, help="examples per batch-axis device")
    p.add_argument("--seq_len", type=int, help="sequence (encoder) length (default: the model's, at most 512)")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (after compilation)")
    p.add_argument(
        "--jit",
        default="jax",
        choices=("jax", "flat", "nnx"),
        help="jax: Stepper's jax.jit over the split state; flat: jax.jit over a flat list of arrays; "
        "nnx: nnx.jit over (model, optimizer)",
    )
    p.add_argument(
        "--attention",
        default="xla",
        choices=ATTENTIONS,
        help="the model's attention option: xla = einsums; dot_product = jax.nn.dot_product_attention; "
        "cudnn = its cuDNN kernel (NVIDIA GPUs)",
    )
    p.add_argument("--no_donate", dest="donate", action="store_false", help="do not donate the state to the step")
    p.add_argument("--xla", default="", help="XLA compiler options for the step, 'name:value;name:value'")
    p.add_argument(
        "--remat",
        default="auto",
        choices=("auto", *REMAT_POLICIES),
        help="what each layer keeps for its backward pass, as the launcher's flag (auto: its choice)",
    )
    p.add_argument("--loss_chunk_size", type=int, default=0, help="as the launcher's flag (0 = off)")
    p.add_argument(
        "--all_positions",
        dest="labelled_only",
        action="store_false",
        help="the LM head on every position even where the objective labels few (MLM)",
    )
    p.add_argument(
        "--scan_unroll",
        default="auto",
        help="layers per iteration of the layer scan, as the launcher's flag; 0 = fully unrolled; per_layer = "
        "unrolled, each layer owning its parameter arrays; auto = the launcher's choice",
    )
    p.add_argument("--unroll", dest="scan_unroll", action="store_const", const="0", help="= --scan_unroll 0")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="KEY=VALUE[,...]",
        help="a variant to measure against the base settings in the same run; repeatable",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after the measured steps, trace 3 more steps of the base "
        "variant into DIR and write DIR/report.json: time per XLA op and per op category (op_profile.py)",
    )
    p.add_argument("--profile_label", default="spmdlm", help="the report's column title")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="as the launcher's (0 = no clipping, as the HF Flax scripts)"
    )
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the synthetic batch and init seed")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def fail(message: str, code: int = 2):
    print(f"{os.path.basename(sys.argv[0])}: {message}", file=sys.stderr)
    sys.exit(code)


def prepare_devices(mesh_spec: str):
    """Simulate CPU devices when the mesh asks for more than one; must run before JAX initialises its backends."""
    from spmdlm.mesh import requested_device_count, simulate_cpu_devices

    count = requested_device_count(mesh_spec)
    if count and count > 1:
        simulate_cpu_devices(count)


# -- model, objective, batch ---------------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def load_model_config(args):
    from spmdlm.families import load_config

    if args.model not in _families():
        fail(f"--model {args.model!r} is not a model family; choose one of {', '.join(_families())}")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            fail(f"--set {item!r}: write KEY=VALUE")
        overrides[key.strip()] = _parse_value(value.strip())
    try:
        config = load_config(args.config or default_config(args.model), args.model)
        return config.replace(**overrides) if overrides else config
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError; TypeError: --set of an unknown field
        fail(f"--config/--set: {e}")


def build_objective(model: str, config, seq_len: int | None):
    """The family's objective at `seq_len` (default: the model's length, at most 512)."""
    from spmdlm.families import objective_for_shapes

    try:
        return objective_for_shapes(_families()[model], config, seq_len or min(config.max_length, 512))
    except ValueError as e:  # ArgumentError and the objectives' own checks
        fail(f"--seq_len: {e}")


def synthetic_batch(objective, global_batch: int, vocab_size: int, seed: int) -> dict:
    """The objective applied to records of random ids (from a fixed numpy seed): a batch of its exact shapes and
    label density (MLM labels ~15% of positions, as in training)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    records = rng.integers(8, vocab_size, (global_batch, objective.record_length)).astype(np.int32)
    examples = [objective(record, np.random.default_rng([seed, i])) for i, record in enumerate(records)]
    return {name: np.stack([e[name] for e in examples]) for name in examples[0]}


def tokens_per_example(objective) -> int:
    """Input tokens of one example (encoder + decoder inputs), as the run's reporter counts them."""
    return sum(objective.sequence_lengths().values())


# -- variants ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    jit: str = "jax"
    attention: str = "xla"
    donate: bool = True
    xla: str = ""
    unroll: str = "auto"  # --scan_unroll: layers per scan iteration, 0 = fully unrolled, per_layer = own arrays
    loss_chunk: int = 0  # --loss_chunk_size
    labelled_only: bool = True  # the LM head on labelled positions only where the objective allows (MLM)
    remat: str = "auto"  # --remat: auto or one of REMAT_POLICIES
    clip: float = 1.0  # --max_grad_norm (0 = no clipping, as the HF Flax scripts)

    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())

    def compiler_options(self) -> dict[str, Any]:
        options = {}
        for item in filter(None, (s.strip() for s in self.xla.split(";"))):
            name, sep, value = item.partition(":")
            if not sep:
                fail(f"xla option {item!r}: write name:value")
            low = value.strip().lower()
            options[name.strip()] = True if low == "true" else False if low == "false" else _parse_value(value)
        return options


def parse_variant(text: str, base: Variant) -> Variant:
    changes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in (
            "jit",
            "attention",
            "donate",
            "xla",
            "unroll",
            "loss_chunk",
            "labelled_only",
            "remat",
            "clip",
        ):
            fail(
                f"--compare {text!r}: use jit=, attention=, donate=, xla=, unroll=, loss_chunk=, labelled_only=, "
                "remat= or clip= (comma-separated)"
            )
        flag = key in ("donate", "labelled_only")
        if key == "unroll":  # unroll=true is full unrolling, unroll=N N layers per iteration
            value = "0" if value.strip().lower() in ("true", "yes") else value
        parse = {"loss_chunk": int, "clip": float}.get(key, str.strip)
        changes[key] = value.strip() not in ("0", "false", "no") if flag else parse(value)
    variant = dataclasses.replace(base, **changes)
    if (
        variant.jit not in ("jax", "flat", "nnx")
        or variant.attention not in ATTENTIONS
        or variant.remat not in ("auto", *REMAT_POLICIES)
    ):
        fail(
            f"--compare {text!r}: jit is jax|flat|nnx, attention {'|'.join(ATTENTIONS)}, "
            f"remat {'|'.join(('auto', *REMAT_POLICIES))}"
        )
    if variant.jit == "nnx" and variant.xla:
        fail("xla compiler options need jit=jax or jit=flat")
    return variant


class Arm:
    """One variant: its own state (same init), its compiled step, its timings."""

    def __init__(
        self,
        variant: Variant,
        build,
        forward,
        mesh,
        batch_spec,
        batch,
        schedule,
        seed: int,
        label_capacity: int | None = None,
    ):
        import jax

        from spmdlm.engine.state import count_parameters
        from spmdlm.engine.step import Loss, Stepper, Training

        self.variant, self.mesh, self.forward, self.times = variant, mesh, forward, []
        self.losses: list[float] = []
        graphdef, state = build(variant)
        self.n_params = count_parameters(graphdef, state)
        self.stepper = Stepper(
            graphdef,
            state,
            mesh,
            forward,
            loss=Loss(loss_chunk=variant.loss_chunk, label_capacity=label_capacity if variant.labelled_only else None),
            training=Training(schedule=schedule, dropout_seed=seed),
        )
        self.stats: dict[str, Any] = {}
        start = time.perf_counter()
        if variant.jit == "nnx":
            self._setup_nnx(graphdef, state, batch)
        elif variant.jit == "jax" and variant.donate and not variant.xla:
            self.stats = self.stepper.compile_train(state, batch_spec)  # exactly the training run's path
            self.compiled = self.stepper.compiled_train
            self.state = state
            self._call = lambda batch, step: self.stepper.train_step(self.state, batch, step)
        else:
            self._setup_jax(state, batch_spec, flat=variant.jit == "flat")
        self.stats.setdefault("compile_seconds", time.perf_counter() - start)
        self.step_number = getattr(self, "first_step", 0)
        self._jax = jax

    def _setup_jax(self, state, batch_spec, flat: bool):
        import jax
        import jax.numpy as jnp

        from spmdlm.checkpoint import abstract_of
        from spmdlm.devices import compiled_stats

        st = self.stepper
        options = self.variant.compiler_options() or None
        start = time.perf_counter()
        if flat:  # jax.jit over a flat list of arrays: no pytree of Variables to walk per call
            leaves, treedef = jax.tree.flatten(state)
            shardings = [x.sharding for x in leaves]

            def fn(leaves, batch, step):
                new_state, metrics = st.train_fn(jax.tree.unflatten(treedef, leaves), batch, step)
                return jax.tree.leaves(new_state), metrics

            jitted = jax.jit(
                fn,
                in_shardings=(shardings, st.batch_shardings(batch_spec), st.replicated),
                out_shardings=(shardings, st.replicated),
                donate_argnums=0 if self.variant.donate else (),
                compiler_options=options,
            )
            state_arg = leaves
            with jax.set_mesh(self.mesh):
                compiled = jitted.lower(abstract_of(leaves), batch_spec, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        else:
            state_arg = state
            compiled = st.lower_train(state, batch_spec, donate=self.variant.donate, compiler_options=options).compile()
        self.stats = {"compile_seconds": time.perf_counter() - start, **compiled_stats(compiled)}
        self.compiled = compiled
        self.state = state_arg

        def call(batch, step):
            with jax.set_mesh(self.mesh):
                return compiled(self.state, batch, jnp.int32(step))

        self._call = call

    def _setup_nnx(self, graphdef, state, batch):
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        from spmdlm.engine.step import loss_sums

        model, optimizer = nnx.merge(graphdef, state)
        base_key = self.stepper.dropout_key

        def train_step(model, optimizer, batch, step):  # Stepper._train_step's math (no accumulation)
            def loss_fn(model):
                rngs = nnx.Rngs(dropout=jax.random.fold_in(jax.random.fold_in(base_key, step), 0))
                sums = loss_sums(model, batch, self.forward, rngs, loss=self.stepper.loss)
                return sums["loss_sum"] + sums["z_loss_sum"], sums

            grads, sums = nnx.grad(loss_fn, has_aux=True)(model)
            grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
            optimizer.update(model, grads)
            return dict(sums, grad_norm=optax.global_norm(grads))

        step_fn = nnx.jit(train_step, donate_argnums=(0, 1) if self.variant.donate else None)
        self.state = (model, optimizer)

        def call(batch, step):
            # The objects are updated in place; block on the metrics, which the one executable produces with them.
            with jax.set_mesh(self.mesh):
                return None, step_fn(model, optimizer, batch, jnp.int32(step))

        self._call = call
        # nnx.jit traces and compiles on its first call: a first step here, counted as compilation.
        start = time.perf_counter()
        metrics = jax.device_get(self._call(batch, 0)[1])
        self.stats = {"compile_seconds": time.perf_counter() - start, "compile_includes_one_step": True}
        self.losses.append(float(metrics["loss_sum"]) / max(float(metrics["tokens"]), 1.0))
        self.first_step = 1

    def step(self, batch, measure: bool):
        jax = self._jax
        start = time.perf_counter()
        new_state, metrics = self._call(batch, self.step_number)
        jax.block_until_ready((new_state, metrics))
        elapsed = time.perf_counter() - start
        if new_state is not None:
            self.state = new_state
        self.step_number += 1
        if measure:
            self.times.append(elapsed)
        metrics = jax.device_get(metrics)
        self.losses.append(float(metrics["loss_sum"]) / max(float(metrics["tokens"]), 1.0))


def profile_arm(arm: Arm, batch, trace_dir: str, label: str, steps: int = 3) -> None:
    """Trace `steps` more steps of `arm`; write the per-op report to trace_dir/report.json and print it."""
    import op_profile

    if getattr(arm, "compiled", None) is None:
        fail("--profile needs --jit jax or flat (nnx.jit hides the compiled program)")
    op_profile.trace_steps(lambda: arm.step(batch, measure=False), steps, trace_dir)
    report = op_profile.report(trace_dir, arm.compiled.as_text(), steps, label)
    with open(os.path.join(trace_dir, "step.hlo.txt"), "w") as f:
        f.write(arm.compiled.as_text())
    with open(os.path.join(trace_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    op_profile.print_reports([report], out=sys.stderr)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- the benchmark -------------------------------------------------------------------------------------------------
def run_benchmark(args) -> dict[str, Any]:
    """Build, compile and time every variant; -> the result record (what the JSON line shows)."""
    prepare_devices(args.mesh)
    config = load_model_config(args)
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import spmdlm
    from spmdlm import devices, flops
    from spmdlm.data.pipeline import batch_spec, to_global
    from spmdlm.engine.optim import learning_rate_schedule
    from spmdlm.engine.plan import LayerPlan, plan_layers
    from spmdlm.engine.state import DTYPES, Compute, build_train_state
    from spmdlm.mesh import MeshError, batch_axis_size, make_mesh
    from spmdlm.run_args.sections import OptimizationArgs

    try:
        mesh = make_mesh(args.mesh)
    except MeshError as e:
        fail(str(e))
    device = jax.devices()[0]
    load_start = os.getloadavg()[0]  # the host's other work skews CPU numbers: record it
    # The CPU reference first, on an idle process (cached; ~1 s).
    peak = devices.peak_flops_per_device(args.dtype)
    host_peak = devices.measure_cpu_matmul_flops(args.dtype) if device.platform == "cpu" else None

    objective = build_objective(args.model, config, args.seq_len)
    global_batch = args.batch_size * batch_axis_size(mesh)
    spec = batch_spec(objective, global_batch)
    host_batch = synthetic_batch(objective, global_batch, config.vocab_size, args.seed)
    batch = to_global(host_batch, mesh)
    total_steps = args.warmup + args.steps
    optim = OptimizationArgs(
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm
    )
    schedule = learning_rate_schedule(optim, total_steps)
    family = _families()[config.model_type]

    abstract_model = nnx.eval_shape(lambda: family.make_model(config, rngs=nnx.Rngs(0)))

    def plan(variant: Variant) -> LayerPlan:  # auto as the launcher resolves it (spmdlm/engine/plan.py)
        return plan_layers(
            variant.remat,
            variant.unroll,
            abstract_model,
            platform=device.platform,
            itemsize=jnp.dtype(DTYPES[args.dtype]).itemsize,
            tokens_per_device=args.batch_size * tokens_per_example(objective),
            memory_bytes=devices.memory_per_device(device),
        )

    def build(variant: Variant):
        layers = plan(variant)
        return build_train_state(
            family,
            config,
            mesh,
            optim=dataclasses.replace(optim, max_grad_norm=variant.clip),
            total_steps=total_steps,
            seed=args.seed,
            compute=Compute(args.dtype, layers.remat, layers.scan_unroll, variant.attention),
        )

    base = Variant(
        jit=args.jit,
        attention=args.attention,
        donate=args.donate,
        xla=args.xla,
        unroll=args.scan_unroll,
        loss_chunk=args.loss_chunk_size,
        labelled_only=args.labelled_only,
        remat=args.remat,
        clip=args.max_grad_norm,
    )
    variants = [base] + [parse_variant(text, base) for text in args.compare]
    if base.jit == "nnx" and base.xla:
        fail("--xla needs --jit jax or flat")
    capacity = objective.label_capacity
    arms = [Arm(v, build, family.forward, mesh, spec, batch, schedule, args.seed, capacity) for v in variants]
    for arm in arms:
        for _ in range(max(args.warmup - arm.step_number, 0)):  # nnx.jit's compile call was a first step
            arm.step(batch, measure=False)
    for _ in range(args.steps):  # round-robin: load from other processes hits every variant alike
        for arm in arms:
            arm.step(batch, measure=True)

    if args.profile:
        profile_arm(arms[0], batch, args.profile, args.profile_label)
    analytic = family.train_flops_per_step(config, objective, global_batch)
    tokens_per_step = global_batch * tokens_per_example(objective)

    def arm_record(arm: Arm) -> dict[str, Any]:
        step_time = summary(arm.times)
        xla_per_device = arm.stats.get("xla_flops_per_device")
        memory = {
            k: arm.stats[k] for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes") if k in arm.stats
        }
        return {
            "variant": arm.variant.label(),
            "layer_plan": plan(arm.variant).record(),
            "tokens_per_s": {
                "median": tokens_per_step / step_time["median"],
                "min": tokens_per_step / step_time["max"],
                "max": tokens_per_step / step_time["min"],
            },
            "step_time_s": step_time,
            "compile_s": arm.stats.get("compile_seconds"),
            "memory_per_device_bytes": memory or None,
            "flops_per_step_xla": xla_per_device * mesh.size if xla_per_device else None,
            "mfu": flops.mfu(analytic, step_time["median"], mesh.size, peak) if analytic else None,
            "loss_first": arm.losses[0],
            "loss_last": arm.losses[-1],
        }

    records = [arm_record(arm) for arm in arms]
    result = {
        "model": args.model,
        "config": args.config or default_config(args.model),
        "overrides": args.set,
        **records[0],
        "flops_per_step_analytic": analytic,
        "peak_flops_per_device": peak,
        "host_matmul_flops_measured": host_peak,
        "parameters": arms[0].n_params,
        "tokens_per_step": tokens_per_step,
        "global_batch": global_batch,
        "lengths": {k: shape[0] for k, (shape, _) in objective.example_spec().items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device_memory": device_memory(device),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "host": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        },  # spmdlm/host.py: huge-page malloc
        "versions": {
            "jax": jax.__version__,
            "flax": flax.__version__,
            "spmdlm": spmdlm.__version__,
            "numpy": np.__version__,
        },
        "settings": {k: v for k, v in vars(args).items()},
    }
    if len(records) > 1:
        base_rate = records[0]["tokens_per_s"]["median"]
        for record in records[1:]:
            record["speed_vs_base"] = record["tokens_per_s"]["median"] / base_rate
        result["variants"] = records[1:]
    result["_arms"] = arms  # for compare_hf.py; dropped before printing
    return result


def device_memory(device) -> dict[str, int] | None:
    """An accelerator's allocator figures (peak bytes in use, the limit); None on CPU, which keeps none."""
    try:
        stats = device.memory_stats() or {}
    except Exception:
        return None
    keep = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}
    return keep or None


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None):
    if argv is None:  # the allocator the launcher runs with (spmdlm/host.py)
        from spmdlm import host

        host.restart_with_huge_page_malloc()
    args = parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        fail("--steps must be >= 1, --warmup >= 0 and --batch_size >= 1")
    result = run_benchmark(args)
    result.pop("_arms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
