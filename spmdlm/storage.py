"""One path abstraction for every file a run reads or writes: local paths and gs:// buckets (docs/tpu.md).

`path(p)` is a `pathlib.Path` for a local path (exactly as before) and an `etils.epath.Path` for a `gs://` URL: the
path type orbax itself uses, here backed by gcsfs. Both have the pathlib methods the code uses (`/`, exists,
is_dir, iterdir, open, read_text, write_text, ...); what pathlib spells through `os`/`shutil` is here: rmtree,
move, remove, size, atomic and exclusive writes, downloads and uploads. Arrays of checkpoints go through
tensorstore, which talks to GCS itself (Application Default Credentials, or `TENSORSTORE_GCS_HTTP_URL`).

gs:// needs the `gcs` extra (`pip install 'spmdlm[gcs]'`); without it, or without credentials, or for a bucket that
does not exist, the first gs:// path is refused in one line (StorageError, exit 2). A GCS emulator is used when
STORAGE_EMULATOR_HOST is set (as Google's own client libraries do): anonymous access, and tensorstore pointed at it.

Atomicity on GCS: an object appears whole or not at all, so results are written in one request (no rename, which
GCS does not have); the run lock is created with `ifGenerationMatch=0`, GCS's create-if-absent.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import glob as globlib
import hashlib
import importlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

from spmdlm.crashpoints import crash_point
from spmdlm.errors import StorageError

log = logging.getLogger(__name__)

GCS_HINT = "pip install 'spmdlm[gcs]'"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
SCHEME = "gs://"


def is_url(p) -> bool:
    return "://" in str(p)


def is_remote(p) -> bool:
    return str(p).startswith(SCHEME)


def inside(name: object) -> bool:
    """Whether `name`, a file name read from a checkpoint or a dataset (an index's shard, an export marker's file, a
    dataset card's shard), stays inside that folder: a relative path without `..` (nor a drive, a URL or a backslash),
    judged by its words alone, so a folder of links (the Hub cache's snapshots, whose files link to its blobs) reads as
    before. A file path read from a checkpoint stays inside that checkpoint (docs/troubleshooting.md)."""
    if not isinstance(name, str) or not name or any(c in name for c in ("\\", "\0", "://")):
        return False
    pure = PurePosixPath(name)
    return not pure.is_absolute() and ".." not in pure.parts and not PureWindowsPath(name).drive


def path(p, what: str = "path"):
    """A local path as `pathlib.Path`; a gs:// URL as `epath.Path` once the bucket is known to be usable.
    `what` names the flag in errors (e.g. "--output_dir")."""
    text = os.fspath(p)
    if not is_url(text):
        return Path(text)
    if not text.startswith(SCHEME):
        raise StorageError(f"{what} {text}: only gs:// URLs are read and written; give a gs:// or a local path")
    bucket = text[len(SCHEME) :].split("/", 1)[0]
    if not bucket:
        raise StorageError(f"{what} {text}: no bucket name; give gs://BUCKET/PATH")
    check_bucket(bucket, what)
    from etils import epath

    return epath.Path(text)


@functools.cache
def filesystem():
    """The gcsfs filesystem (the same instance epath's gs:// paths use), configured once per process."""
    emulator = os.environ.get(EMULATOR_ENV)
    if emulator:
        url = emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)  # orbax's arrays: tensorstore's own GCS client
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # ... anonymous, no credential search
        # gcsfs's experimental zonal-bucket probe is a gRPC call an emulator cannot answer (a 60 s timeout)
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        for module in ("gcsfs", "etils.epath"):
            importlib.import_module(module)
        import fsspec
    except ImportError as e:
        raise StorageError(f"gs:// paths need the gcs extra ({e.name} is missing): {GCS_HINT}") from None
    if emulator:  # the plain JSON-API client, even where gcsfs was imported before the variable above was set
        from gcsfs.core import GCSFileSystem

        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
    token = "anon" if emulator else _default_credentials()
    fsspec.config.conf.setdefault("gcs", {}).update(token=token)  # also for the instances epath creates
    return fsspec.filesystem("gcs", finalize_on_close=True)  # epath's arguments: the same cached instance


def _default_credentials() -> str:
    """Application Default Credentials (a VM's service account, `gcloud auth application-default login`, or the key
    file in GOOGLE_APPLICATION_CREDENTIALS), refused in one line when there are none."""
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        google.auth.default()
    except DefaultCredentialsError as e:
        first = str(e).strip().partition("\n")[0]
        raise StorageError(
            f"gs:// paths need Google Cloud credentials and none were found ({first}); run "
            "`gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a "
            "service-account key file, or run on a VM whose service account may use the bucket"
        ) from None
    return "google_default"


@functools.cache
def check_bucket(bucket: str, what: str = "path") -> None:
    fs = filesystem()
    try:
        found = fs.exists(bucket)
    except OSError as e:  # 403: the credentials may not see it
        first = str(e).strip().partition("\n")[0]
        raise StorageError(
            f"{what} gs://{bucket}: cannot reach the bucket ({first}); check that these credentials may use it"
        ) from None
    if not found:
        raise StorageError(
            f"{what} gs://{bucket}...: no such bucket (or these credentials cannot see it); create "
            f"it (gcloud storage buckets create gs://{bucket}) or fix the path"
        )


def _fs_path(p) -> str:
    return os.fspath(p)


# -- what pathlib spells through os/shutil -----------------------------------------------------------------------


def size(p) -> int:
    if is_remote(p):
        return int(filesystem().size(_fs_path(p)))
    return Path(p).stat().st_size


def mtime_ns(p) -> int:
    """Modification time in ns (GCS: the object's last update)."""
    if is_remote(p):
        info = filesystem().info(_fs_path(p))
        updated = info.get("mtime") or info.get("updated")
        return int(updated.timestamp() * 1e9) if hasattr(updated, "timestamp") else 0
    return Path(p).stat().st_mtime_ns


def absolute(p):
    return p if is_remote(p) else Path(p).absolute()


def rmtree(p) -> None:
    if is_remote(p):
        filesystem().rm(_fs_path(p), recursive=True)
    elif Path(p).is_dir():
        shutil.rmtree(p)
    else:
        Path(p).unlink(missing_ok=True)


def remove(p) -> None:
    """Remove a file or a directory tree if it is there."""
    if is_remote(p):
        fs = filesystem()
        if fs.exists(_fs_path(p)):
            fs.rm(_fs_path(p), recursive=True)
    else:
        rmtree(p)


def move(source, target) -> None:
    """Move a file or directory (GCS: copy, then delete the source)."""
    if is_remote(source):
        filesystem().mv(_fs_path(source), _fs_path(target), recursive=True)
    else:
        shutil.move(str(source), str(target))


def write_atomic(p, data: str | bytes, point: str | None = None) -> None:
    """Write a whole file so that a reader never sees half of it: local, write-then-rename; GCS, one upload (an
    object appears whole or not at all). A full disk: `disk_full`'s line, the file as it was. `point`: the write's
    name in spmdlm.crashpoints."""
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(p):
        filesystem().pipe_file(_fs_path(p), raw)
        return
    p = Path(p)
    tmp = p.with_name(p.name + ".tmp")
    try:
        crash_point(point, p)
        tmp.write_bytes(raw)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a full disk: nothing half-written is left, the file before is kept
        if no_space(e):
            raise disk_full(p, len(raw)) from None
        raise
    os.replace(tmp, p)


def create_exclusive(p, data: str) -> None:
    """Create a file that must not exist yet (FileExistsError if it does): O_EXCL locally, `ifGenerationMatch=0`
    on GCS. One request either way, so two runs racing for it cannot both succeed."""
    if is_remote(p):
        fs = filesystem()
        if fs.exists(_fs_path(p)):  # the precondition decides; this spares a request (and covers emulators)
            raise FileExistsError(_fs_path(p))
        fs.pipe_file(_fs_path(p), data.encode(), mode="create")
        return
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(data)


def glob(pattern: str) -> list:
    """Matching paths, sorted; gs:// patterns through gcsfs."""
    if is_remote(pattern):
        path(pattern)  # checks the bucket
        return [path(SCHEME + m) for m in sorted(filesystem().glob(pattern))]
    return [Path(m) for m in sorted(globlib.glob(pattern, recursive=True))]


def files_under(folder) -> list:
    """Every file under a gs:// folder, sorted (GCS has no directories: every object under the prefix)."""
    return [path(SCHEME + m) for m in sorted(filesystem().find(_fs_path(folder)))]


# -- moving data between a bucket and local disk -------------------------------------------------------------------


def download(source, target: Path, *, progress: bool | None = None, desc: str | None = None) -> str:
    """Copy one remote file to a local path (through a temporary name: a killed copy leaves no partial file);
    returns its sha256. `progress`: a byte progress bar (None: on a terminal only)."""
    from tqdm import tqdm

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    total = size(source)
    try:
        with (
            tqdm(
                total=total,
                desc=desc or f"copying {Path(str(source)).name}",
                unit="B",
                unit_scale=True,
                leave=False,
                disable=None if progress is None else not progress,
            ) as bar,
            path(source).open("rb") as src,
            open(tmp, "wb") as dst,
        ):
            while chunk := src.read(8 << 20):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


def upload(source: Path, target) -> None:
    """Copy a local file or directory tree to a gs:// path."""
    source = Path(source)
    if source.is_dir():
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            upload(file, path(target) / file.relative_to(source).as_posix())
        return
    filesystem().put_file(str(source), _fs_path(target))


_TEMP_DIRS: list[str] = []


def _temp_dir(prefix: str) -> Path:
    folder = tempfile.mkdtemp(prefix=prefix)
    if not _TEMP_DIRS:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _TEMP_DIRS])
    _TEMP_DIRS.append(folder)
    return Path(folder)


