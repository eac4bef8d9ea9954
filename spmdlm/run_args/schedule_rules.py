"""The rules of --lr_scheduler_type and of the flags that go with it (OptimizationArgs.check): which schedules take
--min_lr_ratio and each schedule's own flags, and what a resume that changes the run's length does to the rate
(--lr_scheduler_on_extension; engine/optim.continued)."""

from __future__ import annotations

from spmdlm.errors import ArgumentError
from spmdlm.optimizers import lr_schedules, owners

# --lr_scheduler_on_extension: continue (the rate goes on from where it is) or restart (the schedule starts over for
# the new length), when a resume finds --max_steps or --num_train_epochs changed
EXTENSION_CHOICES = ("continue", "restart")
EXTENSION_HELP = (
    "what the learning rate does when a resume finds the run's length changed (--max_steps, --num_train_epochs): "
    "continue = it goes on from the rate reached, the new length's schedule scaled to start there and still end at "
    "the floor; restart = the schedule starts over for the new length, the rate jumping back up (docs/training.md, "
    "Extending a run)"
)


def check_schedule(optimization) -> None:
    """--lr_scheduler_type, the flags only some schedules take, and --lr_scheduler_on_extension."""
    known, kind = lr_schedules(), optimization.lr_scheduler_type
    if kind not in known:
        raise ArgumentError(f"--lr_scheduler_type {kind!r} is not supported; use one of {', '.join(known)}")
    schedule = known[kind]
    if optimization.min_lr_ratio and not schedule.decays:
        decaying = ", ".join(name for name, other in known.items() if other.decays)
        raise ArgumentError(
            f"--min_lr_ratio applies to the decaying schedules ({decaying}), not --lr_scheduler_type {kind}; "
            "leave it out"
        )
    for flag in dict.fromkeys(flag for other in known.values() for flag in other.flags):
        if flag not in schedule.flags and optimization.flag_value(flag) != flag.default:  # given to another schedule
            takers = owners(flag.name, known.values())
            raise ArgumentError(
                f"--{flag.name} applies to --lr_scheduler_type {' or '.join(takers)} only; leave it out or give "
                f"--lr_scheduler_type {takers[0]}"
            )
    schedule.check(optimization.flags_of(schedule))
    if optimization.lr_scheduler_on_extension not in EXTENSION_CHOICES:
        raise ArgumentError(
            f"--lr_scheduler_on_extension {optimization.lr_scheduler_on_extension!r}: use one of "
            f"{', '.join(EXTENSION_CHOICES)}"
        )
