"""--profile_steps' window (OperationsArgs.profile_window), parsed."""

from __future__ import annotations

from spmdlm import bounds
from spmdlm.errors import ArgumentError


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    """--profile_steps 'A-B' (or 'A'): the first and last step traced, 1 <= A <= B; None: no profile."""
    if text is None:
        return None
    first, dash, last = text.strip().partition("-")
    try:
        window = (int(first), int(last if dash else first))
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1] <= bounds.MAX_STEPS:
        raise ArgumentError(
            f"--profile_steps must be A-B with 1 <= A <= B (steps count from 1), or one step A; got "
            f"{text!r}; e.g. 5-7: leave the first steps out, they include warm-up"
        )
    return window
