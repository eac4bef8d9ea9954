"""Where a run's metrics go besides metrics.jsonl (--report_to): TensorBoard, Weights & Biases, MLflow.

Each tracker is a small class with start / log / finish; Reporter (report.py) holds them in a `Trackers`, on process
0 only. A library asked for but not installed is a one-line error before anything is trained; so is a W&B or MLflow
run that cannot be started. Every W&B and MLflow call is bounded in time (network.py): a server that does not answer
is a failure like any other. Once the run trains, a W&B or MLflow call that fails is one warning and that tracker is
dropped: the run goes on (TensorBoard's failure, a full disk, still stops it, as the checkpoints would fail next).
A resumed run continues the same W&B and MLflow runs: their ids are kept in OUTPUT_DIR/trackers.json.
See docs/tracking.md.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spmdlm import network, storage
from spmdlm.crashpoints import crash_point
from spmdlm.errors import ArgumentError, RunError

log = logging.getLogger("spmdlm")

IDS_FILE = "trackers.json"  # {"wandb": run id, "mlflow": run id}, what a resumed run continues
MLFLOW_STORE = "mlruns"  # MLflow's local file store in the output dir, unless MLFLOW_TRACKING_URI says otherwise
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data"}  # W&B's folders outside dir=, in OUTPUT_DIR/wandb
LIBRARIES = {"wandb": "wandb", "mlflow": "mlflow"}  # --report_to name -> the module it needs


def check_targets(targets: Iterable[str], out) -> None:
    """A tracker asked for that cannot work (its library missing; MLflow's default store in a bucket): one line now,
    not a run trained without it."""
    if any(target in LIBRARIES for target in targets):
        network.timeout_s()  # a bad SPMDLM_NETWORK_TIMEOUT: refused now
    for target in targets:
        module = LIBRARIES.get(target)
        if module and importlib.util.find_spec(module) is None:
            raise ArgumentError(
                f"--report_to {target}: the {module} library is not installed; "
                f"pip install -e '.[{target}]' (or leave {target} out of --report_to)"
            )
    # the file store needs its empty folders, which a bucket does not keep: a resumed run would not find its run
    if "mlflow" in targets and storage.is_remote(out) and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ArgumentError(
            f"--report_to mlflow with --output_dir {out}: MLflow's default store (a folder of "
            "files) cannot live in a bucket; set MLFLOW_TRACKING_URI to a tracking server (or a "
            "local file: folder)"
        )


def is_eval_key(key: str) -> bool:
    """An evaluation result: eval_loss and friends, and a mixture's per-source eval/<source>/loss etc."""
    return key.startswith(("eval_", "eval/"))


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics.jsonl record, without its step: what every tracker logs."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def saved_id(out: Path, tracker: str) -> str | None:
    try:
        return json.loads((out / IDS_FILE).read_text()).get(tracker)
    except (OSError, ValueError, AttributeError):
        return None


def save_id(out: Path, tracker: str, run_id: str) -> None:
    path = out / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    storage.write_atomic(path, json.dumps({**ids, tracker: run_id}, indent=2))


class Tracker:
    """One destination. `external`: a failure once training runs is a warning (W&B, MLflow), not the run's end."""

    name = ""
    external = True

    def start(self, step: int) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, results: dict[str, Any], loss_curve: Path | None, samples: list[dict], failed: bool) -> None:
        pass


