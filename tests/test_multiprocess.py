"""Two processes × 4 CPU devices (gloo) train exactly like one process × 8 devices: the multi-host path works,
with the output dir and the token cache in a bucket (the GCS emulator of conftest.py) as on a TPU pod, across a
--batch_size_ramp's change of batch."""

import json
import os
import socket
import subprocess

import pytest
from conftest import COMPILE_FLAGS, REPO, STDLIB_JSON, read_metrics

from spmdlm import storage
from spmdlm.launch import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tiny_gpt2_config, gcs_bucket):
    flags = [
        "--mesh",
        "data=2,fsdp=4",
        "--train_file",
        STDLIB_JSON,
        "--config_name",
        str(tiny_gpt2_config),
        "--block_size",
        "32",
        "--max_steps",
        "4",
        "--batch_size_ramp",  # 32 then 64 sequences: each host's rows of each batch size, as one process reads them
        "0:32,2:64",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--eval_steps",
        "2",
        "--max_eval_samples",
        "32",
    ]
    env = {**os.environ, "XLA_FLAGS": COMPILE_FLAGS}  # each process simulates its own devices
    multi_out = f"{gcs_bucket}/multi"
    multi = subprocess.run(
        [
            "bash",
            "launch/local_multiprocess.sh",
            "2",
            "4",
            "--",
            *flags,
            "--output_dir",
            multi_out,
            "--cache_dir",
            f"{gcs_bucket}/multi-cache",
            "--profile_steps",
            "3",
            "--profile_all_hosts",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "SPMDLM_COORDINATOR_PORT": str(free_port()), "SPMDLM_LOCAL_CACHE": str(tmp_path / "local")},
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    traces = storage.files_under(f"{multi_out}/tensorboard/plugins/profile/steps_3-3")
    assert sorted(p.name.rsplit("-", 1)[1] for p in traces if p.name.endswith(".xplane.pb")) == [
        "p0.xplane.pb",
        "p1.xplane.pb",
    ]  # --profile_all_hosts: one trace per process, in one run folder
    # The one-process reference runs in this process (its 8 simulated devices): no second interpreter to start.
    assert main([*flags, "--output_dir", str(tmp_path / "single"), "--cache_dir", str(tmp_path / "cache")]) == 0
    pick = lambda metrics: [
        (m["step"], m.get("loss", m.get("eval_loss"))) for m in metrics if "loss" in m or "eval_loss" in m
    ]
    multi_lines = storage.path(f"{multi_out}/metrics.jsonl").read_text().splitlines()
    multi_metrics = pick(json.loads(line) for line in multi_lines)
    single_metrics = pick(read_metrics(tmp_path / "single"))
    assert [s for s, _ in multi_metrics] == [s for s, _ in single_metrics]
    for (_, a), (_, b) in zip(multi_metrics, single_metrics):
        assert a == pytest.approx(b, rel=1e-5)
    assert storage.path(f"{multi_out}/hf/model.safetensors").is_file()
    assert json.loads(storage.path(f"{multi_out}/run_config.json").read_text())["global_batch"] == 64
    assert {p.name for p in storage.files_under(f"{gcs_bucket}/multi-cache")} >= {"dataset.json", "train-00000.tokens"}
