"""Goodput: where a run's wall time went, and a warning for steps far slower than the recent ones (stragglers).

The wall time from the run's start to its summary is split into productive steps, compilation, checkpoint saves and
restores, evaluation, data waits (the loop getting its next batch) and the restart loss (steps this run computes
again because the run before it reached them after its last checkpoint and then died: a crash, a hang, a lost
host), and `other` (setup, tokenizer, data preparation, export), so the fractions add to 1. See docs/operations.md.

A step's time is measured between the completions of consecutive steps: `step_done` waits for the previous step's
outputs (one step behind, so the next step is already queued and the device never idles for it) and subtracts what
the loop spent meanwhile in the other kinds.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import jax

log = logging.getLogger("spmdlm")

KINDS = ("steps", "compile", "checkpoint", "evaluation", "data_wait", "restart_loss")
SLOW_STEP_WINDOW = 50  # the recent steps whose median a step is compared with
SLOW_STEP_QUIET_SECONDS = 60.0  # at most one slow-step warning this often (others are counted in the next one)
SLOW_STEP_MIN_EXCESS = 1.0  # seconds a slow step must also exceed the median by: millisecond jitter is no straggler


class SlowSteps:
    """Warns when a step takes more than `factor` x the median of the last SLOW_STEP_WINDOW steps (and at least
    SLOW_STEP_MIN_EXCESS more): once per run of slow steps, and at most once every SLOW_STEP_QUIET_SECONDS (the
    warnings held back are counted in the next)."""

    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic):
        self.factor, self.clock = factor, clock
        self.recent: deque[float] = deque(maxlen=SLOW_STEP_WINDOW)
        self.slow_before = False  # the previous step was slow: the same occurrence
        self.held_back = 0
        self.last_warning = -float("inf")

    def forget(self) -> None:
        """The steps from now on are of another size (a --batch_size_ramp stage): measured against their own."""
        self.recent.clear()
        self.slow_before = False

    def check(self, step: int, seconds: float) -> bool:
        """Whether `step` (taking `seconds`) is slow; warns as the class says."""
        median = statistics.median(self.recent) if len(self.recent) >= 5 else float("inf")
        slow = bool(self.factor) and seconds > self.factor * median and seconds - median >= SLOW_STEP_MIN_EXCESS
        if slow and not self.slow_before:
            if self.clock() - self.last_warning >= SLOW_STEP_QUIET_SECONDS:
                held = f" ({self.held_back} more since the last such warning)" if self.held_back else ""
                log.warning(
                    "step %d took %.3g s, %.1fx the median of the last %d steps (%.3g s): a straggler host, a "
                    "data stall or a noisy neighbour%s",
                    step,
                    seconds,
                    seconds / median,
                    len(self.recent),
                    median,
                    held,
                )
                self.last_warning, self.held_back = self.clock(), 0
            else:
                self.held_back += 1
        self.slow_before = slow
        if not slow:  # a slow step does not raise the bar the next ones are measured against
            self.recent.append(seconds)
        return slow


class Goodput:
    """Seconds by kind since `start` (on `clock`'s scale). Steps numbered up to `recompute_through` (set on a
    resume: the highest step the run before reached) count as restart loss."""

    def __init__(self, start: float, slow_step_factor: float = 0.0, clock: Callable[[], float] = time.perf_counter):
        self.start, self.clock = start, clock
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.recompute_through = 0
        self.recomputed_steps = 0
        self.slow = SlowSteps(slow_step_factor)
        self._spanned = 0.0  # seconds in spans so far: subtracted from the step they fell in
        self._mark: tuple[float, float] | None = None  # (time, _spanned) at the last step's completion
        self._waiting: tuple[int, Any] | None = None  # the step whose completion is not yet observed, its outputs

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        begin = self.clock()
        try:
            yield
        finally:
            elapsed = self.clock() - begin
            self.seconds[kind] += elapsed
            self._spanned += elapsed

    def step_done(self, step: int, outputs: Any) -> None:
        """Step `step` was dispatched with `outputs`: the previous one's completion is waited for and counted."""
        previous, self._waiting = self._waiting, (step, outputs)
        if previous is not None:
            self._completed(*previous)
        elif self._mark is None:  # the loop's first step: measured from here
            self._mark = (self.clock(), self._spanned)

    def steps_finished(self) -> None:
        """The loop ended: its last step's completion is counted."""
        if self._waiting is not None:
            self._completed(*self._waiting)
            self._waiting = None

    def _completed(self, step: int, outputs: Any) -> None:
        jax.block_until_ready(outputs)
        now = self.clock()
        then, spanned = self._mark
        seconds = max(now - then - (self._spanned - spanned), 0.0)
        self._mark = (now, self._spanned)
        if step <= self.recompute_through:
            self.seconds["restart_loss"] += seconds
            self.recomputed_steps += 1
        else:
            self.seconds["steps"] += seconds
            self.slow.check(step, seconds)

    def summary(self) -> dict[str, Any]:
        """{wall_seconds, seconds: {kind: s}, fractions: {kind: f}, recomputed_steps}: `other` is the rest of the
        wall time, so the fractions add to 1."""
        wall = max(self.clock() - self.start, 1e-9)
        seconds = {**self.seconds, "other": max(wall - sum(self.seconds.values()), 0.0)}
        total = max(wall, sum(seconds.values()))  # clocks never run backwards; this only guards rounding
        return {
            "wall_seconds": wall,
            "seconds": seconds,
            "fractions": {kind: value / total for kind, value in seconds.items()},
            "recomputed_steps": self.recomputed_steps,
        }


def describe(summary: dict[str, Any]) -> str:
    """'goodput 71% (compile 12%, checkpoint 3%, ...)': the productive fraction, then the other kinds above 0.5%."""
    fractions = summary["fractions"]
    rest = ", ".join(
        f"{kind.replace('_', ' ')} {value:.0%}"
        for kind, value in fractions.items()
        if kind != "steps" and value >= 0.005
    )
    return f"goodput {fractions['steps']:.0%}" + (f" ({rest})" if rest else "")


def flat_record(summary: dict[str, Any]) -> dict[str, float]:
    """The fractions and seconds as flat metrics (metrics.jsonl and the trackers): goodput/<kind> and
    goodput/<kind>_seconds."""
    return {
        **{f"goodput/{kind}": value for kind, value in summary["fractions"].items()},
        **{f"goodput/{kind}_seconds": value for kind, value in summary["seconds"].items()},
        "goodput/wall_seconds": summary["wall_seconds"],
        "goodput/recomputed_steps": summary["recomputed_steps"],
    }