def local_copy(p) -> Path:
    """A local path holding `p`'s content: `p` itself when local; else a copy of the file or directory in a
    temporary folder removed when the process exits (for readers that only take local files: safetensors, the
    SentencePiece converter)."""
    if not is_remote(p):
        return Path(p)
    remote = path(p)
    local = _temp_dir("spmdlm-gcs-") / remote.name
    if remote.is_dir():
        for file in files_under(remote):
            download(file, local / str(file)[len(str(remote)) + 1 :], progress=False)
    elif remote.exists():
        download(remote, local, progress=False)
    return local


@contextlib.contextmanager
def writing_dir(out) -> Iterator[Path]:
    """A local directory to write `out`'s files into: `out` itself, or for a gs:// `out` a temporary one whose
    files are uploaded when the block ends without error."""
    if not is_remote(out):
        Path(out).mkdir(parents=True, exist_ok=True)
        yield Path(out)
        return
    local = Path(tempfile.mkdtemp(prefix="spmdlm-upload-"))
    try:
        yield local
        upload(local, out)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def local_cache_root() -> Path:
    """Where copies of bucket files live on this host (SPMDLM_LOCAL_CACHE, default ~/.cache/spmdlm/gcs)."""
    return Path(os.environ.get("SPMDLM_LOCAL_CACHE") or Path.home() / ".cache" / "spmdlm" / "gcs")


