"""A multi-host job that loses a process stops: the others exit non-zero in bounded time, naming the lost one."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import COMPILE_FLAGS, FIXTURES, REPO

HEARTBEAT_TIMEOUT_S = 10  # SPMDLM_HEARTBEAT_TIMEOUT: 60 s by default; short here to keep the test short


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_killing_one_process_stops_the_other_naming_it(tmp_path, tiny_gpt2_config):
    port = free_port()
    flags = [
        "--mesh",
        "data=2",
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--config_name",
        str(tiny_gpt2_config),
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "100000",
        "--save_steps",
        "100000",
        "--logging_steps",
        "1",
        "--do_eval",
        "false",
        "--no_export_hf",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": COMPILE_FLAGS,
        "JAX_PLATFORMS": "cpu",
        "SPMDLM_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
    }
    logs = [(open(tmp_path / f"p{i}.out", "w+"), open(tmp_path / f"p{i}.err", "w+")) for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spmdlm.launch",
                "--coordinator_address",
                f"127.0.0.1:{port}",
                "--num_processes",
                "2",
                "--process_id",
                str(i),
                *flags,
            ],
            cwd=REPO,
            env=env,
            stdout=logs[i][0],
            stderr=logs[i][1],
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "out" / "metrics.jsonl"
        while not (metrics.exists() and '"loss"' in metrics.read_text()):  # process 0 logged its first step
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "no first step in 300 s"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = (tmp_path / "p0.err").read_text()
    assert code == 4, err[-3000:]
    assert "error: process 0 of 2: lost process 1" in err
    assert elapsed < HEARTBEAT_TIMEOUT_S + 30, f"took {elapsed:.0f} s"
    print(f"process 0 stopped {elapsed:.1f} s after process 1 was killed")
