"""What keeps a run from losing work: one run per output dir (a lock file) and a clean stop on SIGTERM/SIGINT.

TPU VMs and SLURM send SIGTERM before taking a machine away; the train loop then saves a checkpoint at the current
step and exits 143 (130 for Ctrl-C). In a multi-process run every process must save at the same step: JAX's
preemption service (started by `jax.distributed.initialize`) catches SIGTERM, tells every process, and names the
step at which all of them stop (`reached_preemption_sync_point`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from spmdlm import storage
from spmdlm.errors import ArgumentError, LockError

log = logging.getLogger("spmdlm")

LOCK_NAME = storage.RUN_LOCK_NAME


class RunLock:
    """OUTPUT_DIR/run.lock (host, pid, start time), created atomically before anything else is written there.

    A lock left by a dead process on this host is taken over with a warning; a live holder, or one on another
    host (whose process we cannot see), is refused in one line. Released (and a dir we created but left empty
    removed) on exit, whatever happened. In a bucket the lock object is created with GCS's create-if-absent
    precondition (storage.create_exclusive).
    """

    def __init__(self, out: Path, enabled: bool = True):
        self.out, self.enabled = storage.path(out), enabled
        self.path = self.out / LOCK_NAME
        self.folder = self.out  # the folder made for the lock file
        self._created_dirs: list = []  # those this lock made, deepest first (the output dir, then e.g. runs/)

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        try:
            self._created_dirs = [] if storage.is_remote(self.folder) else _missing_dirs(Path(self.folder))
            self.folder.mkdir(parents=True, exist_ok=True)
            self._create()
        except FileExistsError:
            self._take_over_stale()
        except OSError as e:
            self._remove_created_dir()
            raise LockError(f"cannot write in {self._where} ({e.strerror or e}); choose a writable directory") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.path.unlink(missing_ok=True)
            self._remove_created_dir()

    def _create(self) -> None:
        storage.create_exclusive(
            self.path,
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            ),
        )

    @property
    def _where(self) -> str:
        return f"--output_dir {self.out}"

    def _in_use(self, who: str, gone: str) -> str:
        return (
            f"--output_dir {self.out} is in use by another run ({who}); wait for it to finish or "
            f"choose another --output_dir{gone}"
        )

    def _take_over_stale(self) -> None:
        host, pid, started = storage.lock_holder(self.path)
        if host == socket.gethostname() and (pid == os.getpid() or not storage.pid_alive(pid)):
            log.warning("taking over the lock of a run that is gone (pid %s, started %s) in %s", pid, started, self.out)
            self.path.unlink(missing_ok=True)
            self._create()
            return
        who = f"pid {pid} on host {host}, started {started}" if host else "a run whose lock file is unreadable"
        gone = "" if host == socket.gethostname() else f"; if that run is gone, delete {self.path}"
        raise LockError(self._in_use(who, gone))

    def _remove_created_dir(self) -> None:
        """A refused run leaves the disk as it was: the dirs it made, while empty (a bucket has no empty dirs)."""
        for folder in self._created_dirs:
            if not folder.is_dir() or any(folder.iterdir()):
                return
            folder.rmdir()


class ExportLock(RunLock):
    """python -m spmdlm.export's lock on its --out: OUT.export.lock beside the folder (inside it, the lock would
    make --out look taken), so that a second export into the same folder refuses in one line instead of both
    reporting success and one replacing the other's files. Same rules as RunLock (a dead holder's is taken over)."""

    SUFFIX = ".export.lock"

    def __init__(self, out, enabled: bool = True):
        super().__init__(out, enabled)
        target = storage.absolute(self.out)  # "." has a name only as an absolute path
        self.path = target.parent / f"{target.name}{self.SUFFIX}"
        self.folder = target.parent

    @property
    def _where(self) -> str:
        return f"the folder of --out {self.out}"

    def _in_use(self, who: str, gone: str) -> str:
        return (
            f"--out {self.out} is being written by another export ({who}); wait for it to finish or choose "
            f"another --out{gone}"
        )


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


# The signals that end a run, each handled as a request to save and stop: SIGTERM (schedulers, preemption),
# SIGINT (Ctrl-C), SIGHUP (the terminal closed), SIGUSR1 (SLURM's --signal warning before the time limit), SIGXCPU
# (a CPU-time limit). Their default action would end the process with nothing saved and nothing said.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGXCPU)


class StopOnSignal:
    """While active: the first of STOP_SIGNALS asks the train loop to save and stop; a second SIGINT exits now.

    Single process: our own handlers. Several processes: SIGTERM is JAX's preemption notice (its handler is left in
    place) and the others are turned into one, so that every process stops at the same, agreed step.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        self._deadline: StopDeadline | None = None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for signum in (s for s in STOP_SIGNALS if not (self._multi and s == signal.SIGTERM)):
                self._previous[signum] = signal.signal(signum, self._handle)
            if not self._multi:  # several processes: the preemption service and the heartbeat stop them
                self._deadline = StopDeadline(stop_grace_seconds()).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._deadline is not None:
            self._deadline.close()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: no waiting for the save
        self.signum = signum
        log.warning(
            "%s received: saving a checkpoint at the end of this step (Ctrl-C again to quit at once)",
            signal.Signals(signum).name,
        )
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        """Called once per step (every process, same steps)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        if self.signum is not None and self._deadline is not None:
            self._deadline.close()  # the step ended: the save comes now
        return self.signum is not None

    @property
    def requested(self) -> bool:
        """A stop was asked for in this process (an evaluation in progress gives way to the save)."""
        return self.signum is not None


STOP_GRACE_ENV = "SPMDLM_STOP_GRACE_SECONDS"
STOP_GRACE_SECONDS = 60.0  # from a stop signal to the end of the step in which it came, before leaving unsaved


def stop_grace_seconds() -> float:
    value = os.environ.get(STOP_GRACE_ENV, "")
    try:
        seconds = float(value) if value else STOP_GRACE_SECONDS
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ArgumentError(f"{STOP_GRACE_ENV}={value!r} must be a positive number of seconds")
    return seconds


class StopDeadline:
    """A stop signal that finds the step stuck (a collective that never returns) still ends the process: a thread
    learns of the signal through Python's wakeup fd, written by the C-level handler even while the main thread is
    blocked in a call that never returns to Python, where the handler itself cannot run. If the step has not ended
    `seconds` after the signal (`close()`: the save begins), it says so in one line and leaves at once with the
    signal's status: the last checkpoint is kept, nothing half-saved is left."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._read, self._write = os.pipe()
        self._closed = threading.Event()
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._watch, name="spmdlm-stop-deadline", daemon=True)

    def start(self) -> StopDeadline:
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
        try:
            os.write(self._write, b"\0")  # wakes the thread if it still waits for a signal
        except BlockingIOError:
            pass  # the pipe is full: the thread has bytes to wake on
        # The pipe is closed here, after the thread has ended, never by the thread: a descriptor closed while
        # another thread may still use it can be reused meanwhile by a file opened elsewhere, and closed under it.
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    def _watch(self) -> None:
        signum = 0
        while signum not in STOP_SIGNALS and not self._closed.is_set():
            signum = os.read(self._read, 1)[0]
        if not self._closed.wait(self.seconds):
            self._leave(signum)

    def _leave(self, signum: int) -> None:
        try:  # the line may find stdout or stderr closed (a scheduler gone): the exit comes regardless
            sys.stdout.flush()
            print(
                f"error: {signal.Signals(signum).name} received, but the step in progress did not end within "
                f"{self.seconds:g} s (stuck in a collective?): exiting without a save; the last checkpoint is kept "
                f"and the same command resumes from it ({STOP_GRACE_ENV} sets the wait)",
                file=sys.stderr,
                flush=True,
            )
        finally:
            os._exit(128 + signum)
