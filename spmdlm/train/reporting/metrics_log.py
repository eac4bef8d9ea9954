"""The run's JSON-lines logs (metrics.jsonl, samples.jsonl) and the highest step it reached (highest_step.json):
appended by process 0, repaired after a crash tore a line, cut back on a resume.

An output dir in a bucket (gs://) gets the same files: they are written in a local staging folder (objects cannot be
appended to) and uploaded when they changed, at most every SYNC_SECONDS, at each checkpoint and at the end (`sync`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from spmdlm import storage
from spmdlm.crashpoints import crash_point

log = logging.getLogger("spmdlm")

SYNC_SECONDS = 30.0  # a bucket output dir's reports are uploaded at most this often (and at checkpoints, at the end)
HIGHEST_STEP_FILE = "highest_step.json"  # {"step": N}: what a resumed run computes again counts as restart loss


def finite_or_none(value: Any) -> Any:
    """Strict JSON has no NaN or infinity: such a value is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def strict_json(value: Any, **kwargs) -> str:
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def write_json(path: Path, value: Any, point: str | None = None) -> None:
    """Written whole or not at all (write-then-rename; one upload to a bucket), so a crash never leaves half a file;
    `point`: its name in spmdlm.crashpoints."""
    storage.write_atomic(path, strict_json(value, indent=2), point)


def read_records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a JSON-lines file of ours (metrics.jsonl, samples.jsonl). A line that is not a
    record — the torn last line of a run that crashed mid-write, or what was appended to one — is dropped with one
    warning: the file is ours to repair, never a reason to stop."""
    records, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append((line, record))
        else:
            dropped += 1
    if dropped:
        log.warning(
            "%s: dropped %d unreadable line%s (torn by a crash mid-write)", path, dropped, "" if dropped == 1 else "s"
        )
    return records


def repair_torn_tail(path: Path) -> None:
    """Before appending: a last line without its newline (a crash mid-write) is finished if it is a whole record,
    else cut off (one warning), so the next record starts on a line of its own."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, 2)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        start = _last_line_start(f, end)
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            f.write(b"\n")
        else:
            f.truncate(start)
            log.warning("%s: dropped its torn last line (%d bytes, a crash mid-write)", path, end - start)


def _last_line_start(f, end: int) -> int:
    """The offset after the last newline before `end`, read back a block at a time (0 if none)."""
    start = end
    while start > 0:
        block = min(start, 1 << 16)
        f.seek(start - block)
        at = f.read(block).rfind(b"\n")
        if at >= 0:
            return start - block + at + 1
        start -= block
    return 0


class MetricsLog:
    """The JSON-lines files of the output dir `target`, in `self.out`: the output dir itself, or a local staging
    folder for a bucket. Disabled (every call a no-op) on processes other than 0."""

    def __init__(self, target, enabled: bool, staged: Iterable[str] = ()):
        """`staged`: other files of ours a bucket output dir's staging folder starts with (a resumed run continues
        them: the trackers' ids)."""
        self.target, self.enabled = target, enabled
        self.out = self._stage(target, staged) if enabled and storage.is_remote(target) else target
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._repaired: set[str] = set()  # the files whose torn tail (if any) was repaired (append)
        self._last_sync = time.perf_counter()

    @staticmethod
    def _stage(target, staged: Iterable[str]) -> Path:
        local = Path(tempfile.mkdtemp(prefix="spmdlm-report-"))
        for name in ("metrics.jsonl", "samples.jsonl", HIGHEST_STEP_FILE, *staged):
            if (target / name).is_file():
                storage.download(target / name, local / name, progress=False)
        return local

    @property
    def staging(self) -> bool:
        return self.out is not self.target

    def append(self, name: str, value: dict[str, Any]) -> None:
        """One record onto a JSON-lines file; the first append of a run repairs a tail a crash tore."""
        if not self.enabled:
            return
        path = self.out / name
        if name not in self._repaired:
            repair_torn_tail(path)
            self._repaired.add(name)
        line = strict_json(value) + "\n"
        try:
            crash_point("metrics.before_append", path)
            with open(path, "a") as f:
                f.write(line)
        except OSError as e:
            if not storage.no_space(e):
                raise
            raise storage.disk_full(path, len(line.encode())) from None

    def records(self, name: str = "metrics.jsonl") -> list[dict]:
        path = self.out / name
        return [record for _, record in read_records(path)] if path.is_file() else []

    def truncate_after(self, step: int) -> None:
        """On resume, drop logged lines past the checkpoint: those steps are about to be run again."""
        for path in (self.out / "metrics.jsonl", self.out / "samples.jsonl"):
            if self.enabled and path.exists():
                lines = [line for line, record in read_records(path) if record["step"] <= step]
                storage.write_atomic(path, "".join(line + "\n" for line in lines))  # a crash keeps all or none

    def reached(self, step: int) -> None:
        """Record that the run reached `step` (every step: a few bytes; a crash leaves the last one written)."""
        if self.enabled:
            (self.out / HIGHEST_STEP_FILE).write_text(json.dumps({"step": step}))

    def highest_step(self) -> int:
        """The highest step a run in this output dir reached (0 when none was recorded, or the file is damaged)."""
        try:
            step = json.loads((self.out / HIGHEST_STEP_FILE).read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            return 0
        return step if isinstance(step, int) else 0

    def sync(self, force: bool = True, before: Callable[[], None] = lambda: None) -> None:
        """Upload the staged files that changed (a bucket output dir; nothing to do for a local one); `before`
        flushes what writes into the staging folder besides (the trackers)."""
        if not self.staging or (not force and time.perf_counter() - self._last_sync < SYNC_SECONDS):
            return
        before()
        for file in sorted(p for p in self.out.rglob("*") if p.is_file()):
            name = file.relative_to(self.out).as_posix()
            stat = file.stat()
            if self._uploaded.get(name) != (stat.st_size, stat.st_mtime_ns):
                storage.upload(file, self.target / name)
                self._uploaded[name] = (stat.st_size, stat.st_mtime_ns)
        self._last_sync = time.perf_counter()

    def close(self) -> None:
        """The last upload, and the staging folder removed: everything is in the bucket now."""
        if self.enabled and self.staging:
            self.sync()
            shutil.rmtree(self.out, ignore_errors=True)
            self.out = self.target
