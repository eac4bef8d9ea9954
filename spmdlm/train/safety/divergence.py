"""A finite divergence stops the run like a NaN does (exit 3): a logged loss past a bound relative to the run's own
history, CONSECUTIVE logs in a row (docs/troubleshooting.md: divergence).

The bound of a logged loss (the mean over the steps since the previous log, as metrics.jsonl has it) is
    max(FACTOR x the median of the last WINDOW logged losses that were within their bound,
        max(ln(vocabulary), the loss of the loop's first step) + MARGIN)
or --max_loss where it is given (0: off, only NaN or infinity stop the run). The floor is MARGIN nats above the loss
of a uniform guess, or of the model as the loop began (a badly scaled initialization's may be higher; a resume's is
the checkpoint's), which no model that is learning reaches: a spike that stays below it, or passes it for fewer than
CONSECUTIVE logs, goes on. A loss past its bound joins no history, so a runaway cannot
raise its own bound. At the last step one loss past its bound is enough: nothing later could bring it back.

When it fires: one line naming the steps and the losses; the checkpoints saved after the last log within the bound
(they hold the model that was diverging) are moved to OUTPUT_DIR/damaged_checkpoints (as <step>-<time>-diverged),
so the newest one left, the last good one, is where a resume starts; nothing is exported. After a resume the
history starts empty (the floor).
"""

from __future__ import annotations

import collections
import logging
import math

import numpy as np

from spmdlm import checkpoint
from spmdlm.errors import DivergenceError

log = logging.getLogger("spmdlm")

WINDOW = 20  # logged losses within their bound the median is taken over
FACTOR = 3.0  # a loss past this multiple of that median...
MARGIN = 10.0  # ...and past ln(vocabulary) + this many nats...
CONSECUTIVE = 3  # ...this many logs in a row is a divergence
DIVERGED = "diverged"  # the end of a diverged checkpoint's name in OUTPUT_DIR/damaged_checkpoints


class LossBound:
    """`judge(step, loss)` each logged loss; -> the one-line description of a divergence, or None.

    `max_loss`: None, the rule above; 0, off; else the absolute bound. `total_steps`: where one loss past its bound
    is enough."""

    def __init__(
        self,
        max_loss: float | None,
        vocab_size: int,
        total_steps: int | None = None,
        *,
        window: int = WINDOW,
        factor: float = FACTOR,
        margin: float = MARGIN,
        consecutive: int = CONSECUTIVE,
        start_loss: float | None = None,
    ):
        self.max_loss, self.total_steps = max_loss, total_steps
        self.factor, self.consecutive = factor, consecutive
        self.margin, self.vocab_size = margin, vocab_size
        self.start_loss = start_loss  # the loss of the loop's first step: the model as it began
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        self.past: list[tuple[int, float]] = []  # (step, loss) of the logs past their bound in a row
        self.last_good: int | None = None  # the step of the last log within its bound

    @classmethod
    def for_run(cls, args, vocab_size: int, total_steps: int) -> LossBound:
        """The train loop's: --max_loss, the vocabulary, the last step."""
        return cls(args.operations.max_loss, vocab_size, total_steps)

    @property
    def enabled(self) -> bool:
        return self.max_loss != 0

    @property
    def floor(self) -> float:
        return max(math.log(max(self.vocab_size, 2)), self.start_loss or 0.0) + self.margin

    def _floor_words(self) -> str:
        if self.start_loss is not None and self.start_loss > math.log(max(self.vocab_size, 2)):
            return f"the first step's loss {self.start_loss:.4g} + {self.margin:g}"
        return f"ln(vocabulary {self.vocab_size}) + {self.margin:g}"

    def bound(self) -> tuple[float, str]:
        """(the bound now, how it was reached in words)."""
        if self.max_loss:
            return self.max_loss, "--max_loss"
        if self.history:
            median = float(np.median(self.history))
            if self.factor * median > self.floor:
                return self.factor * median, (
                    f"{self.factor:g} x {median:.4g}, the median of the last {len(self.history)} logged losses"
                )
        return self.floor, self._floor_words()

    def judge(self, step: int, loss: float) -> str | None:
        """A logged loss (a non-finite one is check_finite's, in the loop, and is passed over here)."""
        if not self.enabled or not math.isfinite(loss):
            return None
        bound, how = self.bound()
        if loss <= bound:
            self.history.append(loss)
            self.past, self.last_good = [], step
            return None
        self.past.append((step, loss))
        last = self.total_steps is not None and step >= self.total_steps
        if len(self.past) < self.consecutive and not last:
            log.warning(
                "step %d: the logged loss %.4g is past its bound %.4g (%s); %d more in a row stop the run as a "
                "divergence",
                step,
                loss,
                bound,
                how,
                self.consecutive - len(self.past),
            )
            return None
        logs = ", ".join(f"{loss:.4g} at step {at}" for at, loss in self.past)
        in_a_row = f"{len(self.past)} logs in a row" if len(self.past) > 1 else "at the last step"
        return (
            f"training diverged at step {step}: the logged loss went past its bound {bound:.4g} ({how}) {in_a_row} "
            f"({logs}); --max_loss sets the bound (0: only NaN or infinity stop the run)"
        )

    def check(self, fetched: list[dict], step: int, manager, args) -> None:
        """The train loop's call at each log (after check_finite, with the same metrics): judge the logged loss;
        on a divergence, set aside the checkpoints saved after the last good log and raise DivergenceError (exit 3)
        naming the checkpoint kept."""
        kept = [m for m in fetched if not int(m.get("consecutive_skips", 0))]  # a skipped step changed nothing
        if self.last_good is None:  # the loop's first log: the step it started from (a resume's checkpoint) is good
            self.last_good = step - len(fetched)
            first = fetched[0]
            if float(first["tokens"]) and math.isfinite(loss := float(first["loss_sum"]) / float(first["tokens"])):
                self.start_loss = loss
        tokens = sum(float(m["tokens"]) for m in kept)
        if not kept or not tokens:
            return
        verdict = self.judge(step, sum(float(m["loss_sum"]) for m in kept) / tokens)
        if verdict is not None:
            raise DivergenceError(f"{verdict}; {set_aside_diverged(manager, self.last_good)}; {tries(args)}")


def set_aside_diverged(manager, last_good: int) -> str:
    """Move the checkpoints after step `last_good` to OUTPUT_DIR/damaged_checkpoints (as <step>-<time>-diverged,
    never deleted); -> what is kept, in words."""
    checkpoint.check_saved(manager, wait=True)
    moved = [s for s in sorted(manager.all_steps()) if s > last_good]
    for step in moved:
        checkpoint.set_aside(manager, step, why=DIVERGED)
    left = [s for s in manager.all_steps() if s <= last_good]
    kept = f"the last good checkpoint (step {max(left)}) is kept" if left else "no good checkpoint was written"
    if moved:
        kept += f", the diverged ones (steps {', '.join(map(str, moved))}) moved to OUTPUT_DIR/{checkpoint.DAMAGED_DIR}"
    return f"{kept}; nothing after it is saved or exported"


def tries(args) -> str:
    """What to change, as the NaN stop says it."""
    optimization = args.optimization
    said = [f"a lower --learning_rate (now {optimization.learning_rate:g})"]
    if not 0 < optimization.max_grad_norm <= 1.0:
        said.append(f"--max_grad_norm 1.0 (now {optimization.max_grad_norm:g})")
    said.append("--z_loss 1e-4" if not optimization.z_loss else "more --warmup_steps")
    if args.model.dtype != "float32":
        said.append("--dtype float32")
    return f"try {', '.join(said)}"
