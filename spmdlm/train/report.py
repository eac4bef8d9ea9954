"""What a run shows and leaves behind: progress bar, metrics.jsonl, the trackers of --report_to (TensorBoard, W&B,
MLflow: spmdlm/train/trackers.py), loss curve, final summary.

Only process 0 reports; the others keep the bookkeeping silent. An output dir in a bucket (gs://) gets the same
files: they are written in a local staging folder (objects cannot be appended to) and uploaded when they changed,
at most every SYNC_SECONDS, at each checkpoint and at the end (`sync`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from spmdlm import devices, storage
from spmdlm.data.objectives import Objective
from spmdlm.errors import RunError
from spmdlm.families.base import Family
from spmdlm.run_args import RunArgs
from spmdlm.train import trackers

log = logging.getLogger("spmdlm")


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


def write_json(path: Path, value: Any) -> None:
    """Written whole or not at all (write-then-rename; one upload to a bucket), so a crash never leaves half a file."""
    storage.write_atomic(path, strict_json(value, indent=2))


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
        start = end
        while start > 0:  # back to the byte after the last newline, a block at a time
            block = min(start, 1 << 16)
            f.seek(start - block)
            at = f.read(block).rfind(b"\n")
            if at >= 0:
                start = start - block + at + 1
                break
            start -= block
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


def terminal_columns() -> int:
    """The width stderr's terminal reports (0 when it reports none, or is no terminal)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal, or stderr replaced by an object without a fd
        return 0


def plot_title(run_name: str, model_type: str, mesh_shape) -> str:
    """'roberta-tiny-de (roberta, mesh data=8)': the mesh's axes of more than one device (all of them if none)."""
    axes = {axis: size for axis, size in mesh_shape.items() if size > 1} or dict(mesh_shape)
    return f"{run_name} ({model_type}, mesh {', '.join(f'{axis}={size}' for axis, size in axes.items())})"


SYNC_SECONDS = 30.0  # a bucket output dir's reports are uploaded at most this often (and at checkpoints, at the end)


