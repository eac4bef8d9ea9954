"""The process's allocator, set before anything else runs: glibc's malloc on transparent huge pages.

XLA:CPU allocates a step's temporaries afresh every step (T5-base at batch 4: ~1.3 GiB) and glibc hands large
blocks back to the kernel when they are freed, so every step faults its temporaries in again, 4 KiB at a time: 3.4
M minor faults in a 10-step T5-base run. With glibc's `glibc.malloc.hugetlb=1` tunable (glibc 2.35+) malloc asks for
transparent huge pages (2 MiB), which the kernel grants in its default `madvise` mode: 0.18 M faults, the same
resident memory, +2-11% tokens/s at the base sizes on a 2-core CPU (benchmarks/README.md). A tunable is read when
the process starts, so the launcher restarts itself once with it set (the same PID, arguments and environment).

Nothing happens where it cannot help: another OS or C library, huge pages `never` (or `always`: already on), a
preloaded allocator (jemalloc, tcmalloc), a tunable the user set, or SPMDLM_HUGE_PAGES=0.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT_ENV = "SPMDLM_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """The kernel's transparent huge page mode, the bracketed word of `always [madvise] never`; '' if unknown."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def huge_page_environment(
    environ: dict[str, str], *, system: str, libc: tuple[str, str], thp_mode: str
) -> dict[str, str] | None:
    """The environment to restart with for huge-page malloc, or None where that would change nothing."""
    name, version = libc
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (
        system != "Linux"
        or name != "glibc"
        or numbers < (2, 35)
        or thp_mode != "madvise"
        or environ.get(OPT_OUT_ENV) == "0"
        or "malloc" in environ.get("LD_PRELOAD", "")
        or "glibc.malloc.hugetlb" in tunables
    ):
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def restart_with_huge_page_malloc() -> None:
    """Re-execute this Python command (sys.orig_argv) with huge-page malloc where it helps; else return."""
    environ = huge_page_environment(
        dict(os.environ), system=platform.system(), libc=platform.libc_ver(), thp_mode=_thp_mode()
    )
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:  # no interpreter to run again: carry on with the allocator as it is
        return