def local_mirror(p) -> Path:
    """The local folder that mirrors the gs:// folder `p` on this host (gs://b/x -> LOCAL_CACHE/b/x)."""
    return local_cache_root() / str(p)[len(SCHEME) :]


def file_sha256(path: Path) -> str:
    """The hex sha256 of a local file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def no_space(e: BaseException) -> bool:
    """Whether a write failed on a full disk: an OSError's errno, or the words of the errors that carry none
    (safetensors' SafetensorError)."""
    text = str(e).lower()
    return getattr(e, "errno", None) == errno.ENOSPC or "no space left" in text or "os error 28" in text


def free_bytes(p) -> int | None:
    """The bytes free on the local disk that holds `p` (its nearest existing folder); None for a bucket."""
    if is_remote(p):
        return None
    folder = Path(p).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def space_note(p, needed: int | None = None, *, more: bool = False) -> str:
    """What a full-disk line says of the space: the bytes the write needed (where known; `more`: at least those,
    what it had written when the disk filled) and those free."""
    free = free_bytes(p)
    parts = [f"it needs {'more than ' if more else ''}{needed:,} bytes"] if needed else []
    parts += [f"{free:,} are free there"] if free is not None else []
    return ", ".join(parts) or "the bucket refused the write"


def full_disk_clause(p, needed: int | None = None) -> str:
    """What a full-disk line says before its fix: the path and the bytes (`space_note`)."""
    return f"cannot write {p}: no space left on device ({space_note(p, needed)})"


def disk_full(p, needed: int | None = None) -> StorageError:
    """The one line of a write that found the disk full: the path, the bytes (`space_note`) and the fix."""
    return StorageError(f"{full_disk_clause(p, needed)}; free some space and run the same command again")


def os_error_line(e: OSError) -> str:
    """What a command line says of an OSError no writer turned into its own line: a full disk as `disk_full`
    (the path and the bytes), anything else in the OS's words."""
    return str(disk_full(e.filename)) if no_space(e) and e.filename else str(e)


# -- writing a directory whole: into a temporary sibling, then swapped in ---------------------------------------------


def remove_stale_temps(folder: Path, pattern: str, host: str) -> None:
    """Remove what killed writers on this host left in `folder`: the temp files and dirs named `pattern` (a glob) +
    ".tmp-HOST-PID" whose process is gone; a running writer keeps its own."""
    for stale in folder.glob(f"{pattern}.tmp-{globlib.escape(host)}-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            log.info("removing %s, left by an interrupted write", stale)
            rmtree(stale)


def _sibling(out: Path, kind: str) -> Path:
    """A hidden sibling of `out` only this process of this host uses: `.NAME.KIND-HOST-PID`."""
    return out.with_name(f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


@contextlib.contextmanager
def staging(out, unwritable: Callable[[str], Exception]) -> Iterator[Path]:
    """A fresh local directory to write `out`'s new content into, for `swap_in`, removed when the block ends: for a
    local `out` the hidden sibling `.NAME.tmp-HOST-PID` (the same filesystem, so the swap is one rename; what killed
    writers of this host left beside `out` is removed first), for a gs:// `out` a local temporary directory.
    Making it fails, or the block fails on a full disk: `unwritable(reason)` is raised ("no space left on device",
    or the OS's words)."""
    remote = is_remote(out)
    try:
        if remote:
            tmp = Path(tempfile.mkdtemp(prefix="spmdlm-staging-")) / path(out).name
        else:
            out = Path(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            for kind in ("", ".old"):
                remove_stale_temps(out.parent, f".{globlib.escape(out.name)}{kind}", socket.gethostname())
            tmp = _sibling(out, "tmp")
            rmtree(tmp)  # an earlier process of this pid's
        tmp.mkdir()
    except OSError as e:
        raise unwritable(e.strerror or str(e)) from None
    try:
        yield tmp
    except OSError as e:
        if not no_space(e):
            raise
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        raise unwritable(f"no space left on device ({space_note(tmp.parent, written, more=True)})") from None
    finally:
        shutil.rmtree(tmp.parent if remote else tmp, ignore_errors=True)


def swap_in(tmp: Path, out, *, last: str, whole: bool = True, replaces: Callable[[Path], bool] | None = None) -> bool:
    """Put the finished directory `tmp` at `out` so that `out` holds its `last` file (a card, a marker) only over
    whole content. A local `out`, `whole`: one rename; what `out` held is moved aside first and removed after, or put
    back when `replaces(aside)` says it is not what the caller meant to replace (another writer's, put there
    meanwhile). Of two writers racing for one `out`, one rename wins. Otherwise (gs://, which has no rename; a local
    `out` that holds other files too: not `whole`) file by file: the old `last` first, with `whole` all the rest of
    `out` too, then the new files, `last` last. -> False when `out` keeps another writer's content."""
    if is_remote(out) or not whole:
        _put_files(tmp, out, last, clear=whole)
        return True
    out, aside = Path(out), None
    if out.is_dir() and any(out.iterdir()):
        aside = _sibling(out, "old.tmp")
        try:
            os.rename(out, aside)
        except FileNotFoundError:  # removed meanwhile
            aside = None
        if aside is not None and replaces is not None and not replaces(aside):
            os.rename(aside, out)
            return False
    try:
        os.rename(tmp, out)  # over an empty directory or nothing; fails over another writer's content
    except OSError as e:
        raced = e.errno in (errno.ENOTEMPTY, errno.EEXIST)
        if aside is not None and not raced:
            os.rename(aside, out)
            aside = None
        if not raced:
            raise
        return False
    finally:
        if aside is not None:  # what this writer replaced (or, after a race, what was to go anyway)
            shutil.rmtree(aside, ignore_errors=True)
    return True


def _put_files(tmp: Path, out, last: str, clear: bool) -> None:
    remote = is_remote(out)
    remove(path(out) / last)
    if clear:
        remove(out)
    for file in sorted((p for p in tmp.rglob("*") if p.is_file()), key=lambda p: (p.relative_to(tmp) == Path(last), p)):
        target = path(out) / file.relative_to(tmp).as_posix()
        if remote:
            upload(file, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)


RUN_LOCK_NAME = "run.lock"  # OUTPUT_DIR's, held by the run writing there (spmdlm/train/safety/guard.py)


def lock_holder(p) -> tuple[str | None, int | None, str]:
    """(host, pid, start time) written in a lock file; (None, None, "?") when it cannot be read."""
    try:
        holder = json.loads(path(p).read_text())
        return holder["host"], int(holder["pid"]), holder.get("started", "?")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None, "?"


def held_by_another(p) -> bool:
    """Whether the lock file `p` is another process's that may be alive (another host's: it may be)."""
    if not path(p).exists():
        return False
    host, pid, _ = lock_holder(p)
    return not (host == socket.gethostname() and (pid == os.getpid() or not pid_alive(pid)))


def pid_alive(pid: int) -> bool:
    """Whether the process `pid` of this host still runs (the owner of a lock or temp file we find)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return not is_zombie(pid)


def symlink_loop(path) -> bool:
    """A local symlink that never reaches a file (a -> b -> a): not missing, so not to be called 'no such file'."""
    if is_remote(path) or not Path(path).is_symlink():
        return False
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def is_zombie(pid: int) -> bool:
    """A process that has ended but whose parent has not collected it yet (a kill -9 moments ago): it answers
    os.kill like a live one, but holds nothing. Linux's /proc says so; elsewhere assume not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the state follows the command name in parentheses
