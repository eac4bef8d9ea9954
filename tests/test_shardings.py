"""No wasted collectives: every family's train step compiles on the meshes the recipes and tests use without XLA's
"Involuntary full rematerialization" (a whole tensor gathered and re-split every step because the compiler cannot
go from one sharding to the next). Compile only: nothing runs."""

import time

import pytest
from conftest import INVOLUNTARY_REMAT, uncached_compiles
from family_fixtures import ENGINE_FAMILIES, FIXTURES

from spmdlm.cli.launch import parse_args
from spmdlm.data import pipeline
from spmdlm.families import objective_for_shapes
from spmdlm.train.stages.program import setup_state
from spmdlm.train.stages.resolve import resolve

# data=2,fsdp=2,tensor=2 is compiled (uncached) and checked where its step also runs: test_families.py's
# test_same_losses_on_a_sharded_mesh, the same launcher-built train step.
MESHES = ("data=4,fsdp=2", "fsdp=8")
# Less machine-code optimisation (the partitioner, which warns, runs before it either way): compiles ~30% faster.
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_train_step(family: str, config, mesh: str, output_dir) -> None:
    """The run's own train step (dtype, remat, objective as the launcher builds them) lowered and compiled."""
    args, _ = parse_args(
        ["--model_type", family, "--config_name", str(config), *FIXTURES[family].run_flags]
        + ["--mesh", mesh, "--per_device_train_batch_size", "2", "--output_dir", str(output_dir)]
    )
    run = resolve(args, time.perf_counter())
    objective = objective_for_shapes(run.family, run.config, flags=args.objective)
    model = setup_state(run, run.config, objective, 0, abstract=True)
    batch = pipeline.batch_spec(objective, run.global_batch)
    model.stepper.lower_train(model.state, batch, compiler_options=FAST_CODEGEN).compile()


@pytest.mark.slow
@pytest.mark.parametrize("family", ENGINE_FAMILIES)  # Llama: Qwen3 runs its code (family_fixtures.py)
def test_no_involuntary_rematerialization(family, tiny_configs, tmp_path, capfd):
    counts, first = {}, {}
    for mesh in MESHES:
        capfd.readouterr()
        with uncached_compiles():
            compile_train_step(family, tiny_configs[family], mesh, tmp_path / "out")
        lines = [line for line in capfd.readouterr().err.splitlines() if INVOLUNTARY_REMAT in line]
        counts[mesh] = len(lines)
        first.update({mesh: lines[0][:600]} if lines else {})
    assert counts == dict.fromkeys(MESHES, 0), first
