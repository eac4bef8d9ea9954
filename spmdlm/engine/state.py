"""The sharded train state: (model, optimizer) built once, born sharded on the mesh, or only its shapes.

`build_train_state` is the one way the launcher, `--compile_for`, the benchmarks and the tests make a state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spmdlm.data.batch_ramp import RampedSteps
from spmdlm.engine.optim import make_optimizer
from spmdlm.families.base import Family
from spmdlm.run_args.sections import OptimizationArgs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # --dtype: the compute dtype


def create_train_state(build: Callable[[], tuple[nnx.Module, nnx.Optimizer]], mesh: Mesh, *, abstract=False):
    """Build (model, optimizer) inside jit under the mesh so every array is born sharded (no replicated copy).

    `abstract=True` allocates nothing: it returns shapes with the exact shardings the initialiser would produce
    (read from its compiled program), a restore target that keeps a resume at one copy of the state.
    """
    with jax.set_mesh(mesh):
        graphdef, _ = nnx.split(nnx.eval_shape(build))
        init = jax.jit(lambda: nnx.state(build()))
        if not abstract:
            return graphdef, init()
        shapes = jax.eval_shape(init)
        shardings = init.lower().compile().output_shardings
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return graphdef, state


@dataclasses.dataclass(frozen=True)
class Compute:
    """How the model computes: in `dtype` (--dtype; parameters are float32), its scanned layers rematerialised by
    `remat` and unrolled `scan_unroll` at a time (0: fully; the layer plan resolves both), attention by
    `attention` (--attention as resolved)."""

    dtype: str = "float32"
    remat: str = "dots"
    scan_unroll: int = 1
    attention: str = "xla"


def build_train_state(
    family: Family,
    config,
    mesh: Mesh,
    *,
    optim: OptimizationArgs = OptimizationArgs(),
    total_steps: int | RampedSteps = 1,
    seed: int = 0,
    compute: Compute = Compute(),
    abstract: bool = False,
):
    """-> (graphdef, state) of the family's model with its optimizer, initialised from `seed` and computing as
    `compute` says. `abstract` allocates nothing (see `create_train_state`): the target of a restore, or all that a
    compile-only run needs."""

    def build():
        model = family.make_model(
            config,
            rngs=nnx.Rngs(params=seed),
            dtype=DTYPES[compute.dtype],
            remat=compute.remat,
            scan_unroll=compute.scan_unroll or True,
            attention=compute.attention,
        )
        steps = total_steps if isinstance(total_steps, RampedSteps) else max(total_steps, 1)
        return model, nnx.Optimizer(model, make_optimizer(optim, model, steps), wrt=nnx.Param)

    return create_train_state(build, mesh, abstract=abstract)


def count_parameters(graphdef, state) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)))
