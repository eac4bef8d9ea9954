"""Two processes × 4 CPU devices (gloo) train exactly like one process × 8 devices: the multi-host path works."""

import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, read_metrics

STDLIB_JSON = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tiny_gpt2_config):
    flags = ["--mesh", "data=2,fsdp=4", "--train_file", STDLIB_JSON, "--config_name", str(tiny_gpt2_config),
             "--block_size", "32", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
             "--eval_steps", "2", "--max_eval_samples", "32", "--cache_dir", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    multi = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "4", "--", *flags, "--output_dir",
                            str(tmp_path / "multi")], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**env, "SPMDLM_COORDINATOR_PORT": str(free_port())})
    assert multi.returncode == 0, multi.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "spmdlm.launch", *flags, "--output_dir", str(tmp_path / "single")],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    pick = lambda out: [(m["step"], m.get("loss", m.get("eval_loss"))) for m in read_metrics(out)
                        if "loss" in m or "eval_loss" in m]
    multi_metrics, single_metrics = pick(tmp_path / "multi"), pick(tmp_path / "single")
    assert [s for s, _ in multi_metrics] == [s for s, _ in single_metrics]
    for (_, a), (_, b) in zip(multi_metrics, single_metrics):
        assert a == pytest.approx(b, rel=1e-5)
    assert (tmp_path / "multi" / "hf" / "model.safetensors").exists()
    assert json.loads((tmp_path / "multi" / "run_config.json").read_text())["global_batch"] == 64
