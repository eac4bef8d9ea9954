"""The progress display of process 0: a tqdm bar on a terminal, else one log line per logging step with an ETA;
messages (evaluations, samples) printed above the bar so it is not torn."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("spmdlm")


def terminal_columns() -> int:
    """The width stderr's terminal reports (0 when it reports none, or is no terminal)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal, or stderr replaced by an object without a fd
        return 0


def duration(seconds: int) -> str:
    """'1h05m' or '4m09s'."""
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.total = 0
        self._first_step, self._start_time = 0, time.perf_counter()

    def start(self, step: int, total: int) -> None:
        self._first_step, self._start_time, self.total = step, time.perf_counter(), total
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        # a log file gets plain lines (show), not carriage-return bar fragments; so does a terminal that reports 0
        # columns (some CI and IDE consoles), where tqdm would draw nothing at all
        if sys.stderr.isatty() and terminal_columns() > 0:
            self.bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)

    def tick(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def show(self, step: int, shown: dict[str, str]) -> None:
        """A logging step's values: on the bar, or as one line with the ETA."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(shown, refresh=False)
            return
        values = " | ".join(f"{k} {v}" for k, v in shown.items())
        log.info("step %d/%d | %s | ETA %s", step, self.total, values, self.eta(step, time.perf_counter()))

    def say(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else log.info)(message)

    def eta(self, step: int, now: float) -> str:
        """Remaining steps at the average wall time per step so far (evaluations included, compile excluded)."""
        done = step - self._first_step
        if done <= 0:
            return "?"
        return duration(int((now - self._start_time) / done * (self.total - step)))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
