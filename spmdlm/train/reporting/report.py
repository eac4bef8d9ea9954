"""What a run shows and leaves behind, on process 0 (the others keep the bookkeeping silent): a `Reporter` fans
each record out to the metrics log (metrics.jsonl, samples.jsonl: metrics_log.py beside this file), the progress
display (progress.py) and the trackers of --report_to (TensorBoard, W&B, MLflow: trackers.py); it computes throughput
and MFU, keeps the run's goodput (goodput.py), draws the loss curve and says the summary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from spmdlm import devices, storage
from spmdlm.crashpoints import crash_point
from spmdlm.data.batch_ramp import BatchRamp
from spmdlm.data.objectives import Objective
from spmdlm.engine import monitors
from spmdlm.errors import RunError
from spmdlm.families.base import Family
from spmdlm.run_args import RunArgs
from spmdlm.train.reporting import goodput, trackers
from spmdlm.train.reporting.metrics_log import MetricsLog
from spmdlm.train.reporting.progress import Progress
from spmdlm.train.safety.stability import StabilityWatch

log = logging.getLogger("spmdlm")


def plot_title(run_name: str, model_type: str, mesh_shape) -> str:
    """'roberta-tiny-de (roberta, mesh data=8)': the mesh's axes of more than one device (all of them if none)."""
    axes = {axis: size for axis, size in mesh_shape.items() if size > 1} or dict(mesh_shape)
    return f"{run_name} ({model_type}, mesh {', '.join(f'{axis}={size}' for axis, size in axes.items())})"


class Throughput:
    """Tokens per second (all slots, and the non-padding ones), TFLOP/s per device and MFU of the steps between
    logging steps; their medians at the end; the tokens seen so far. `tokens_per_step` and `flops_per_step` are of
    the final global batch of `ramp` (a batch-size ramp's earlier steps count as the fraction of it they take)."""

    def __init__(
        self,
        *,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float | None,
        devices: int,
        ramp: BatchRamp | None = None,
    ):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_flops, self.devices = peak_flops, devices
        self.ramp = ramp or BatchRamp.fixed(1)
        self._rates: list[float] = []
        self._real_rates: list[float] = []
        self.start(0)

    def start(self, step: int) -> None:
        self._last_step, self._last_time = step, time.perf_counter()
        self._start_time = self._last_time

    def train_record(self, step: int, pending: list[dict]) -> dict[str, Any]:
        """metrics.jsonl's record of the steps since the last: loss, accuracy, throughput, MFU."""
        now = time.perf_counter()
        # Steps --skip_step_on_spike skipped (consecutive_skips > 0) changed nothing: their loss is left out
        taken = [m for m in pending if not m.get("consecutive_skips", 0)] or pending
        sums = {k: float(np.sum([m[k] for m in taken])) for k in ("loss_sum", "tokens", "correct", "z_loss_sum")}
        real_tokens = float(np.sum([m["real_tokens"] for m in pending]))
        # final-batch steps: the steps themselves without a ramp
        steps = (self.ramp.examples_before(step) - self.ramp.examples_before(self._last_step)) / self.ramp.final
        seconds = max(now - self._last_time, 1e-9)
        tokens_per_s = steps * self.tokens_per_step / seconds
        self._rates.append(tokens_per_s)
        # Non-padding input tokens: what a packed run gains over a padded one (tokens_per_second counts every slot)
        self._real_rates.append(real_tokens / seconds)
        self._last_step, self._last_time = step, now
        record = {
            "step": step,
            "loss": sums["loss_sum"] / max(sums["tokens"], 1.0),
            "accuracy": sums["correct"] / max(sums["tokens"], 1.0),
            "learning_rate": float(pending[-1].get("learning_rate", math.nan)),
            "grad_norm": float(pending[-1]["grad_norm"]),
            "tokens_per_second": tokens_per_s,
            "real_tokens_per_second": real_tokens / seconds,
            "padding_fraction": 1.0 - real_tokens / max(steps * self.tokens_per_step, 1),
            "tokens_seen": self.ramp.examples_before(step) * self.tokens_per_step // self.ramp.final,
        }
        if sums["z_loss_sum"]:
            record["z_loss"] = sums["z_loss_sum"] / max(sums["tokens"], 1.0)
        if "skipped_steps" in pending[-1]:
            record["skipped_steps"] = int(pending[-1]["skipped_steps"])
        if self.flops_per_step:
            seconds_per_step = self.tokens_per_step / tokens_per_s
            record["tflops_per_device"] = self.flops_per_step / seconds_per_step / self.devices / 1e12
            if self.peak_flops:
                record["mfu"] = record["tflops_per_device"] * 1e12 / self.peak_flops
        return record

    def summary(self) -> dict[str, float]:
        rates = self._rates[1:] or self._rates  # the first interval includes warm-up
        real = self._real_rates[1:] or self._real_rates
        return {
            "train_tokens_per_second": float(np.median(rates)) if rates else float("nan"),
            "train_real_tokens_per_second": float(np.median(real)) if real else float("nan"),
            "train_seconds": time.perf_counter() - self._start_time,
        }