class Reporter:
    def __init__(
        self,
        out: Path,
        *,
        enabled: bool,
        family: Family,
        config,
        objective: Objective,
        global_batch: int,
        mesh,
        dtype: str,
        run_start: float | None = None,
        args: RunArgs | None = None,
    ):
        """`args`: the run's, for --report_to and --run_name; None reports to TensorBoard only."""
        targets = args.reporting.targets if args is not None else ("tensorboard",)
        trackers.check_targets(targets, out)  # on every process: all stop together, before anything is trained
        # self.out: where the report files are written; the output dir itself, or a local staging folder for a bucket
        self.target, self.enabled = out, enabled
        self.dry_run = args is not None and args.control.dry_running
        self.out = self._stage(out) if enabled and storage.is_remote(out) else out
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._repaired: set[str] = set()  # the JSON-lines files whose torn tail (if any) was repaired (_append)
        self._last_sync = time.perf_counter()
        self._run_start = time.perf_counter() if run_start is None else run_start
        self.tokens_per_step = global_batch * sum(objective.sequence_lengths().values())
        self.config, self.mesh, self.dtype = config, mesh, dtype
        self.flops_per_step = family.train_flops_per_step(config, objective, global_batch)
        self.peak_flops = devices.peak_flops_per_device(dtype)
        self._bar = None
        run_config = (
            {**args.to_json(), "global_batch": global_batch, "model_config": config.to_hf_dict()}
            if args is not None
            else {}
        )
        run_name = (args and args.reporting.run_name) or storage.absolute(out).name  # --output_dir . has a name too
        self.run_name = run_name
        self._trackers = trackers.Trackers(trackers.build(targets, self.out, run_name, run_config))
        self._rates: list[float] = []
        self._real_rates: list[float] = []
        self._last_time = time.perf_counter()
        self._last_step = 0
        self._start_time = time.perf_counter()

    # -- a bucket output dir: local staging --------------------------------------------------------------------------
    def _stage(self, out) -> Path:
        """A local folder holding the bucket's report files (a resumed run appends to them, and continues the
        tracker runs of trackers.json)."""
        local = Path(tempfile.mkdtemp(prefix="spmdlm-report-"))
        for name in ("metrics.jsonl", "samples.jsonl", trackers.IDS_FILE):
            if (out / name).is_file():
                storage.download(out / name, local / name, progress=False)
        return local

    def sync(self, force: bool = True) -> None:
        """Upload the staged report files that changed (a bucket output dir; nothing to do for a local one)."""
        if self.out is self.target or (not force and time.perf_counter() - self._last_sync < SYNC_SECONDS):
            return
        self._trackers.flush()
        for file in sorted(p for p in self.out.rglob("*") if p.is_file()):
            name = file.relative_to(self.out).as_posix()
            stat = file.stat()
            if self._uploaded.get(name) != (stat.st_size, stat.st_mtime_ns):
                storage.upload(file, self.target / name)
                self._uploaded[name] = (stat.st_size, stat.st_mtime_ns)
        self._last_sync = time.perf_counter()

    # -- setup ---------------------------------------------------------------------------------------------------
    def start(self, step: int, total: int):
        self._last_step, self._last_time = step, time.perf_counter()
        self._first_step, self._start_time = step, time.perf_counter()
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        self._trackers.start(step)
        self._total = total
        # a log file gets plain lines (log_train), not carriage-return bar fragments; so does a terminal that
        # reports 0 columns (some CI and IDE consoles), where tqdm would draw nothing at all
        if sys.stderr.isatty() and terminal_columns() > 0:
            self._bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)

    def start_trackers(self, step: int):
        """The external trackers' runs (a login, a server): started before the run writes anything, so one that
        cannot start leaves nothing behind."""
        if self.enabled:
            self._trackers.start(step)

    def truncate_after(self, step: int):
        """On resume, drop logged lines past the checkpoint: those steps are about to be run again."""
        for path in (self.out / "metrics.jsonl", self.out / "samples.jsonl"):
            if self.enabled and path.exists():
                lines = [line for line, record in read_records(path) if record["step"] <= step]
                path.write_text("".join(line + "\n" for line in lines))

    def compile_stats(self, stats: dict[str, Any]):
        if not self.enabled:
            return
        mb = lambda k: stats.get(k, 0) / 2**20
        log.info(
            "train step compiled in %.1fs | per device: arguments %.1f MiB, outputs %.1f MiB, temporaries "
            "%.1f MiB | XLA FLOPs/device %s (a scanned layer counted once)",
            stats.get("compile_seconds", 0.0),
            mb("argument_bytes"),
            mb("output_bytes"),
            mb("temp_bytes"),
            f"{stats['xla_flops_per_device']:.3g}" if stats.get("xla_flops_per_device") else "n/a",
        )
        if not self.dry_run:  # a dry run writes nothing; the trackers get no compile record
            self._append("metrics.jsonl", strict_json({"step": 0, "event": "compile", **stats}))

    # -- per step ------------------------------------------------------------------------------------------------
    def tick(self, step: int):
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def log_train(self, step: int, pending: list[dict]) -> float:
        now = time.perf_counter()
        # Steps --skip_step_on_spike skipped (consecutive_skips > 0) changed nothing: their loss is left out
        taken = [m for m in pending if not m.get("consecutive_skips", 0)] or pending
        sums = {k: float(np.sum([m[k] for m in taken])) for k in ("loss_sum", "tokens", "correct", "z_loss_sum")}
        sums["real_tokens"] = float(np.sum([m["real_tokens"] for m in pending]))
        loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
        steps = step - self._last_step
        seconds = max(now - self._last_time, 1e-9)
        tokens_per_s = steps * self.tokens_per_step / seconds
        self._rates.append(tokens_per_s)
        # Non-padding input tokens: what a packed run gains over a padded one (tokens_per_second counts every slot)
        self._real_rates.append(sums["real_tokens"] / seconds)
        self._last_step, self._last_time = step, now
        record = {
            "step": step,
            "loss": loss,
            "accuracy": sums["correct"] / max(sums["tokens"], 1.0),
            "learning_rate": float(pending[-1].get("learning_rate", math.nan)),
            "grad_norm": float(pending[-1]["grad_norm"]),
            "tokens_per_second": tokens_per_s,
            "real_tokens_per_second": sums["real_tokens"] / seconds,
            "padding_fraction": 1.0 - sums["real_tokens"] / max(steps * self.tokens_per_step, 1),
        }
        if sums["z_loss_sum"]:
            record["z_loss"] = sums["z_loss_sum"] / max(sums["tokens"], 1.0)
        if "skipped_steps" in pending[-1]:
            record["skipped_steps"] = int(pending[-1]["skipped_steps"])
        if self.flops_per_step:
            seconds_per_step = self.tokens_per_step / tokens_per_s
            record["tflops_per_device"] = self.flops_per_step / seconds_per_step / self.mesh.size / 1e12
            if self.peak_flops:
                record["mfu"] = record["tflops_per_device"] * 1e12 / self.peak_flops
        if self.enabled:
            self._write(record)
            shown = {
                "loss": f"{loss:.4f}",
                "lr": f"{record['learning_rate']:.3g}",
                "grad_norm": f"{record['grad_norm']:.3g}",
                "tok_s": f"{tokens_per_s:,.0f}",
            }
            if "mfu" in record:
                shown["mfu"] = f"{record['mfu']:.1%}"
            if self._bar is not None:
                self._bar.update(step - self._bar.n)
                self._bar.set_postfix(shown, refresh=False)
            else:
                log.info(
                    "step %d/%d | %s | ETA %s",
                    step,
                    self._total,
                    " | ".join(f"{k} {v}" for k, v in shown.items()),
                    self._eta(step, now),
                )
            self.sync(force=False)
        return loss

    def _eta(self, step: int, now: float) -> str:
        """Remaining steps at the average wall time per step so far (evaluations included, compile excluded)."""
        done = step - self._first_step
        if done <= 0:
            return "?"
        seconds = int((now - self._start_time) / done * (self._total - step))
        return (
            f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
            if seconds >= 3600
            else f"{seconds // 60}m{seconds % 60:02d}s"
        )

    def log_eval(self, step: int, metrics: dict[str, float]):
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        sources = [
            f"{key.split('/')[1]} {value:.4f}"
            for key, value in metrics.items()
            if key.startswith("eval/") and key.endswith("/loss")
        ]
        message = (
            f"eval at step {step}: loss {metrics['eval_loss']:.4f} | perplexity "
            f"{metrics['eval_perplexity']:.2f} | accuracy {metrics['eval_accuracy']:.4f}"
            + (f" | bits/byte {metrics['eval_bits_per_byte']:.4f}" if "eval_bits_per_byte" in metrics else "")
            + (f" | loss by source: {', '.join(sources)}" if sources else "")
        )
        (self._bar.write if self._bar is not None else log.info)(message)
        self.sync(force=False)

    def log_tasks(self, step: int, metrics: dict[str, float]):
        """LM-harness task metrics ({eval_tasks/<task>/<metric>: value}): metrics.jsonl, the trackers, one line."""
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        shown = " | ".join(
            f"{key.split('/', 1)[1]} {value:.4g}" for key, value in metrics.items() if "_stderr" not in key
        )
        (self._bar.write if self._bar is not None else log.info)(f"LM-harness tasks at step {step}: {shown}")
        self.sync(force=False)

    def log_samples(self, step: int, samples: list[dict[str, Any]]):
        """Console, samples.jsonl and TensorBoard text."""
        if not self.enabled:
            return
        self._append("samples.jsonl", strict_json({"step": step, "samples": samples}))
        lines = [f"samples at step {step}:"]
        for sample in samples:
            shown = {k: v for k, v in sample.items() if k != "prompt"}
            lines += [f"  {sample['prompt']!r} -> {kind}: {value!r}" for kind, value in shown.items()]
        (self._bar.write if self._bar is not None else log.info)("\n".join(lines))
        self._trackers.log_text("samples", "\n\n".join(f"`{line.strip()}`" for line in lines[1:]), step)

    def throughput(self) -> dict[str, float]:
        rates = self._rates[1:] or self._rates  # the first interval includes warm-up
        real = self._real_rates[1:] or self._real_rates
        return {
            "train_tokens_per_second": float(np.median(rates)) if rates else float("nan"),
            "train_real_tokens_per_second": float(np.median(real)) if real else float("nan"),
            "train_seconds": time.perf_counter() - self._start_time,
        }

    # -- outputs -------------------------------------------------------------------------------------------------
    def _append(self, name: str, line: str) -> None:
        """One line onto a JSON-lines file; the first append of a run repairs a tail a crash tore."""
        path = self.out / name
        if name not in self._repaired:
            repair_torn_tail(path)
            self._repaired.add(name)
        with open(path, "a") as f:
            f.write(line + "\n")

    def _write(self, record: dict[str, Any]):
        self._append("metrics.jsonl", strict_json(record))
        self._trackers.log(record)

    def plot_loss_curve(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [record for _, record in read_records(self.out / "metrics.jsonl")]
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        if train:
            ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(plot_title(self.run_name, self.config.model_type, self.mesh.shape))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            fig.savefig(self.out / "loss_curve.png", dpi=110)
        except OSError as e:  # matplotlib's message names no path
            raise RunError(
                f"cannot write {self.target / 'loss_curve.png'}: {e.strerror or e}; free space and "
                "run the same command again to finish (the checkpoints are kept)"
            ) from None
        finally:
            plt.close(fig)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close_bar()  # the progress bar's line ends before any error message
        if self.enabled and exc[0] is not None:  # the trackers' runs end as failed; a bucket keeps what was logged
            try:
                self._trackers.finish({}, None, [], failed=True)
                self.sync()
            except Exception as e:  # noqa: BLE001 - the run is failing already; that error is the one to show
                log.warning("could not close the reports in %s: %s", self.target, e)

    def close_bar(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def finish(self, results: dict[str, Any]):
        self.close_bar()
        curve = self.out / "loss_curve.png"
        try:
            if (self.out / "metrics.jsonl").exists():
                self.plot_loss_curve()
        finally:  # the trackers' runs end either way (with the curve if it was drawn)
            samples = self.out / "samples.jsonl"
            self._trackers.finish(
                results,
                curve if curve.is_file() else None,
                [record for _, record in read_records(samples)] if samples.is_file() else [],
            )
        if self.enabled and self.out is not self.target:
            self.sync()
            shutil.rmtree(self.out, ignore_errors=True)  # the staging folder: everything is in the bucket now
            self.out = self.target
        labels = {
            "train_loss": "train loss {:.4f}",
            "eval_loss": "eval loss {:.4f}",
            "eval_perplexity": "perplexity {:.2f}",
            "eval_accuracy": "accuracy {:.4f}",
            "eval_bits_per_byte": "bits/byte {:.4f}",
            "train_tokens_per_second": "{:,.0f} tokens/s",
            "train_real_tokens_per_second": "{:,.0f} real (non-padding) tokens/s",
            "total_steps": "{} steps",
        }
        parts = [fmt.format(results[k]) for k, fmt in labels.items() if k in results]
        log.info(
            "summary: %s | wall time %.0fs | outputs in %s",
            " | ".join(parts),
            time.perf_counter() - self._run_start,
            self.target,
        )
