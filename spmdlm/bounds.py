"""The one rule every numeric flag obeys: a finite number within its declared bounds, refused before any output.

Each numeric flag of the launcher (spmdlm/run_args/choices.py's `FLAG_BOUNDS`) and of the objectives
(`Flag(bounds=...)`) declares a `Bounds`; `check` is the one place that judges a value against it, and its message
names the flag, the valid values, the value given and what the value means (the fix).
"""

from __future__ import annotations

import dataclasses
import math

from spmdlm.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Valid values: low <= value <= high (`above`: low < value), either end optional; always finite."""

    low: float | None = None
    high: float | None = None
    above: bool = False  # the low end is excluded (e.g. an epsilon above 0)
    below: bool = False  # the high end is excluded (e.g. a rate below 1)
    hint: str = ""  # what the value means, said after the refusal: the fix

    def describe(self) -> str:
        """'at least 1', 'above 0', 'in [0, 1)': the valid values in words."""
        if self.low is not None and self.high is not None:
            low, high = _number(self.low), _number(self.high)
            return f"in {'(' if self.above else '['}{low}, {high}{')' if self.below else ']'}"
        if self.low is not None:
            return f"{'above' if self.above else 'at least'} {_number(self.low)}"
        return "" if self.high is None else f"{'below' if self.below else 'at most'} {_number(self.high)}"

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite, and may exceed a float)
            return False
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or (value < self.high if self.below else value <= self.high)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


ANY = Bounds()  # a numeric flag without bounds of its own: finite is all it must be
MAX_STEPS = 2**31 - 1  # the optimizer's and the loop's step counters are int32


def check(name: str, value, bounds: Bounds | None) -> None:
    """Refuses `--name value` in one line unless it is a finite number within `bounds` (None: ANY)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    bounds = bounds or ANY
    if not bounds.admits(value):
        valid = bounds.describe()
        if isinstance(value, float) and not math.isfinite(value):
            valid = "a finite number" + (f" {valid}" if valid else "")
        hint = f" ({bounds.hint})" if bounds.hint else ""
        raise ArgumentError(f"--{name} must be {valid}, got {value}{hint}")
