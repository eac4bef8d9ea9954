"""Named points where a run writes durable state, each with a test-only hook (docs/troubleshooting.md, "Crash
points"): tests/test_crash_points.py kills a run at each and checks that the same command, run again, finishes with
what an uninterrupted run has; tests/test_full_disk.py makes each write fail as on a full disk.

`crash_point(NAME, path)` does nothing unless an environment variable names NAME: SPMDLM_CRASH_AT=NAME[@N] sends
the process SIGKILL the Nth time (default the first) it passes the point; SPMDLM_ENOSPC_AT=NAME[@N] raises
OSError(ENOSPC) for `path` there instead, as the write would on a full disk. Unset (every real run), it is two
dictionary lookups.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

CRASH_ENV = "SPMDLM_CRASH_AT"
ENOSPC_ENV = "SPMDLM_ENOSPC_AT"

# Every point, in the order a run passes them. "before"/"after" name a write's ends; "during" a moment its files
# are partly there.
POINTS = (
    "token_cache.before_swap",  # the shards and card written to the cache's hidden sibling, not yet renamed in
    "dataset.before_swap",  # spmdlm.prepare: the same for --out
    "tokenizer.during_write",  # the output dir's tokenizer: its config written, tokenizer.json not yet
    "run_config.before_write",
    "tensorboard.before_write",  # an event of OUTPUT_DIR/tensorboard (the first: opening its file)
    "metrics.before_append",  # a record of metrics.jsonl or samples.jsonl
    "checkpoint.before_save",
    "checkpoint.during_save",  # orbax's asynchronous write started, not yet committed
    "checkpoint.after_commit",  # the step's folder renamed into place
    "eval_results.before_write",
    "loss_plot.before_write",  # loss_curve.png (and plots/monitors.png)
    "export.before_marker",  # hf/'s files written to its hidden sibling, spmdlm_export.json not yet
    "export.after_swap",  # hf/ renamed into place, its model card not yet written
    "model_card.before_write",
    "hub.before_upload",  # --push_to_hub: the export's files, before they go to the Hub
)
_passed: Counter[str] = Counter()
trail: list[str] = []  # the points passed, in order, while either variable is set (the tests read it)


def crash_point(name: str | None, path=None) -> None:
    """SIGKILL here, or fail as a full disk on `path`, when a test's environment names this point (see above);
    `name` None: a write that is no point."""
    crash, full = os.environ.get(CRASH_ENV), os.environ.get(ENOSPC_ENV)
    if name is None or not (crash or full):
        return
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; add it to spmdlm.crashpoints.POINTS")
    _passed[name] += 1
    trail.append(name)
    if _armed(crash, name):
        os.kill(os.getpid(), signal.SIGKILL)
    if _armed(full, name):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path) if path is not None else None)


def reset() -> None:
    """Forget the points passed (the counts of NAME@N, the trail): a test's next in-process run counts afresh."""
    _passed.clear()
    trail.clear()


def _armed(spec: str | None, name: str) -> bool:
    point, _, nth = (spec or "").partition("@")
    return point == name and _passed[name] == int(nth or 1)
