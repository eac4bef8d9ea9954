"""The stability monitors' warning (--monitor_warn_factor): a layer's gradient norm or largest attention logit that
grows past that multiple of its recent median says an instability is starting, often well before the loss spikes
(the logit growth QK-norm is against). Kept on the host, over the monitor records the run logs (engine/monitors.py
computes them inside the train step)."""

from __future__ import annotations

import collections
import logging

import numpy as np

log = logging.getLogger("spmdlm")

WINDOW = 20  # monitor records a value's median is taken over
LEAST_HISTORY = 5  # records a value needs before it is judged: no warning off one or two early values
# Of these, the per-layer values (`.../layer_<i>`) are judged, each against its own median when that is positive (an
# attention logit's median may be at or below 0, where no multiple of it says growth).
WATCHED = ("monitor/grad_norm/", "monitor/attn_logit_max/", "monitor/cross_attn_logit_max/")


def watched(key: str) -> bool:
    return key.startswith(WATCHED) and "layer_" in key.rsplit("/", 1)[-1]


class StabilityWatch:
    """Each watched value's last WINDOW monitor records; `check` judges a record's values against their median."""

    def __init__(self, factor: float, window: int = WINDOW):
        self.factor = factor
        self.history: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=window))

    def remember(self, record: dict) -> None:
        """A record logged before a resume: its values join their history, unjudged."""
        for key, value in record.items():
            if watched(key) and value is not None:
                self.history[key].append(value)

    def check(self, record: dict) -> list[str]:
        """The watched values of `record` (a metrics.jsonl monitor record) past `factor` x their median so far, as
        'key value (N.Nx its median M)'; each then joins its history. One warning line names them all."""
        grown = []
        for key, value in record.items():
            if not watched(key):
                continue
            history = self.history[key]
            if len(history) >= LEAST_HISTORY:
                median = float(np.median(history))
                if median > 0 and value > self.factor * median:
                    grown.append(f"{key} {value:.4g} ({value / median:.1f}x its median {median:.4g})")
            history.append(value)
        if grown:
            log.warning(
                "step %d: grown past --monitor_warn_factor %g x the median of the last %d monitor steps: %s; an "
                "instability may be starting (docs/training.md: stability monitors)",
                record["step"],
                self.factor,
                self.history[next(iter(self.history))].maxlen,
                "; ".join(grown),
            )
        return grown
