"""The memory gate of CPU devices compares a step with the RAM this process may still use: the host's available RAM
(MemAvailable, plus what the process holds already) or a container's memory limit (cgroup v2 memory.max, v1
memory.limit_in_bytes, of its group or a parent), whichever is less, and says which in its line; not the host's
total RAM, which a container or a busy host does not give."""

import jax
import pytest

from spmdlm import devices
from spmdlm.errors import RunError
from spmdlm.train.stages.program import check_memory

GiB = 2**30


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A fake /proc and /sys/fs/cgroup: 8 GiB available, 1 GiB resident, no cgroup limit unless written."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {8 * GiB // 1024} kB\n")
    (tmp_path / "proc" / "cgroup").write_text("0::/\n")
    (tmp_path / "cgroup").mkdir()
    monkeypatch.setattr(devices, "PROC_MEMINFO", tmp_path / "proc" / "meminfo")
    monkeypatch.setattr(devices, "PROC_SELF_CGROUP", tmp_path / "proc" / "cgroup")
    monkeypatch.setattr(devices, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(devices, "_resident_bytes", lambda: GiB)  # this process's resident memory
    return tmp_path


def test_available_ram_without_a_container_limit(host):
    (host / "cgroup" / "memory.max").write_text("max\n")
    assert devices.host_memory() == (9 * GiB, "the host's available RAM")


def test_a_cgroup_v2_limit_below_the_available_ram(host):
    (host / "proc" / "cgroup").write_text("0::/job/step\n")
    (host / "cgroup" / "job" / "step").mkdir(parents=True)
    (host / "cgroup" / "job" / "step" / "memory.max").write_text("max\n")
    (host / "cgroup" / "job" / "memory.max").write_text(f"{2 * GiB}\n")  # a parent's limit holds for its children
    limit, words = devices.host_memory()
    assert limit == 2 * GiB and words == f"the container's memory limit ({host / 'cgroup' / 'job' / 'memory.max'})"


def test_a_cgroup_v1_limit_and_its_unlimited_value(host):
    (host / "proc" / "cgroup").write_text("4:memory:/docker/abc\n0::/\n")
    (host / "cgroup" / "memory").mkdir()
    (host / "cgroup" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert devices.host_memory() == (9 * GiB, "the host's available RAM")
    (host / "cgroup" / "memory" / "docker" / "abc").mkdir(parents=True)
    (host / "cgroup" / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{3 * GiB}\n")
    assert devices.host_memory()[0] == 3 * GiB


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the gate of CPU devices")
def test_the_gate_refuses_with_what_it_compared_and_passes_what_fits(host):
    (host / "cgroup" / "memory.max").write_text(f"{GiB}\n")
    local = jax.local_device_count()
    need = GiB // local + GiB  # more than the limit shared out, less than the host's total or available RAM
    with pytest.raises(RunError) as refusal:
        check_memory({"total_bytes": need, "argument_bytes": 0, "temp_bytes": need}, per_device_batch=2)
    line = str(refusal.value)
    assert "\n" not in line
    assert f"but has 1.0 GiB of the container's memory limit ({host / 'cgroup' / 'memory.max'}) shared by {local}" in (
        line
    ), line
    (host / "cgroup" / "memory.max").write_text("max\n")
    check_memory({"total_bytes": need // 4, "argument_bytes": 0, "temp_bytes": 0}, per_device_batch=2)
    with pytest.raises(RunError, match=f"of the host's available RAM shared by {local} CPU devices"):
        check_memory({"total_bytes": 10 * GiB, "argument_bytes": 0, "temp_bytes": 0}, per_device_batch=2)