def plot_loss_curve(records: list[dict], title: str, path: Path, target) -> None:
    """The train and eval losses of metrics.jsonl's `records`, drawn into `path` (`target`: the output dir, named
    when it cannot be written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, target / path.name)


def save_figure(fig, path: Path, shown_as) -> None:
    """`fig` as the PNG `path`, written whole or not at all, then closed (`shown_as`: its path in the output dir,
    named when it cannot be written)."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f"{path.name}.tmp")  # a killed write leaves no torn picture under the plot's name
    try:
        crash_point("loss_plot.before_write", path)
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    except OSError as e:  # matplotlib's message names no path
        tmp.unlink(missing_ok=True)
        space = f" ({storage.space_note(path)})" if storage.no_space(e) else ""
        raise RunError(
            f"cannot write {shown_as}: {e.strerror or e}{space}; free space and run the same command again to "
            "finish (the checkpoints are kept)"
        ) from None
    finally:
        plt.close(fig)


def plot_monitors(records: list[dict], title: str, path: Path, target) -> None:
    """The stability monitors of metrics.jsonl's `records` (--monitor_every), drawn into `path` (plots/monitors.png):
    gradient norm per layer and per group, update-to-parameter ratio per group, the logits' max and z-loss, the
    largest attention logit and the output RMS of each layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monitored = [r for r in records if any(k.startswith(monitors.PREFIX) for k in r)]
    panels = (
        ("gradient norm per layer", lambda k: "/layer_" in k and k.startswith("monitor/grad_norm/"), True),
        ("gradient norm per group", lambda k: "/layer_" not in k and k.startswith("monitor/grad_norm/"), True),
        ("update / parameter RMS per group", lambda k: k.startswith("monitor/update_ratio/"), True),
        ("logits' max and z-loss", lambda k: k in ("monitor/logits_max", "monitor/z_loss"), False),
        ("largest attention logit per layer", lambda k: k.startswith(("monitor/attn_", "monitor/cross_attn_")), False),
        ("output RMS per layer", lambda k: k.startswith("monitor/act_rms/"), True),
    )
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    for ax, (name, shown, log_scale) in zip(axes.flat, panels):
        keys = sorted({k for r in monitored for k in r if shown(k)}, key=_natural)
        for key in keys:
            points = [(r["step"], r[key]) for r in monitored if r.get(key) is not None]
            ax.plot(*zip(*points), label=key.removeprefix(monitors.PREFIX), lw=1)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if log_scale and keys:
            ax.set_yscale("log")
        if 0 < len(keys) <= 12:
            ax.legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, target / "plots" / path.name)


def _natural(key: str) -> tuple:
    """layer_2 before layer_10."""
    head, _, tail = key.rpartition("_")
    return (head, int(tail)) if tail.isdigit() else (key, -1)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What throughput and MFU are computed from: the family's FLOPs of the model (`config`) on the objective's
    lengths, the global batch, the devices of the mesh and their peak in `dtype`."""

    family: Family
    config: Any
    objective: Objective
    global_batch: int  # a batch-size ramp's final batch
    mesh: Any
    dtype: str
    ramp: BatchRamp | None = None  # the global batch of each step (None: `global_batch` throughout)


