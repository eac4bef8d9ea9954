"""The hang watchdog (--hang_timeout_minutes): a run in which no step, save or evaluation completes for that long is
stopped, so the scheduler restarts it and it resumes from its last checkpoint instead of holding its machines.

A collective waiting for a dead or stuck host never returns and cannot be interrupted from Python, so the watchdog is
a thread of its own: it writes every thread's Python stack to the log and to OUTPUT_DIR/hang-<host>.txt, says so in
one line on stderr and leaves with os._exit (HANG_EXIT_CODE). See docs/operations.md.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

from spmdlm import storage

log = logging.getLogger("spmdlm")

HANG_EXIT_CODE = 5
WRITE_GRACE_SECONDS = 60.0  # writing the stacks (a bucket that does not answer) may take this long before the exit


def host_label(process_index: int) -> str:
    """This process's name in the files it leaves (hang-<host>.txt, <host>.xplane.pb): hostname and process index,
    as several processes may share a machine."""
    return f"{socket.gethostname()}-p{process_index}"


def thread_stacks() -> str:
    """Every thread's Python stack, named, the innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """`beat(what)` after each completed step, save or evaluation; silent for `minutes` -> stacks, one line, exit.
    0 minutes: off (beat and close do nothing). `exit` is os._exit except in tests."""

    def __init__(self, minutes: float, out, host: str, exit: Callable[[int], None] = os._exit):
        self.seconds, self.out, self.host, self.exit = minutes * 60.0, out, host, exit
        self.last, self.what = time.monotonic(), "the watchdog's start"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spmdlm-hang-watchdog", daemon=True)
        if self.seconds:
            self._thread.start()

    def beat(self, what: str) -> None:
        self.last, self.what = time.monotonic(), what

    def close(self) -> None:
        self._closed.set()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        interval = min(max(self.seconds / 20, 0.05), 10.0)
        while not self._closed.wait(interval):
            silent = time.monotonic() - self.last
            if silent >= self.seconds:
                self._fire(silent)
                return

    def _fire(self, silent: float) -> None:
        path = self.out / f"hang-{self.host}.txt"
        stacks = thread_stacks()
        # the write may itself hang (a bucket that does not answer): the exit comes regardless
        deadline = threading.Timer(WRITE_GRACE_SECONDS, self.exit, (HANG_EXIT_CODE,))
        deadline.daemon = True
        deadline.start()
        try:
            log.error("no progress for %.0f s; every thread's stack:\n%s", silent, stacks)
            storage.write_atomic(path, f"no progress for {silent:.0f} s after {self.what}\n\n{stacks}")
            where = f"every thread's stack is in {path}"
        except Exception as e:  # noqa: BLE001 - leaving is what matters now; the log has the stacks
            where = f"every thread's stack is in the log ({path} could not be written: {e})"
        deadline.cancel()
        sys.stdout.flush()
        print(
            f"error: no step, save or evaluation completed for {silent / 60:.3g} minutes (--hang_timeout_minutes; "
            f"the last was {self.what}): {where}; exiting (code {HANG_EXIT_CODE}) so the run can be restarted "
            "from its last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        self.exit(HANG_EXIT_CODE)
