"""The global batch of each step: one fixed size, or a ramp (--batch_size_ramp 0:64,2000:256,8000:512: the batch in
sequences from each step on), and how a mesh reaches each size (its stages: per-device batch x accumulation).

Everything that counts examples goes through `BatchRamp.examples_before`: the data pipeline (global batch s is the
global examples [examples_before(s), examples_before(s + 1)), so each example is read once across the ramp), the
step count of a run given in epochs, the tokens a run has seen, and the learning-rate schedule, which a ramp runs in
final-batch steps (examples seen / the final batch: GPT-3's token-based warmup and decay; docs/training.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from spmdlm.bounds import MAX_STEPS
from spmdlm.errors import ArgumentError

RAMP_FLAG = "--batch_size_ramp"
RAMP_HELP = (
    "grow the global batch during the run: STEP:SEQUENCES,... from step 0 on, e.g. 0:64,2000:256,8000:512; each "
    "reached by the largest per-device batch up to --per_device_train_batch_size that divides it, and gradient "
    "accumulation for the rest; the learning-rate schedule then counts final-batch steps (examples / the final "
    "batch; docs/training.md, Batch-size ramp)"
)


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    """Global batch `sizes[i]` from step `steps[i]` on (steps[0] == 0, strictly increasing)."""

    steps: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def fixed(cls, global_batch: int) -> BatchRamp:
        return cls((0,), (global_batch,))

    @classmethod
    def parse(cls, text: str) -> BatchRamp:
        """'STEP:SEQUENCES,...' with one-line errors naming the entry and the fix."""
        steps, sizes = [], []
        for entry in (part.strip() for part in text.split(",")):
            step, colon, size = entry.partition(":")
            try:
                step, size = int(step), int(size)
            except ValueError:
                step = size = -1
            if not colon or not 0 <= step <= MAX_STEPS or size < 1:
                raise ArgumentError(
                    f"{RAMP_FLAG} {text!r}: entry {entry!r} is not STEP:SEQUENCES (a step from 0 to {MAX_STEPS} and "
                    "a global batch of at least 1 sequence); e.g. 0:64,2000:256,8000:512"
                )
            if steps and step <= steps[-1]:
                raise ArgumentError(
                    f"{RAMP_FLAG} {text!r}: entry {entry!r} does not come after step {steps[-1]}; list the "
                    "steps in increasing order"
                )
            steps.append(step)
            sizes.append(size)
        if steps[0] != 0:
            raise ArgumentError(f"{RAMP_FLAG} {text!r}: the first entry must be at step 0 (e.g. 0:{sizes[0]},...)")
        return cls(tuple(steps), tuple(sizes))

    def spec(self) -> str:
        return ",".join(f"{step}:{size}" for step, size in zip(self.steps, self.sizes))

    @property
    def ramps(self) -> bool:
        """Whether the batch changes during the run (else one fixed size)."""
        return len(self.sizes) > 1

    @property
    def final(self) -> int:
        return self.sizes[-1]

    def _spans(self):
        """(first step, batch, end step or None for the last) of each stage."""
        return zip(self.steps, self.sizes, (*self.steps[1:], None))

    def batch_at(self, step: int) -> int:
        return self.sizes[self.stage_index(step)]

    def stage_index(self, step: int) -> int:
        return sum(first <= step for first in self.steps) - 1

    def examples_before(self, step: int) -> int:
        """Global examples the steps before `step` consumed: Σ_{t<step} batch_at(t)."""
        total = 0
        for first, size, end in self._spans():
            if step <= first:
                break
            total += size * ((step if end is None else min(step, end)) - first)
        return total

    def steps_within(self, examples: int) -> int:
        """The most steps whose examples all lie within the first `examples`."""
        for first, size, end in self._spans():
            used = self.examples_before(first)
            if end is None or self.examples_before(end) > examples:
                return first + max(examples - used, 0) // size
        raise AssertionError("unreachable: the last stage has no end")

    def final_batch_steps(self, count: jax.Array) -> jax.Array:
        """examples_before(count) / the final batch as float32, traceable (the learning-rate schedule's clock)."""
        count = jnp.asarray(count, jnp.float32)
        total = jnp.zeros((), jnp.float32)
        for first, size, end in self._spans():
            span = jnp.maximum(count - first, 0.0)
            total += (span if end is None else jnp.minimum(span, end - first)) * (size / self.final)
        return total

    def unreached(self, total_steps: int) -> str | None:
        """A line saying which entries a run of `total_steps` steps never reaches (None: it reaches them all)."""
        late = [step for step in self.steps if step >= total_steps]
        if not late:
            return None
        return (
            f"{RAMP_FLAG} {self.spec()}: the run ends at step {total_steps}, so the entries from step {late[0]} on "
            f"are never reached (its last global batch is {self.batch_at(total_steps - 1)}); raise --max_steps or "
            "drop them"
        )

    def schedule_steps(self, total_steps: int) -> int:
        """A run of `total_steps` steps in final-batch steps (rounded up): the schedule's length."""
        return max(math.ceil(self.examples_before(total_steps) / self.final), 1)


def check_ramp(text: str | None, global_batch_size: int | None, gradient_accumulation_steps: int) -> None:
    """--batch_size_ramp (when given) is well formed and sets the batch alone: the flags that set it too are
    refused in one line."""
    if text is None:
        return
    BatchRamp.parse(text)
    for flag, given in (
        ("global_batch_size", global_batch_size is not None),
        ("gradient_accumulation_steps", gradient_accumulation_steps != 1),
    ):
        if given:
            raise ArgumentError(
                f"{RAMP_FLAG} sets the global batch and the accumulation of each step: leave --{flag} out "
                "(--per_device_train_batch_size is the most a device takes at once)"
            )


@dataclasses.dataclass(frozen=True)
class Extension:
    """A resume that found the run's length changed (--max_steps, --num_train_epochs): at checkpoint step `at_step`
    the run had `steps_before` optimizer steps; `restart` (--lr_scheduler_on_extension restart) starts the schedule
    over the new length, else it continues (engine/optim.continued). run_config.json records those that continue."""

    at_step: int
    steps_before: int
    restart: bool = False

    def to_json(self) -> dict:
        return {"at_step": self.at_step, "steps_before": self.steps_before}


@dataclasses.dataclass(frozen=True)
class RampedSteps:
    """A run's length for its learning-rate schedule when the batch ramps or a resume changed it: `total` optimizer
    steps of `ramp`'s batches (engine/optim.learning_rate_schedule runs the schedule in final-batch steps), after
    the `extensions` of its length, oldest first."""

    total: int
    ramp: BatchRamp
    extensions: tuple[Extension, ...] = ()

    def lengths(self) -> list[int]:
        """The run's length before each extension, then now: the length each schedule of the run was built for."""
        return [extension.steps_before for extension in self.extensions] + [self.total]

    def recorded(self) -> list[dict]:
        """The extensions that shape the schedule, as run_config.json records them: those that changed the length,
        after the last restart (whose schedule starts over)."""
        kept: list[dict] = []
        for extension, length in zip(self.extensions, self.lengths()[1:]):
            if extension.steps_before != length:
                kept = [] if extension.restart else [*kept, extension.to_json()]
        return kept


@dataclasses.dataclass(frozen=True)
class BatchStage:
    """How the mesh takes one global batch: `per_device` examples per batch device in each of `accumulation`
    micro-steps, from step `first_step` on. A `passed` stage ended before the step a resumed run starts at: it is
    never run again, so this mesh need not divide it (its per-device batch is then 0)."""

    first_step: int
    global_batch: int
    per_device: int
    accumulation: int
    passed: bool = False


def plan_stages(
    ramp: BatchRamp, batch_devices: int, processes: int, max_per_device: int, resume_step: int = 0
) -> tuple[BatchStage, ...]:
    """Each ramp entry's stage: the largest per-device batch up to `max_per_device` that divides the entry's batch
    per device, and the accumulation that makes up the rest; an entry the batch devices or the processes do not
    divide is refused in one line. A run resumed at `resume_step` needs only the stages from there on: those that
    ended before it are `passed`, whatever this mesh makes of them."""
    stages = []
    for step, size, end in ramp._spans():
        if end is not None and end <= resume_step:
            stages.append(BatchStage(step, size, 0, 1, passed=True))
            continue
        for count, what in ((batch_devices, "batch devices (data x fsdp of the mesh)"), (processes, "processes")):
            if size % count:
                multiple = math.lcm(batch_devices, processes)
                raise ArgumentError(indivisible(step, size, count, what, multiple, resume_step))
        each = size // batch_devices
        per_device = max(d for d in range(1, min(each, max_per_device) + 1) if each % d == 0)
        stages.append(BatchStage(step, size, per_device, each // per_device))
    return tuple(stages)


def indivisible(step: int, size: int, count: int, what: str, multiple: int, resume_step: int) -> str:
    """The refusal of an entry the batch devices or processes do not divide, with the fix: another entry for a new
    run; for a resumed one, whose ramp may not change, a mesh that divides it."""
    said = f"{RAMP_FLAG} entry {step}:{size}: {size} sequences do not divide among the {count} {what}"
    if resume_step:
        return (
            f"{said}; the run resumes at step {resume_step}, before this entry's stage ends, and its ramp cannot "
            f"change now: resume it where the batch devices (data x fsdp) and the processes divide {size}"
        )
    return f"{said}; use a multiple of {multiple} (e.g. {step}:{-(-size // multiple) * multiple})"


def stage_at(stages: tuple[BatchStage, ...], step: int) -> BatchStage:
    return [stage for stage in stages if stage.first_step <= step][-1]


def largest_stage(stages: tuple[BatchStage, ...]) -> BatchStage:
    """The stage whose step needs the most memory: the largest micro-batch per device, then the most accumulation
    (of the stages still to run)."""
    return max((s for s in stages if not s.passed), key=lambda stage: (stage.per_device, stage.global_batch))
