"""--profile_steps A-B (--profile_every N, --profile_all_hosts): a jax.profiler trace of those training steps.

The trace is written to a local temporary folder and then moved (a gs:// output dir: uploaded) to
OUTPUT_DIR/tensorboard/plugins/profile/steps_A-B/<host>.xplane.pb, where TensorBoard's profile plugin and xprof find
it: one run per window, one file per traced process. Each step is a StepTraceAnnotation, so xprof's overview page
shows the step times. See docs/operations.md.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax

from spmdlm import storage
from spmdlm.train.safety.watchdog import host_label

log = logging.getLogger("spmdlm")


class Profiler:
    """`at_step(step, previous)` around each step (counted from 1; `previous`: the outputs of the step before, waited
    for when a window ends), `close(last)` after the loop. Inactive (the calls do nothing) without --profile_steps
    and on processes other than 0 unless `all_hosts`."""

    def __init__(self, window: tuple[int, int] | None, every: int | None, all_hosts: bool, out, process_index: int):
        self.window = window  # (first, last) of --profile_steps; None: no profile
        self.every, self.host = every, host_label(process_index)
        self.active = self.window is not None and (all_hosts or process_index == 0)
        self.logdir = out / "tensorboard"
        self._tracing: tuple[int, int, Path] | None = None  # (first, last, local folder) of the trace running

    def window_starting(self, step: int) -> tuple[int, int] | None:
        """(first, last) of the window that starts at `step`, if one does: --profile_steps, repeated every
        --profile_every steps."""
        first, last = self.window
        shift = step - first
        if shift < 0 or (shift if self.every is None else shift % self.every):
            return None
        return step, last + shift

    def at_step(self, step: int, previous: Any) -> contextlib.AbstractContextManager:
        """Before step `step`: ends the trace whose last step was the one before, starts one whose first is this;
        -> the step's trace annotation (a no-op context when not tracing)."""
        if not self.active:
            return contextlib.nullcontext()
        if self._tracing is not None and self._tracing[1] < step:
            self.close(previous)
        window = self.window_starting(step) if self._tracing is None else None
        if window is not None:
            local = Path(tempfile.mkdtemp(prefix="spmdlm-profile-"))
            jax.profiler.start_trace(str(local))
            self._tracing = (*window, local)
        if self._tracing is None:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc) -> None:
        """A run that fails mid-trace stops the trace (unpublished): the profiler is free for the next one."""
        if self._tracing is not None:
            self._tracing = None
            jax.profiler.stop_trace()

    def close(self, last: Any) -> None:
        """Ends a trace still running (after waiting for `last`, the outputs of its last step) and publishes it."""
        if self._tracing is None:
            return
        first, final, local = self._tracing
        self._tracing = None
        try:
            jax.block_until_ready(last)
        finally:
            jax.profiler.stop_trace()
        target = self.logdir / "plugins" / "profile" / f"steps_{first}-{final}"
        try:
            publish(local, target, self.host)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        log.info(
            "profile of steps %d-%d in %s; view it with: tensorboard --logdir %s (its Profile tab: pip install "
            "tensorboard xprof) or xprof --logdir=%s --port=6006",
            first,
            final,
            target,
            self.logdir,
            self.logdir,
        )


def publish(local: Path, target, host: str) -> None:
    """The trace files jax.profiler wrote under `local` (plugins/profile/<timestamp>/<hostname>.<kind>) into the
    folder `target` as <host>.<kind>: a run name that is the same on every process, a host name unique to each."""
    files = sorted(local.glob("plugins/profile/*/*"))
    if not files:
        log.warning("jax.profiler wrote no trace files for %s", target)
        return
    for file in files:
        name = f"{host}.{file.name.split('.', 1)[1]}"
        if storage.is_remote(target):
            storage.upload(file, target / name)
        else:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.move(file, Path(target) / name)