class Reporter:
    """One call per event of the run (compiled, a logging step, an evaluation, samples, the end), fanned out to the
    metrics log, the progress display and the trackers; `goodput` is timed by the loop."""

    def __init__(
        self,
        out: Path,
        *,
        enabled: bool,
        shape: RunShape,
        run_start: float | None = None,
        args: RunArgs | None = None,
    ):
        """`args`: the run's, for --report_to, --run_name and --slow_step_factor; None reports to TensorBoard only."""
        targets = args.reporting.targets if args is not None else ("tensorboard",)
        trackers.check_targets(targets, out)  # on every process: all stop together, before anything is trained
        self.target, self.enabled = out, enabled
        self.dry_run = args is not None and args.control.dry_running
        self.metrics = MetricsLog(out, enabled, staged=(trackers.IDS_FILE,))
        self.progress = Progress(enabled)
        self._run_start = time.perf_counter() if run_start is None else run_start
        self.goodput = goodput.Goodput(self._run_start, args.operations.slow_step_factor if args is not None else 0.0)
        config, global_batch = shape.config, shape.global_batch
        self.rates = Throughput(
            tokens_per_step=global_batch * sum(shape.objective.sequence_lengths().values()),
            flops_per_step=shape.family.train_flops_per_step(config, shape.objective, global_batch),
            peak_flops=devices.peak_flops_per_device(shape.dtype),
            devices=shape.mesh.size,
            ramp=shape.ramp or BatchRamp.fixed(global_batch),
        )
        run_config = (
            {**args.to_json(), "global_batch": global_batch, "model_config": config.to_hf_dict()}
            if args is not None
            else {}
        )
        run_name = (args and args.reporting.run_name) or storage.absolute(out).name  # --output_dir . has a name too
        self.title = plot_title(run_name, config.model_type, shape.mesh.shape)
        self.stability = StabilityWatch(args.reporting.monitor_warn_factor if args is not None else 4.0)
        self._trackers = trackers.Trackers(trackers.build(targets, self.metrics.out, run_name, run_config))

    @property
    def out(self) -> Path:
        """Where the report files are written: the output dir, or the local staging folder of a bucket's."""
        return self.metrics.out

    def sync(self, force: bool = True) -> None:
        """Upload the staged report files that changed (a bucket output dir; nothing to do for a local one)."""
        self.metrics.sync(force, before=self._trackers.flush)

    # -- setup ---------------------------------------------------------------------------------------------------
    def start(self, step: int, total: int):
        self.rates.start(step)
        self.progress.start(step, total)
        if self.enabled:
            self._trackers.start(step)

    def start_trackers(self, step: int):
        """The external trackers' runs (a login, a server): started before the run writes anything, so one that
        cannot start leaves nothing behind."""
        if self.enabled:
            self._trackers.start(step)

    def truncate_after(self, step: int):
        """On resume from the checkpoint at `step`: logged lines past it are dropped (those steps are about to be
        run again), and the steps up to the highest the run before reached count as restart loss."""
        self.goodput.recompute_through = self.metrics.highest_step()
        self.metrics.truncate_after(step)
        for record in self.metrics.records() if self.enabled else ():  # the monitors' medians go on where they were
            self.stability.remember(record)

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
            self.metrics.append("metrics.jsonl", {"step": 0, "event": "compile", **stats})

    # -- per step ------------------------------------------------------------------------------------------------
    def tick(self, step: int):
        self.progress.tick(step)
        self.metrics.reached(step)

    def log_train(self, step: int, pending: list[dict]) -> float:
        record = self.rates.train_record(step, pending)
        if self.enabled:
            self.metrics.reached(step)
            self._write(record)
            shown = {
                "loss": f"{record['loss']:.4f}",
                "lr": f"{record['learning_rate']:.3g}",
                "grad_norm": f"{record['grad_norm']:.3g}",
                "tok_s": f"{record['tokens_per_second']:,.0f}",
            }
            if "mfu" in record:
                shown["mfu"] = f"{record['mfu']:.1%}"
            self.progress.show(step, shown)
            self.sync(force=False)
        return record["loss"]

    def log_monitors(self, step: int, values: dict[str, Any]):
        """A monitor step's fetched monitors (engine/monitors.py): metrics.jsonl and the trackers, and the warning
        of a layer's gradient norm or largest attention logit grown past --monitor_warn_factor x its recent median."""
        if not self.enabled:
            return
        record = {"step": step, **monitors.flat_record(values)}
        self._write(record)
        self.stability.check(record)

    def log_eval(self, step: int, metrics: dict[str, float]):
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        sources = [
            f"{key.split('/')[1]} {value:.4f}"
            for key, value in metrics.items()
            if key.startswith("eval/") and key.endswith("/loss")
        ]
        self.progress.say(
            f"eval at step {step}: loss {metrics['eval_loss']:.4f} | perplexity "
            f"{metrics['eval_perplexity']:.2f} | accuracy {metrics['eval_accuracy']:.4f}"
            + (f" | bits/byte {metrics['eval_bits_per_byte']:.4f}" if "eval_bits_per_byte" in metrics else "")
            + (f" | EMA loss {metrics['eval_ema_loss']:.4f}" if "eval_ema_loss" in metrics else "")
            + (f" | loss by source: {', '.join(sources)}" if sources else "")
        )
        self.sync(force=False)

    def log_tasks(self, step: int, metrics: dict[str, float]):
        """LM-harness task metrics ({eval_tasks/<task>/<metric>: value}): metrics.jsonl, the trackers, one line."""
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        shown = " | ".join(
            f"{key.split('/', 1)[1]} {value:.4g}" for key, value in metrics.items() if "_stderr" not in key
        )
        self.progress.say(f"LM-harness tasks at step {step}: {shown}")
        self.sync(force=False)

    def log_samples(self, step: int, samples: list[dict[str, Any]]):
        """Console, samples.jsonl and TensorBoard text."""
        if not self.enabled:
            return
        self.metrics.append("samples.jsonl", {"step": step, "samples": samples})
        lines = [f"samples at step {step}:"]
        for sample in samples:
            shown = {k: v for k, v in sample.items() if k != "prompt"}
            lines += [f"  {sample['prompt']!r} -> {kind}: {value!r}" for kind, value in shown.items()]
        self.progress.say("\n".join(lines))
        self._trackers.log_text("samples", "\n\n".join(f"`{line.strip()}`" for line in lines[1:]), step)

    def log_goodput(self, step: int) -> dict[str, Any]:
        """The run's goodput so far, into metrics.jsonl and the trackers (as goodput/<kind> fractions and seconds);
        -> {"goodput": its summary} for the results (eval_results.json, the summary line)."""
        summary = self.goodput.summary()
        if self.enabled and not self.dry_run:
            self._write({"step": step, **goodput.flat_record(summary)})
        return {"goodput": summary}

    def throughput(self) -> dict[str, float]:
        return self.rates.summary()

    # -- outputs -------------------------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]):
        self.metrics.append("metrics.jsonl", record)
        self._trackers.log(record)

    def plot_loss_curve(self) -> None:
        """loss_curve.png, and plots/monitors.png when the run logged monitors."""
        records = self.metrics.records()
        plot_loss_curve(records, self.title, self.out / "loss_curve.png", self.target)
        if any(k.startswith(monitors.PREFIX) for r in records for k in r):
            plot_monitors(records, self.title, self.out / "plots" / "monitors.png", self.target)

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
        self.progress.close()

    def finish(self, results: dict[str, Any]):
        self.close_bar()
        curve = self.out / "loss_curve.png"
        try:
            if (self.out / "metrics.jsonl").exists():
                self.plot_loss_curve()
        finally:  # the trackers' runs end either way (with the curve if it was drawn)
            self._trackers.finish(results, curve if curve.is_file() else None, self.metrics.records("samples.jsonl"))
        self.metrics.close()
        log.info(
            "summary: %s | wall time %.0fs | outputs in %s",
            summary_line(results),
            time.perf_counter() - self._run_start,
            self.target,
        )


SUMMARY_LABELS = {
    "train_loss": "train loss {:.4f}",
    "eval_loss": "eval loss {:.4f}",
    "eval_perplexity": "perplexity {:.2f}",
    "eval_accuracy": "accuracy {:.4f}",
    "eval_bits_per_byte": "bits/byte {:.4f}",
    "train_tokens_per_second": "{:,.0f} tokens/s",
    "train_real_tokens_per_second": "{:,.0f} real (non-padding) tokens/s",
    "total_steps": "{} steps",
}


def summary_line(results: dict[str, Any]) -> str:
    """The summary's results, and the goodput of this run's wall time when it trained."""
    parts = [fmt.format(results[k]) for k, fmt in SUMMARY_LABELS.items() if k in results]
    if "goodput" in results:
        parts.append(goodput.describe(results["goodput"]))
    return " | ".join(parts)
