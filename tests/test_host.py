"""spmdlm/host.py: the launcher restarts itself once with glibc's huge-page malloc where that helps, and never
elsewhere or twice."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from spmdlm import host

GLIBC = ("glibc", "2.36")


def test_a_linux_glibc_host_in_madvise_mode_gets_the_tunable_added_to_the_users():
    assert host.huge_page_environment({}, system="Linux", libc=GLIBC, thp_mode="madvise") == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"
    }
    kept = host.huge_page_environment(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"}, system="Linux", libc=GLIBC, thp_mode="madvise"
    )
    assert kept == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/h"}


@pytest.mark.parametrize(
    "environ, system, libc, thp_mode",
    [
        ({}, "Darwin", ("", ""), ""),  # another OS
        ({}, "Linux", ("", ""), "madvise"),  # musl
        ({}, "Linux", ("glibc", "2.34"), "madvise"),  # before the tunable
        ({}, "Linux", GLIBC, "never"),  # the kernel grants none
        ({}, "Linux", GLIBC, "always"),  # already huge pages
        ({}, "Linux", GLIBC, ""),  # unknown
        ({"SPMDLM_HUGE_PAGES": "0"}, "Linux", GLIBC, "madvise"),  # the user's opt-out
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "Linux", GLIBC, "madvise"),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "Linux", GLIBC, "madvise"),  # the user's own choice
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "Linux", GLIBC, "madvise"),  # after the restart: never twice
    ],
)
def test_no_restart_where_it_would_change_nothing_or_the_user_chose(environ, system, libc, thp_mode):
    assert host.huge_page_environment(environ, system=system, libc=libc, thp_mode=thp_mode) is None


def test_the_process_restarts_itself_once_with_its_arguments_where_this_host_allows():
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SPMDLM_HUGE_PAGES")}
    script = (
        "import os, sys; from spmdlm import host; host.restart_with_huge_page_malloc(); "
        "print(os.environ.get('GLIBC_TUNABLES', '-'), '|'.join(sys.argv[1:]))"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", script, "a b", "c"], env=environ, capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .split(" ", 1)
    )
    expected = host.huge_page_environment(
        environ, system=platform.system(), libc=platform.libc_ver(), thp_mode=host._thp_mode()
    )
    # Restarted with the tunable and the same arguments, or (a host that gains nothing) run on as it was.
    assert out == ["-" if expected is None else "glibc.malloc.hugetlb=1", "a b|c"]
