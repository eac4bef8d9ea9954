"""--report_to wandb and mlflow, offline and real: what the libraries themselves stored is read back and compared with
metrics.jsonl, across a resume. W&B runs in offline mode (its run files in OUTPUT_DIR/wandb, read with its own
protobuf records), MLflow in its local file store (OUTPUT_DIR/mlruns, read with MlflowClient); nothing touches the
network."""

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from conftest import COMPILE_FLAGS, FIXTURES, REPO, read_metrics, run_argv, run_killed_after_first_checkpoint

from spmdlm.cli.launch import masked
from spmdlm.errors import ArgumentError, RunError
from spmdlm.launch import main
from spmdlm.run_args import RunArgs
from spmdlm.train.reporting import metrics_log, trackers
from spmdlm.train.reporting import report as report_module
from spmdlm.train.reporting.report import Reporter, RunShape

wandb = pytest.importorskip("wandb", reason="the wandb extra (pip install -e '.[wandb]')")
mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (pip install -e '.[mlflow]')")


@pytest.fixture
def offline(monkeypatch, tmp_path_factory):
    """W&B offline and quiet, its caches in a temporary folder, MLflow on its default local store without
    telemetry; after the test, no W&B service process is left behind."""
    home = tmp_path_factory.mktemp("wandb-home")
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(key, value)
    for key in (
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_DIR",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(key, raising=False)
    # unset, so the run's own opt-in to MLflow's file store is what is tested (and undone afterwards)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    yield
    wandb.teardown()  # ends W&B's service process (wandb-core), which outlives a finished run
    deadline = time.monotonic() + 10
    while [name for name in child_processes() if name.startswith("wandb")]:
        assert time.monotonic() < deadline, f"W&B left processes behind: {child_processes()}"
        time.sleep(0.1)


def child_processes() -> list[str]:
    """The names of this process's children (Linux /proc)."""
    me, names = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid_name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if rest.split()[1] == me:
            names.append(pid_name.split("(", 1)[1])
    return names


def wandb_records(path: Path):
    """The records of a .wandb file (wandb.proto Records in LevelDB's log framing: 32 KiB blocks of chunks, each a
    crc32, a length and a type: full, first, middle, last). This wandb version has no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_run(folder: Path) -> dict:
    """One offline run directory: its id, config, history rows by step (metrics only: no _runtime etc., no media),
    exit code."""
    run = {"history": {}}
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            items = [(list(item.nested_key) or [item.key], json.loads(item.value_json)) for item in record.history.item]
            run["history"][record.history.step.num] = {
                key[0]: value for key, value in items if len(key) == 1 and not key[0].startswith("_")
            }
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def by_step(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's records merged by step (train and eval at one step are one row in W&B), as the trackers
    receive them: numbers only, and not the compile record (written before the trackers start)."""
    rows: dict[int, dict] = {}
    for record in records:
        if "event" not in record:
            rows.setdefault(record["step"], {}).update(trackers.scalars(record))
    return rows


def launch_argv(out: Path, config: Path, cache_dir: Path, *extra: str) -> list[str]:
    flags = dict(block_size=32, per_device_train_batch_size=2, mesh="data=8", max_steps=6, save_steps=3)
    flags |= dict(logging_steps=1, eval_steps=2, max_eval_samples=16, export_hf=False)
    return run_argv(out, config, cache_dir, *extra, train_file=FIXTURES / "overfit.txt", **flags)


@pytest.mark.slow
def test_wandb_and_mlflow_follow_metrics_jsonl_across_a_resume(
    offline, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    """Through the launcher: killed after its first checkpoint, then resumed. Both trackers hold exactly
    metrics.jsonl's records at their steps, in one run each; and without tensorboard in --report_to, no events."""
    out = tmp_path / "run"
    argv = launch_argv(out, tiny_gpt2_config, cache_dir, "--report_to", "wandb,mlflow", "--run_name", "tiny")
    run_killed_after_first_checkpoint(monkeypatch, lambda: main(argv))
    assert main(argv) == 0
    expected = by_step(read_metrics(out))
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and not (out / "tensorboard").exists()
    ids = json.loads((out / trackers.IDS_FILE).read_text())

    # W&B: two offline runs of one id (the first marked failed, as killed), their histories together are the run's
    first, second = (wandb_run(folder) for folder in sorted((out / "wandb").glob("offline-run-*")))
    assert first["id"] == second["id"] == ids["wandb"] and (first["exit_code"], second["exit_code"]) == (1, 0)
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == [4, 5, 6]
    assert {**first["history"], **second["history"]} == expected
    assert second["config"]["model_config"]["n_embd"] == 64 and second["config"]["max_steps"] == 6

    # MLflow: one run, resumed and finished, each metric's history is metrics.jsonl's
    client = mlflow.tracking.MlflowClient((out / "mlruns").absolute().as_uri())
    run = client.get_run(ids["mlflow"])
    assert (run.info.status, run.info.run_name) == ("FINISHED", "tiny")
    assert len(client.search_runs([run.info.experiment_id])) == 1
    keys = {key for row in expected.values() for key in row}
    assert keys <= set(run.data.metrics)
    for key in keys:
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == [
            (step, row[key]) for step, row in expected.items() if key in row
        ], key
    assert run.data.params["max_steps"] == "6" and run.data.params["model_config.n_embd"] == "64"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["loss_curve.png"]


def test_a_missing_library_stops_the_run_in_one_line(capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    code = main(launch_argv(tmp_path / "run", tiny_gpt2_config, cache_dir, "--report_to", "tensorboard,wandb"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "pip install -e '.[wandb]'" in lines[0], lines
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- the Reporter on its own: what a tracker's failure does ---------------------------------------------------------
def reporter(out: Path, report_to: str) -> Reporter:
    model = types.SimpleNamespace(model_type="gpt2", to_hf_dict=lambda: {"model_type": "gpt2", "n_embd": 8})
    return Reporter(
        out,
        enabled=True,
        shape=RunShape(
            family=types.SimpleNamespace(train_flops_per_step=lambda *a: 0),
            config=model,
            objective=types.SimpleNamespace(sequence_lengths=lambda: {"input_ids": 8}),
            global_batch=2,
            mesh=types.SimpleNamespace(size=1, shape={"data": 1}),
            dtype="float32",
        ),
        args=RunArgs.of(dict(output_dir=str(out), report_to=report_to)),
    )


def train_metrics(step: int) -> list[dict]:
    return [
        {
            "loss_sum": 16.0 / step,
            "tokens": 16,
            "correct": 8,
            "z_loss_sum": 0.0,
            "real_tokens": 16,
            "learning_rate": 1e-3,
            "grad_norm": 0.5,
        }
    ]


def test_the_loss_curve_and_the_samples_go_at_the_end(offline, monkeypatch, tmp_path_factory, tmp_path):
    home = tmp_path_factory.mktemp("home")  # W&B's logs and staging go to OUTPUT_DIR/wandb too, not under $HOME
    monkeypatch.setenv("HOME", str(home))
    for key in trackers.WANDB_DIRS:
        monkeypatch.delenv(key)
    report = reporter(tmp_path, "wandb,mlflow")
    report.start(0, 2)
    for step in (1, 2):
        report.log_train(step, train_metrics(step))
        report.log_samples(step, [{"prompt": "def", "greedy": f" f{step}():", "sampled": " g():"}])
    report.finish({"train_loss": 0.5})
    run = wandb_run(next((tmp_path / "wandb").glob("offline-run-*")))
    assert sorted(run["history"]) == [1, 2] and run["exit_code"] == 0
    assert [p for p in home.rglob("*") if "wandb" in p.name] == [] and list((tmp_path / "wandb").rglob("*.log"))
    media = next((tmp_path / "wandb").glob("offline-run-*")) / "files" / "media"
    assert [p.name.split("_")[:3] for p in (media / "images").iterdir()] == [["loss", "curve", "2"]]  # at the last step
    table = json.loads(next((media / "table").iterdir()).read_text())
    assert table == {
        "columns": ["step", "prompt", "kind", "output"],
        "data": [
            [1, "def", "greedy", " f1():"],
            [1, "def", "sampled", " g():"],
            [2, "def", "greedy", " f2():"],
            [2, "def", "sampled", " g():"],
        ],
    }
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").absolute().as_uri())
    run_id = json.loads((tmp_path / trackers.IDS_FILE).read_text())["mlflow"]
    assert [a.path for a in client.list_artifacts(run_id)] == ["loss_curve.png", "samples.jsonl"]


def test_wandb_dir_when_set_is_where_wandb_writes(offline, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    report = reporter(tmp_path / "out", "wandb")
    report.start(0, 1)
    report.log_train(1, train_metrics(1))
    report.finish({"train_loss": 0.5})
    run = wandb_run(next((tmp_path / "elsewhere" / "wandb").glob("offline-run-*")))
    assert run["exit_code"] == 0 and run["config"]["output_dir"] == str(tmp_path / "out")
    assert not (tmp_path / "out" / "wandb").exists()


@pytest.mark.parametrize("columns", [0, 80])
def test_a_terminal_of_0_columns_gets_log_lines_not_an_invisible_bar(tmp_path, monkeypatch, columns):
    terminal = types.SimpleNamespace(
        isatty=lambda: True, fileno=lambda: 2, write=sys.__stderr__.write, flush=lambda: None
    )
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((columns, 24)))
    report = reporter(tmp_path, "tensorboard")
    report.start(0, 2)
    assert (report.progress.bar is not None) == (columns > 0)
    report.close_bar()


def test_the_loss_plot_is_titled_in_words():
    assert (
        report_module.plot_title("roberta-tiny-de", "roberta", {"data": 8, "fsdp": 1, "tensor": 1})
        == "roberta-tiny-de (roberta, mesh data=8)"
    )
    assert (
        report_module.plot_title("r", "t5", {"data": 1, "fsdp": 1, "tensor": 1})
        == "r (t5, mesh data=1, fsdp=1, tensor=1)"
    )


def test_a_tracker_failing_mid_run_is_one_warning(offline, monkeypatch, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_batch

    def server_gone(self, run_id, metrics=(), **kwargs):
        if metrics and metrics[0].step >= 2:
            raise mlflow.exceptions.MlflowException("API request failed\nafter 5 retries")
        return real(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", server_gone)
    out = tmp_path / "run"
    out.mkdir()
    report = reporter(out, "mlflow")
    report.start(0, 4)
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        for step in range(1, 5):
            report.log_train(step, train_metrics(step))
        report.finish({"train_loss": 0.5})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--report_to mlflow: logging step 2 failed (API request failed); the run goes on without "
        "mlflow (metrics.jsonl has everything)"
    ]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert {p.name for p in out.iterdir()} == {
        "metrics.jsonl",
        "loss_curve.png",
        "mlruns",
        trackers.IDS_FILE,
        metrics_log.HIGHEST_STEP_FILE,
    }


def test_a_tracker_that_cannot_start_is_one_line(offline, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
    with pytest.raises(RunError, match=r"^--report_to mlflow: could not start its run: .*nosuchscheme"):
        reporter(tmp_path, "mlflow").start(0, 4)


@pytest.mark.parametrize("server", ["never answering", "nothing listening"])
def test_an_mlflow_server_that_does_not_answer_is_one_line_within_the_bound(
    offline, monkeypatch, tmp_path, silent_server, server
):
    """MLflow's own timeouts and retries would hold the start for 20+ minutes (never answering) or ~4.5 (a closed
    port)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = silent_server if server == "never answering" else f"http://127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        start = time.monotonic()
        with pytest.raises(RunError, match=r"^--report_to mlflow: could not start its run: no answer within 2 s"):
            reporter(tmp_path, "mlflow").start(0, 4)
    assert time.monotonic() - start < 5


def test_a_tracker_call_that_never_returns_is_one_warning_and_the_run_goes_on(monkeypatch, tmp_path, caplog):
    """After its last step, the run does not wait for a stuck tracker beyond the bound (2 s here)."""
    monkeypatch.setenv("SPMDLM_NETWORK_TIMEOUT", "2")
    stuck = threading.Event()  # never set: the call hangs as on a server that never answers
    hanging = types.SimpleNamespace(
        name="mlflow",
        external=True,
        start=lambda step: None,
        log=lambda record: stuck.wait(),
        finish=lambda *a: stuck.wait(),
    )
    group = trackers.Trackers([hanging])
    group.start(0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        group.log({"step": 1, "loss": 2.0})
        group.finish({}, None, [])
    assert time.monotonic() - start < 5
    assert [r.getMessage() for r in caplog.records] == [
        "--report_to mlflow: logging step 1 failed (no answer within 2 s (the server is unreachable or not answering; "
        "SPMDLM_NETWORK_TIMEOUT sets the bound)); the run goes on without mlflow (metrics.jsonl has everything)"
    ]


def test_mlflow_file_store_in_a_bucket_is_refused(monkeypatch):
    """A bucket keeps no empty folders, and MLflow's file store needs them to find a run again on resume."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ArgumentError, match="set MLFLOW_TRACKING_URI"):
        trackers.check_targets(("tensorboard", "mlflow"), "gs://bucket/run")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    trackers.check_targets(("tensorboard", "mlflow"), "gs://bucket/run")


@pytest.mark.slow
def test_no_secret_reaches_a_file_or_a_tracker(tmp_path, tiny_gpt2_config, cache_dir):
    """A Hub token given by flag, and the tokens of the environment, are in no file under the output dir or $HOME
    after a run reporting to every tracker (W&B offline, which records the command line; MLflow's file store)."""
    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    markers = {
        "flag": "hf_FlagSecretMarker4711",
        "HF_TOKEN": "hf_EnvSecretMarker4712",
        "WANDB_API_KEY": "0123456789abcdef0123456789abcdefSecret13",
        "HUGGING_FACE_HUB_TOKEN": "hf_Marker4714",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "HF_", "XDG_"))}
    env.update(
        {
            "HOME": str(home),
            "XLA_FLAGS": COMPILE_FLAGS,
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            **{k: v for k, v in markers.items() if k != "flag"},
        }
    )
    argv = launch_argv(
        out,
        tiny_gpt2_config,
        cache_dir,
        "--report_to",
        "wandb,mlflow,tensorboard",
        "--max_steps",
        "2",
        "--mesh",
        "data=1",
        "--do_eval",
        "false",
        f"--hub_token={markers['flag']}",
        "--token",
        markers["flag"],
    )
    done = subprocess.run(
        [sys.executable, "-m", "spmdlm.launch", *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = [p for root in (out, home) for p in root.rglob("*") if p.is_file()]
    assert any((out / "wandb").rglob("*.wandb")) and any((out / "mlruns").rglob("meta.yaml"))
    for path in files:
        data = path.read_bytes()
        for name, marker in markers.items():
            assert marker.encode() not in data, f"{name}'s value in {path}"
    recorded = b"".join(p.read_bytes() for p in (out / "wandb").rglob("*.wandb"))
    assert b"--hub_token=***" in recorded and b"--token" in recorded  # the command line, masked


def test_the_command_line_is_masked():
    assert masked(["--hub_token", "hf_a", "--token=hf_b", "--token", "--run_name", "x", "--hub_model_id", "o/m"]) == [
        "--hub_token",
        "***",
        "--token=***",
        "--token",
        "--run_name",
        "x",
        "--hub_model_id",
        "o/m",
    ]
