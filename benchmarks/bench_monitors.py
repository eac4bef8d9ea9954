"""Step time with the stability monitors (--monitor_every) against without, on monitor steps and the others.

    python benchmarks/bench_monitors.py [--config gpt2-tiny] [--mesh data=8] [--batch 16] [--length 128]
        [--every 10] [--rounds 6]

One GPT-2 train state and batch; three ways of running `--every` steps, interleaved round by round (the host may be
shared, so each round of each way meets the same load), each round starting at the next way:
- plain: the train step alone (--monitor_every 0);
- variant: what the run does, the monitor variant compiled beside the plain step (Stepper.compiled_monitor) at every
  `--every`th step, its monitors fetched there, the plain program at the others;
- cond: one program choosing with lax.cond at every step (zeros for the monitors where none is due) — the
  alternative the variant was chosen over.
Each step is timed to its completion (block_until_ready). Prints one JSON line of medians (milliseconds), then a
markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--config", default="gpt2-tiny", help="a GPT-2 preset or config JSON")
    p.add_argument("--mesh", default="data=8", help="8 simulated devices on a CPU")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--every", type=int, default=10, help="--monitor_every")
    p.add_argument("--rounds", type=int, default=6, help="rounds of --every steps per way")
    return p.parse_args(argv)


def build(args):
    import jax
    import numpy as np

    from spmdlm.engine.optim import learning_rate_schedule
    from spmdlm.engine.state import Compute, build_train_state
    from spmdlm.engine.step import Stepper, Training
    from spmdlm.families import get_family, load_config
    from spmdlm.mesh import make_mesh
    from spmdlm.run_args.sections import OptimizationArgs

    family, mesh = get_family("gpt2"), make_mesh(args.mesh)
    config = load_config(args.config, "gpt2")
    optim = OptimizationArgs(learning_rate=1e-4, optim="adamw")
    steps = args.every * args.rounds * 3 + 2
    graphdef, state = build_train_state(family, config, mesh, optim=optim, total_steps=steps, compute=Compute())
    training = Training(optim, learning_rate_schedule(optim, steps), monitor_every=args.every)
    stepper = Stepper(graphdef, state, mesh, family.forward, training=training)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.length)).astype(np.int32)
    spec = {k: jax.ShapeDtypeStruct(ids.shape, ids.dtype) for k in ("input_ids", "labels")}
    stepper.compile_train(state, spec)
    batch = jax.device_put({k: ids for k in spec}, stepper.batch_shardings(spec))
    return stepper, state, batch, spec


def cond_step(stepper, spec, every: int):
    """One program: the monitor variant where `step` is due, else the plain step with zero monitors."""
    import jax
    import jax.numpy as jnp

    monitored = functools.partial(stepper.train_fn, monitor=True)

    def step_fn(state, batch, step):
        shapes = jax.eval_shape(monitored, state, batch, step)[1]

        def plain(state, batch, step):
            new, metrics = stepper.train_fn(state, batch, step)
            zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items() if k not in metrics}
            return new, {**metrics, **zeros}

        return jax.lax.cond(step % every == every - 1, monitored, plain, state, batch, step)

    fn = jax.jit(
        step_fn,
        in_shardings=(stepper.shardings, stepper.batch_shardings(spec), stepper.replicated),
        out_shardings=(stepper.shardings, stepper.replicated),
        donate_argnums=0,
    )
    return fn


def timed_round(run, state, first: int, every: int, fetch: bool):
    """`every` steps from `first`; -> (state, [(is a monitor step, milliseconds)])."""
    import jax

    times = []
    for step in range(first, first + every):
        start = time.perf_counter()
        state, metrics = run(state, step)
        due = (step + 1) % every == 0
        if fetch and due:  # the loop fetches a monitor step's monitors at once
            jax.device_get({k: v for k, v in metrics.items() if k.startswith("monitor/")})
        jax.block_until_ready(state)
        times.append((due, (time.perf_counter() - start) * 1e3))
    return state, times


def main(argv=None) -> None:
    import jax
    import numpy as np

    args = parse_args(argv)
    stepper, state, batch, spec = build(args)
    cond = cond_step(stepper, spec, args.every)
    with jax.set_mesh(stepper.mesh):
        ways = {
            "plain": lambda s, step: stepper.compiled_train(s, batch, np.int32(step)),
            "variant": lambda s, step: stepper.train_step(s, batch, step),
            "cond": lambda s, step: cond(s, batch, np.int32(step)),
        }
        for run in ways.values():  # warm-up: every program run once (the cond one compiles here)
            state, _ = timed_round(run, state, 0, args.every, fetch=True)
        times: dict[str, list] = {name: [] for name in ways}
        names, step = list(ways), args.every
        for round_ in range(args.rounds):
            # each round starts at another way: none always follows the same one (a heavier program's aftermath)
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                state, got = timed_round(ways[name], state, step, args.every, fetch=name != "plain")
                times[name] += got
                step += args.every
    medians = {"uptime": os.popen("uptime").read().strip(), "every": args.every, "rounds": args.rounds}
    for name, got in times.items():
        medians[f"{name}_other_steps_ms"] = statistics.median(t for due, t in got if not due)
        medians[f"{name}_monitor_steps_ms"] = statistics.median(t for due, t in got if due)
        medians[f"{name}_mean_step_ms"] = statistics.fmean(t for _, t in got)
    print(json.dumps(medians))
    plain = medians["plain_mean_step_ms"]
    print("\n| way | other steps (median ms) | monitor steps (median ms) | mean step (ms) | vs plain |")
    print("|---|---|---|---|---|")
    for name in times:
        mean = medians[f"{name}_mean_step_ms"]
        print(
            f"| {name} | {medians[f'{name}_other_steps_ms']:.1f} | {medians[f'{name}_monitor_steps_ms']:.1f} "
            f"| {mean:.1f} | {mean / plain - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