class EventLog:
    """TensorBoard scalars and text written synchronously, on the caller's thread.

    tensorboardX's SummaryWriter hands events to a writer thread through a bounded queue: when that thread dies
    (a full disk), the queue fills and the run blocks forever, deaf even to SIGTERM. Here a failed write raises
    where the run can report it (one line, exit 2). Events come once per logging step, so writing them inline
    costs nothing measurable. The file format is tensorboardX's own (its EventsWriter and summary protos)."""

    def __init__(self, folder: Path):
        # tensorboardX imports torch where it is installed (2 s): only when a run reports
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2

        self._summary, self._event = summary, event_pb2.Event
        self.folder = folder
        self._events = self._io(
            lambda: (folder.mkdir(parents=True, exist_ok=True), EventsWriter(str(folder / "events")))[1]
        )

    def _io(self, write):
        try:
            crash_point("tensorboard.before_write", self.folder)
            return write()
        except OSError as e:
            space = f" ({storage.space_note(self.folder)})" if storage.no_space(e) else ""
            raise RunError(
                f"cannot write TensorBoard events in {self.folder}: {e.strerror or e}{space}; free space or "
                "choose another --output_dir (the checkpoints saved so far are kept)"
            ) from None

    def _write(self, summary, step: int) -> None:
        event = self._event(summary=summary, step=int(step), wall_time=time.time())
        self._io(lambda: self._events.write_event(event))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._write(self._summary.scalar(tag, value), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._write(self._summary.text(tag, text), step)

    def flush(self) -> None:
        self._io(self._events.flush)

    def close(self) -> None:
        self._io(self._events.close)


class TensorBoard(Tracker):
    """OUTPUT_DIR/tensorboard: train/<metric> and eval/<metric> scalars (a mixture's eval/<source>/<metric> as is),
    and the samples as text."""

    name, external = "tensorboard", False

    def __init__(self, out: Path):
        self.out, self._events = out, None

    def start(self, step: int) -> None:
        self._events = EventLog(self.out / "tensorboard")

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        prefix = "eval" if any(is_eval_key(k) for k in values) else "train"
        for key, value in values.items():
            tag = key if key.startswith("eval/") else f"{prefix}/{key.removeprefix('eval_')}"
            self._events.add_scalar(tag, value, record["step"])

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._events.add_text(tag, text, step)

    def flush(self) -> None:
        self._events.flush()

    def finish(self, results, loss_curve, samples, failed) -> None:
        self._events.close()


class WandB(Tracker):
    """A W&B run in project WANDB_PROJECT (default spmdlm), its files under OUTPUT_DIR/wandb (WANDB_DIR/wandb when that
    is set; where WANDB_MODE=offline leaves them for `wandb sync`): the run config, each record of metrics.jsonl at its
    train step under the same keys, and at the end the final results (summary), the loss curve and the samples (a
    table)."""

    name = "wandb"

    def __init__(self, out: Path, run_name: str, run_config: dict[str, Any]):
        self.out, self.run_name, self.run_config = out, run_name, run_config
        self._run, self._last_step = None, 0

    def start(self, step: int) -> None:
        import wandb

        for variable, folder in WANDB_DIRS.items():  # else its logs and staging go under $HOME (unless set by the user)
            os.environ.setdefault(variable, str(self.out / "wandb" / folder))
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "spmdlm"),
            name=self.run_name,
            id=saved_id(self.out, self.name),
            resume="allow",
            dir=None if os.environ.get("WANDB_DIR") else str(self.out),  # None: wandb reads it
            config=self.run_config,
            allow_val_change=True,  # a resume may change some settings
            reinit="create_new",
        )  # never finishes a run of the caller's own
        save_id(self.out, self.name, self._run.id)
        self._last_step = step

    def log(self, record: dict[str, Any]) -> None:
        # W&B refuses steps before a resumed run's first one (logged by the attempt that crashed), warning each time
        if record["step"] >= self._run.starting_step:
            self._run.log(scalars(record), step=record["step"])
            self._last_step = record["step"]

    def finish(self, results, loss_curve, samples, failed) -> None:
        import wandb

        if not failed:
            self._run.summary.update(scalars(results))
            media: dict[str, Any] = {}
            if loss_curve is not None:
                media["loss_curve"] = wandb.Image(str(loss_curve))
            if samples:
                rows = [
                    [record["step"], sample["prompt"], kind, value if isinstance(value, str) else json.dumps(value)]
                    for record in samples
                    for sample in record["samples"]
                    for kind, value in sample.items()
                    if kind != "prompt"
                ]
                media["samples"] = wandb.Table(columns=["step", "prompt", "kind", "output"], data=rows)
            if media:  # beside the last metrics (W&B drops a step before a resumed run's first)
                self._run.log(media, step=max(self._last_step, self._run.starting_step))
        self._run.finish(exit_code=1 if failed else 0)


