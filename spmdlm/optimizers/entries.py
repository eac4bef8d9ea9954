"""What an optimizer or a learning-rate schedule entry is, what its `build` receives, and the pieces several entries
share: the AdamW flags, the decay mask by parameter kind, and finding a transform's state inside an optimizer state.

An entry owns its flags (`Flag`: name, type, default, help, check or bounds, whether a resume must keep it), its
rules across them (`check`) and its `build`; it knows nothing of the run's arguments (spmdlm/run_args holds their
values: `OptimizationArgs.flags_of(entry)`). The registry is spmdlm/optimizers/__init__.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import nnx

from spmdlm.bounds import Bounds
from spmdlm.data.objectives import Flag
from spmdlm.models.layers import Bias, Scale

Values = Mapping[str, Any]  # an entry's own flags by name: their values in this run (a flag not given: its default)


def no_rule(values: Values) -> None:
    """An entry without rules across its flags."""


@dataclasses.dataclass(frozen=True)
class OptimizerInputs:
    """What an optimizer's `build` gets: the model it updates, the learning rate by step, --weight_decay, and the
    values of its own flags."""

    model: nnx.Module
    schedule: optax.Schedule
    weight_decay: float
    flags: Values

    @property
    def decay_mask(self):
        """The parameters that decay by default (`weight_decay_mask`)."""
        return weight_decay_mask(self.model)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One `--optim` choice. `build` returns the optimizer's transform, already scaled by the learning rate and with
    its weight decay; gradient clipping and spike skipping are put around it for every optimizer
    (spmdlm/engine/optim.py make_optimizer). `evaluation_params(opt_state, params)`: for an optimizer whose iterate is
    not the model to evaluate (schedule-free), the parameters to evaluate, export and sample from; None: `params`."""

    name: str
    build: Callable[[OptimizerInputs], optax.GradientTransformation]
    flags: tuple[Flag, ...] = ()
    check: Callable[[Values], None] = no_rule  # rules across its flags, or on a shared flag; raises ArgumentError
    evaluation_params: Callable[[Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleInputs:
    """What a schedule's `after` gets: the peak rate, the floor of a decaying schedule as a fraction of it
    (--min_lr_ratio), the warmup's steps (at most the run's), the run's steps, and its own flags' values."""

    peak: float
    min_lr_ratio: float
    warmup: int
    total_steps: int
    flags: Values

    @property
    def floor(self) -> float:
        return self.peak * self.min_lr_ratio

    @property
    def decay_steps(self) -> int:
        """The steps after the warmup (at least one)."""
        return max(self.total_steps - self.warmup, 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One `--lr_scheduler_type` choice: `after` is the rate from the end of the warmup on, as a function of the steps
    since then (the linear warmup before it is every schedule's: spmdlm/engine/optim.py learning_rate_schedule).
    `decays`: it falls to a floor, so --min_lr_ratio applies. `check_steps(values, warmup_steps, max_steps)`: its
    rules against the run's length, once that is known."""

    name: str
    after: Callable[[ScheduleInputs], optax.Schedule]
    decays: bool
    flags: tuple[Flag, ...] = ()
    check: Callable[[Values], None] = no_rule
    check_steps: Callable[[Values, int, int], None] = lambda values, warmup_steps, max_steps: None


# -- what several entries share ------------------------------------------------------------------------------------
# AdamW's flags, which Lion, Muon's AdamW part and schedule-free AdamW take too (one declaration, shared).
ADAM_BETA1 = Flag(
    "adam_beta1",
    float,
    0.9,
    "AdamW beta1; also Lion's b1, Muon's AdamW part's and schedule-free's interpolation weight",
    resume=False,
    bounds=Bounds(0, 1, below=True),
)
ADAM_BETA2 = Flag(
    "adam_beta2",
    float,
    0.999,
    "AdamW beta2; also Lion's b2 (0.99 in its paper), Muon's AdamW part's and schedule-free's",
    resume=False,
    bounds=Bounds(0, 1, below=True),
)
ADAM_EPSILON = Flag(
    "adam_epsilon",
    float,
    1e-8,
    "AdamW epsilon (not Lion's: it has none)",
    resume=False,
    bounds=Bounds(0, above=True, hint="e.g. 1e-8: it keeps the update finite where a gradient's second moment is 0"),
)


def weight_decay_mask(model: nnx.Module):
    """True for parameters that decay: not biases or norm scales (decided by the parameter's type, not its name).

    A tree of bools that is a prefix of both the Variable state optax sees at init and the arrays it sees later.
    """
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(
        lambda v: not isinstance(v, (Bias, Scale)), params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def states_of(opt_state, kind: type) -> list:
    """The `kind` states (a transform's NamedTuple) inside an optimizer state (nnx.Optimizer's, or pure arrays)."""
    is_kind = lambda x: isinstance(x, kind)
    return [s for s in jax.tree.leaves(nnx.as_pure(opt_state), is_leaf=is_kind) if is_kind(s)]