class MLflow(Tracker):
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default spmdlm) of MLFLOW_TRACKING_URI, by default a file
    store in OUTPUT_DIR/mlruns: the arguments and model config as params, each record of metrics.jsonl at its step,
    and at the end the final results (at the last step) and the loss curve and samples.jsonl as artifacts."""

    name = "mlflow"

    def __init__(self, out: Path, run_name: str, run_config: dict[str, Any]):
        self.out, self.run_name, self.run_config = out, run_name, run_config
        self._client, self._run_id, self._logged_to, self._last_step = None, None, -1, 0

    def start(self, step: int) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.out / MLFLOW_STORE).absolute().as_uri()
            # MLflow 3 refuses a file store unless opted in; it is the one store mlflow-skinny can write
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        self._run_id, logged = saved_id(self.out, self.name), None
        if self._run_id:
            try:
                logged = client.get_run(self._run_id).data.params
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning(
                    "--report_to mlflow: run %s (%s) is not in %s; starting a new run",
                    self._run_id,
                    self.out / IDS_FILE,
                    uri,
                )
        if logged is not None:
            client.update_run(self._run_id, status="RUNNING")
            # a crash between checkpoints logged steps that are run again: MLflow keeps the first attempt's
            self._logged_to = max((m.step for m in client.get_metric_history(self._run_id, "loss")), default=-1)
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "spmdlm")
            experiment = client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
            self._run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            save_id(self.out, self.name, self._run_id)
            logged = {}
        # a param cannot change once logged (MLflow refuses): a resumed run adds only those it did not have
        params = [
            Param(key, str(value)[:MAX_PARAM_VAL_LENGTH])
            for key, value in flatten(self.run_config).items()
            if key not in logged
        ]
        client.log_batch(self._run_id, params=params)  # MLflow splits it into batches of its size limit
        self._last_step = step

    def log(self, record: dict[str, Any]) -> None:
        if record["step"] > self._logged_to:
            self._log_metrics(scalars(record), record["step"])
            self._last_step = record["step"]

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, results, loss_curve, samples, failed) -> None:
        if not failed:
            # the final results besides the eval metrics already logged at their step: throughput, train loss
            self._log_metrics({k: v for k, v in scalars(results).items() if not is_eval_key(k)}, self._last_step)
            for path in (loss_curve, self.out / "samples.jsonl"):
                if path is not None and path.is_file():
                    self._client.log_artifact(self._run_id, str(path))
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts (the model config) as dotted keys: MLflow params are flat."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def build(targets: Iterable[str], out: Path, run_name: str, run_config: dict[str, Any]) -> list[Tracker]:
    """The trackers of --report_to, in its order."""
    make = {
        "tensorboard": lambda: TensorBoard(out),
        "wandb": lambda: WandB(out, run_name, run_config),
        "mlflow": lambda: MLflow(out, run_name, run_config),
    }
    return [make[target]() for target in targets]


class Trackers:
    """The run's trackers, called together; started ones only."""

    def __init__(self, trackers: list[Tracker]):
        self._waiting, self._open = trackers, []

    def start(self, step: int) -> None:
        for tracker in self._waiting:
            if tracker.external:
                try:
                    network.bounded(lambda: tracker.start(step))
                except Exception as e:  # noqa: BLE001 - a login, a server, a store: the library's own message
                    raise RunError(
                        f"--report_to {tracker.name}: could not start its run: {one_line(e)}; fix that "
                        f"or leave {tracker.name} out of --report_to"
                    ) from None
            else:
                tracker.start(step)
            self._open.append(tracker)
        self._waiting = []

    def _each(self, call, what: str) -> None:
        for tracker in list(self._open):
            if not tracker.external:
                call(tracker)
                continue
            try:
                network.bounded(lambda: call(tracker))
            except Exception as e:  # noqa: BLE001 - the tracker is lost, the run is not
                log.warning(
                    "--report_to %s: %s failed (%s); the run goes on without %s (metrics.jsonl has everything)",
                    tracker.name,
                    what,
                    one_line(e),
                    tracker.name,
                )
                self._open.remove(tracker)

    def log(self, record: dict[str, Any]) -> None:
        self._each(lambda t: t.log(record), f"logging step {record['step']}")

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._each(lambda t: t.log_text(tag, text, step), f"logging {tag} at step {step}")

    def flush(self) -> None:
        self._each(lambda t: t.flush(), "flushing")

    def finish(
        self, results: dict[str, Any], loss_curve: Path | None, samples: list[dict], failed: bool = False
    ) -> None:
        """End every run (`failed`: the run stopped on an error, so the trackers mark theirs failed)."""
        self._each(lambda t: t.finish(results, loss_curve, samples, failed), "finishing")
        self._open = []
