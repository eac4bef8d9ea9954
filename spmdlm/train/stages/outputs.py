"""The output dir's policy: what a run may find there (a run to resume, our own outputs, someone's data), what it
may remove, and the files it leaves for a resume and for the next run (run_config.json, eval_results.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from spmdlm import checkpoint, storage
from spmdlm.data import pipeline
from spmdlm.data.batch_ramp import RampedSteps
from spmdlm.data.datasets import tokenizer_hash
from spmdlm.data.mixture import describe_change
from spmdlm.data.tokenization import save_tokenizer
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.engine.plan import LayerPlan
from spmdlm.errors import RunError
from spmdlm.generation.harness import TASK_METRICS
from spmdlm.hf_export import export_complete
from spmdlm.optimizers import declared_flags
from spmdlm.train.reporting.metrics_log import HIGHEST_STEP_FILE, read_records, write_json
from spmdlm.train.safety.guard import LOCK_NAME
from spmdlm.train.stages.corpora import Data, training_schedule
from spmdlm.train.stages.resolve import Run, is_main
from spmdlm.train.stages.vocabulary import Vocabulary

log = logging.getLogger("spmdlm")

# Run arguments that must match for a run to resume in the same output dir, besides the model config, the global
# batch, the family's own (its objective's flags) and the optimizers' own that say so (`Flag.resume`). Others may
# change: logging cadence, the mesh and the accumulation (the state is restored into the new shardings; the global
# batch is what must stay), or the step budget (the learning rate continues from where it is:
# --lr_scheduler_on_extension, engine/optim.continued).
# The model type is compared through the model config. The learning rate, its schedule and warmup may change: the
# change is logged.
# A mixture's train_file / data_mixture are compared as the mixture itself (its sources and weights), which
# --allow_mixture_change lets change.
MIXTURE_KEYS = ("train_file", "data_mixture")
COMMON_RESUME_KEYS = (
    "model_name_or_path",
    "tokenizer_name",
    "train_file",
    "dataset_dir",
    "dataset_name",
    "dataset_config_name",
    "text_column",
    "validation_file",
    "validation_split_percentage",
    "max_train_samples",
    "seed",
    "weight_decay",
    "adafactor",
    "optim",
    "batch_size_ramp",  # which examples each step reads, and where the schedule is (older runs: none)
)
LOGGED_CHANGES = (
    "learning_rate",
    "lr_scheduler_type",
    "skip_step_on_spike",
    "min_lr_ratio",
    "decay_steps",
    "decay_ratio",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "max_grad_norm",
    "z_loss",
    "mesh",
    "dtype",
    "sample_prompts",
    "sample_every",
    "monitor_every",
    "monitor_warn_factor",
)
# Inputs named by a path: a resume compares what they hold (run_config.json's fingerprints of the training and held-out
# records and of the tokenizer; the model config), not how the path is spelled, so the same corpus by a relative or
# an absolute path, or a byte-identical copy elsewhere, resumes. A run that recorded no fingerprints compares paths.
COMPARED_BY_CONTENT = ("model_name_or_path", "tokenizer_name", "train_file", "dataset_dir", "validation_file")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What a run may find in its output dir besides its own outputs: the recipes' config and tokenizer, and the lock.
RUN_INPUTS = {
    "config.json",
    *TOKENIZER_FILES,
    "vocab.json",
    "merges.txt",
    "spiece.model",
    LOCK_NAME,
}
OUR_OUTPUTS = (
    "checkpoints",
    checkpoint.DAMAGED_DIR,
    "tensorboard",
    "metrics.jsonl",
    "samples.jsonl",
    "eval_results.json",
    "loss_curve.png",
    "plots",  # plots/monitors.png (--monitor_every)
    "hf",
    "run_config.json",
    "trackers.json",
    "highest_step.json",  # metrics_log.HIGHEST_STEP_FILE
    "wandb",
    "mlruns",
)
LEFT_BY_A_HANG = "hang-*.txt"  # watchdog.py's stacks of a hung run, one per host: ours, kept when resuming


@dataclasses.dataclass(frozen=True)
class OutputDir:
    """What the run found in its output dir and made of it: `verdict` 'resume' (a run of these settings is there),
    'fresh' (nothing to keep) or 'clear' (our outputs to remove); `previous`, the run_config.json found there (empty
    once cleared); `latest_step`, of the checkpoints found when resuming."""

    verdict: str
    previous: dict = dataclasses.field(default_factory=dict)
    latest_step: int = 0

    @property
    def resuming(self) -> bool:
        return self.verdict == "resume"


def outputs_of_ours(out: Path) -> list[Path]:
    """What a run of ours wrote in `out` (the damaged checkpoints aside, which are never deleted)."""
    names = [name for name in OUR_OUTPUTS if name != checkpoint.DAMAGED_DIR]
    return [out / name for name in names] + sorted(out.glob(LEFT_BY_A_HANG))


# What a refusal says when the output dir holds checkpoints: the ways that keep them (never --overwrite_output_dir,
# which deletes them; tests/test_resume_rules.py checks every refusal).
KEEPING = "or use another --output_dir (its checkpoints stay where they are)"
RUN_CONFIG_COPY = "every checkpoint keeps a copy of it, in checkpoints/STEP/config/metadata"


def read_run_config(out: Path, overwriting: bool = False) -> dict:
    """The run_config.json in `out` ({} if none; a damaged one refused, unless `overwriting`: it goes anyway)."""
    path = out / "run_config.json"
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        saved = f"is not valid JSON ({e})"
    if isinstance(saved, dict) or overwriting:
        return saved if isinstance(saved, dict) else {}
    what = saved if isinstance(saved, str) else "is not a run config"
    raise RunError(f"{path} {what}; restore it ({RUN_CONFIG_COPY}), {KEEPING}")


# -- the output dir: check (refuse or resume), then prepare (remove only our own outputs) -----------------------------
def check_output_dir(run: Run) -> OutputDir:
    """What the output dir holds (OutputDir's verdict, with the run_config.json found there). Refuses anything else
    unasked; deletes nothing."""
    out, previous = run.out, read_run_config(run.out, overwriting=run.args.control.overwrite_output_dir)
    if not out.exists() or not any(out.iterdir()):
        return OutputDir("fresh", previous)
    if run.args.control.overwrite_output_dir:
        return OutputDir("clear", previous)
    if latest_step := checkpoints_found(out, previous or None):
        check_resume(run, previous)
        return OutputDir("resume", previous, latest_step)
    if stopped_before_its_first_checkpoint(run, previous):
        log.info("--output_dir %s holds this run, stopped before its first checkpoint: starting it over", out)
        return OutputDir("clear", previous)
    refuse_what_is_not_ours(out)
    return OutputDir("clear", previous)


# What a run leaves before its first checkpoint; an export or eval_results.json means it finished (or got further).
LEFT_BEFORE_THE_FIRST_CHECKPOINT = {
    "checkpoints",
    "tensorboard",
    "metrics.jsonl",
    "samples.jsonl",
    "run_config.json",
    "trackers.json",
    "highest_step.json",
    "wandb",
    "mlruns",
}


def stopped_before_its_first_checkpoint(run: Run, saved: dict | None) -> bool:
    """This same run (the run_config.json of these settings and global batch) stopped before any checkpoint was
    saved: a watchdog exit, a kill -9. The same command starts it over, as the exit line and the docs promise."""
    if not saved:
        return False
    found = {p.name for p in run.out.iterdir() if not p.name.startswith((".hf.tmp-", ".hf.old.tmp-"))}
    found -= {p.name for p in run.out.glob(LEFT_BY_A_HANG)} | RUN_INPUTS
    if not found <= LEFT_BEFORE_THE_FIRST_CHECKPOINT:
        return False
    same = not changed_settings(run, saved, run.args.to_json(), by_content=False)
    return same and saved.get("global_batch") == run.global_batch


def checkpoints_found(out: Path, saved: dict | None) -> int:
    """The step of the newest complete checkpoint there (an interrupted async save leaves a temporary folder), or 0;
    checkpoints without the run_config.json to check them against are refused."""
    found = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    if found and saved is None:
        raise RunError(
            f"--output_dir {out} holds checkpoints but no run_config.json, so they cannot be checked "
            f"against this run; restore the file ({RUN_CONFIG_COPY}), {KEEPING}"
        )
    return max(checkpoint.make_manager(out, read_only=True).all_steps(), default=0) if found else 0


def check_resume(run: Run, saved: dict) -> None:
    """A run to resume must have been started with these settings (those that may change are logged)."""
    out = run.out
    checkpoint.check_format(saved, out)
    check_data_format(saved, out)
    # run configs written before --optim: the optimizer was Adafactor or AdamW
    saved = {"optim": "adafactor" if saved.get("adafactor") else "adamw", **saved}
    current = run.args.to_json()
    changed = changed_settings(run, saved, current)
    if changed:
        raise RunError(
            f"--output_dir {out} holds a run with other settings ({', '.join(changed)}); use the same flags to "
            f"resume it, {KEEPING}; to start from its weights there: python -m spmdlm.export --checkpoint {out} "
            "--out DIR, then --model_name_or_path DIR"
        )
    check_mixture(run, saved)
    if saved.get("global_batch") != run.global_batch:
        raise RunError(
            f"--output_dir {out} holds a run with a global batch of {saved.get('global_batch')} "
            f"examples, this one has {run.global_batch}; resume with --global_batch_size "
            f"{saved.get('global_batch')} (any mesh that divides it), or use another --output_dir"
        )
    logged = [
        f"{k} {saved[k]} -> {current.get(k)}" for k in LOGGED_CHANGES if k in saved and saved[k] != current.get(k)
    ]
    if logged:
        log.info("resuming with changed settings: %s", ", ".join(logged))


def changed_settings(run: Run, saved: dict, current: dict, by_content: bool = True) -> list[str]:
    """The settings a resume must keep that differ from the saved run's; `by_content`: the inputs named by a path
    are left to their fingerprints (check_fingerprints, once the data is read) where the saved run recorded them."""
    keys = COMMON_RESUME_KEYS + run.family.resume_keys + tuple(f.name for f in declared_flags() if f.resume)
    if run.sources or saved.get("mixture"):
        keys = tuple(k for k in keys if k not in MIXTURE_KEYS)
    recorded = data_fingerprints(saved)
    if by_content and recorded:  # (the held-out data's fingerprint is newer than the others')
        kept = () if "validation_data" in recorded else ("validation_file",)
        keys = tuple(k for k in keys if k not in COMPARED_BY_CONTENT or k in kept)
    changed = [k for k in keys if saved.get(k) != current.get(k)]
    # Spike skipping keeps its window in the optimizer state: on/off and the window's size must match; Z may change
    spikes = lambda d: (
        bool(d.get("skip_step_on_spike")),
        d.get("spike_window", 100) if d.get("skip_step_on_spike") else None,
    )
    if spikes(saved) != spikes(current):
        changed.append("skip_step_on_spike/spike_window")
    # The parameters' average (--ema_decay) is in the optimizer state and goes on as it began (older runs: off)
    ema = lambda d: (d.get("ema_decay"), d.get("ema_start", 0) if d.get("ema_decay") else None)
    if ema(saved) != ema(current):
        changed.append("ema_decay/ema_start")
    # Token ids are set from the tokenizer after this check, so they are not compared here.
    shape_of = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("_token_id")}
    if shape_of(saved.get("model_config")) != shape_of(run.config.to_hf_dict()):
        changed.append("model config")
    return changed


def data_fingerprints(saved: dict) -> dict:
    """The fingerprints of the data and tokenizer a run_config.json recorded ({} for none: an early version's, or a
    checkpoint's copy, whose `fingerprints` are its arrays')."""
    recorded = saved.get("fingerprints") or {}
    return recorded if isinstance(recorded, dict) and "train_data" in recorded else {}


def refuse_what_is_not_ours(out) -> None:
    """A dir holding only a config/tokenizer (as the recipes prepare it) can be used as is. A run deletes only what
    it made itself, or what --overwrite_output_dir allows: the outputs of an earlier run that left no checkpoint
    (say, a finished run whose checkpoints were removed: its export) are refused, not replaced; anything else is
    someone's data."""
    # an interrupted export's temporary sibling of hf/ (spmdlm.export.save_hf) is ours too
    found = {p.name for p in out.iterdir() if not p.name.startswith((".hf.tmp-", ".hf.old.tmp-"))}
    found -= {p.name for p in out.glob(LEFT_BY_A_HANG)}
    if found - RUN_INPUTS - set(OUR_OUTPUTS):
        raise RunError(
            f"--output_dir {out} is not empty and holds no run to resume; "
            "pass --overwrite_output_dir to use it anyway or choose another --output_dir"
        )
    earlier = sorted(found & set(OUR_OUTPUTS) - {"checkpoints"})
    if earlier and not killed_in_set_up(out, found, earlier):
        kept = f" ({checkpoint.DAMAGED_DIR}/ is kept either way)" if checkpoint.DAMAGED_DIR in earlier else ""
        raise RunError(
            f"--output_dir {out} holds outputs of an earlier run but no checkpoint to resume "
            f"({', '.join(earlier)}); pass --overwrite_output_dir to replace them{kept}, or choose another "
            "--output_dir"
        )


def killed_in_set_up(out, found: set[str], earlier: list[str]) -> bool:
    """What a run killed before it wrote its run_config.json leaves (its trackers' files, the compile's record in
    metrics.jsonl; no step): nothing of any run's to keep, so the same command starts over (docs/troubleshooting.md,
    "Crash points")."""
    metrics = out / "metrics.jsonl"
    trained = metrics.is_file() and any("loss" in record for _, record in read_records(metrics))
    left = "run_config.json" not in found and set(earlier) <= {"tensorboard", "metrics.jsonl", HIGHEST_STEP_FILE}
    if left and not trained:
        log.info("%s holds what a run killed during its set-up left (%s): starting over", out, ", ".join(earlier))
    return left and not trained


def mixture_record(run: Run) -> list[dict] | None:
    """The mixture as run_config.json records it: its sources and (normalised) weights; None for one corpus."""
    return [source.to_json() for source in run.sources] or None


def check_mixture(run: Run, saved: dict) -> None:
    """A resume with other sources or weights is refused in one line unless --allow_mixture_change, which continues
    from the same step: the batches from then on are those the new weights give at those global indices."""
    before, now = saved.get("mixture"), mixture_record(run)
    if data_fingerprints(saved) and before and now:  # the sources' files: compared by content (check_fingerprints)
        named = lambda mixture: [(source["name"], source["weight"]) for source in mixture]
        if named(before) == named(now):
            return
    if before == now:
        return
    change = describe_change(before, now)
    if not run.args.control.allow_mixture_change:
        raise RunError(
            f"--output_dir {run.out} holds a run of another data mixture ({change}); resume with the "
            "same sources and weights, use another --output_dir, or pass --allow_mixture_change to "
            "continue from the same step with the new ones"
        )
    log.warning("resuming with a changed data mixture (--allow_mixture_change): %s", change)


def prepare_output_dir(run: Run, found: OutputDir) -> OutputDir:
    """Remove only what a run of ours wrote (and never the checkpoints set aside as damaged): recipes keep their
    config and tokenizer in the output dir (a tokenizer we trained ourselves goes too, or a new corpus would silently
    reuse it). -> the output dir as the run then has it (nothing previous once cleared)."""
    cleared = dataclasses.replace(found, previous={}) if found.verdict == "clear" else found
    if run.args.control.dry_running:  # writes nothing: the run is set up as if the dir had been cleared
        return cleared
    if not is_main():
        return found
    if found.verdict == "clear":
        paths = outputs_of_ours(run.out)
        if found.previous.get("trained_tokenizer"):
            paths += [run.out / name for name in TOKENIZER_FILES]
        for path in paths:
            storage.remove(path)
    run.out.mkdir(parents=True, exist_ok=True)
    return cleared


@contextlib.contextmanager
def outputs_undone_on_failure(out: Path, resuming: bool):
    """A fresh run's outputs of ours that appear in the block are removed if it fails (e.g. a tracker's folder when
    the tracker cannot start), so the same or the advised command runs next time instead of being refused."""
    ours = is_main() and out.is_dir()  # a dry run makes no output dir
    before = {p.name for p in out.iterdir()} if ours else set()
    try:
        yield
    except Exception:
        if ours and not resuming:
            for name in ({p.name for p in out.iterdir()} - before) & set(OUR_OUTPUTS):
                storage.remove(out / name)
        raise


def check_data_format(saved: dict, out) -> None:
    """A checkpointed data iterator counts the pipeline's elements: examples before DATA_FORMAT 2, host batches
    since. Restored into the other pipeline it would sit at the wrong place, so such a run is refused, not resumed."""
    found = saved.get("data_format", 1)
    if found != pipeline.DATA_FORMAT:
        raise RunError(
            f"--output_dir {out} holds checkpoints of an earlier data pipeline (format {found}: one "
            f"example per element; this version reads batches, format {pipeline.DATA_FORMAT}), whose data "
            "position cannot be restored here; resume it with the spmdlm version that started it, or "
            "continue from its weights (python -m spmdlm.export, then --model_name_or_path OUTPUT_DIR/hf "
            "in a new --output_dir)"
        )


def write_run_files(run: Run, vocabulary: Vocabulary, data: Data, layer_plan: LayerPlan | None) -> dict[str, Any]:
    """The tokenizer (unless one is there: a later export finds it beside the checkpoints) and run_config.json:
    written once the run is known to fit."""
    config = vocabulary.config
    run_config = {
        **run.args.to_json(),
        "attention_implementation": run.attention,
        "global_batch": run.global_batch,
        "layer_plan": layer_plan.record() if layer_plan else None,
        "model_config": config.to_hf_dict(),
        "trained_tokenizer": vocabulary.trained,
        "checkpoint_format": checkpoint.FORMAT,
        "data_format": pipeline.DATA_FORMAT,
        "mixture": mixture_record(run),
        "fingerprints": fingerprints(data, vocabulary.tokenizer),
        **schedule_record(run, data),
    }
    if is_main():
        if not (run.out / "tokenizer.json").exists():
            save_tokenizer(vocabulary.tokenizer, run.out, run.family, model_max_length=config.max_length)
        write_json(run.out / "run_config.json", run_config, "run_config.before_write")
    return run_config


def schedule_record(run: Run, data: Data) -> dict[str, Any]:
    """The run's length in steps and the changes of it that shape its learning-rate schedule (those continued since
    the last restart): what the next resume that changes the length continues from (resolve.extensions_of)."""
    if data.train is None:
        return {}
    total = training_schedule(data, run.args.control, run.ramp).total_steps
    length = run.schedule_length(total)
    return {
        "total_steps": total,
        "lr_schedule_extensions": length.recorded() if isinstance(length, RampedSteps) else [],
    }


def fingerprints(data: Data, tokenizer) -> dict[str, Any]:
    """What a resumed run must find unchanged, whatever paths name it: the training and the held-out records (the
    token cache's or the dataset's key, which hashes the documents, the tokenizer, the lengths and the mode; a
    mixture's by source) and the tokenizer itself."""
    splits = data.validation_splits
    held_out = {name: split.fingerprint for name, split in splits.items()}
    return {
        "train_data": data.train.fingerprint if data.train else None,
        "validation_data": held_out.get(None) if list(held_out) == [None] else (held_out or None),
        "tokenizer": tokenizer_hash(tokenizer),
    }


def check_resumable(run: Run, output_dir: OutputDir, vocabulary: Vocabulary, data: Data, total_steps: int) -> None:
    """The data and tokenizer a resumed run finds are those it started with, and its step is within this run's; a
    change of the run's length says in one line what the learning rate does."""
    check_fingerprints(run, output_dir, fingerprints(data, vocabulary.tokenizer))
    if data.train is not None and output_dir.latest_step > total_steps:  # it would report and export a later model
        raise RunError(
            f"--output_dir {run.out} holds a checkpoint at step {output_dir.latest_step}, past this run's "
            f"{total_steps} steps; give --max_steps {output_dir.latest_step} or more to continue it, or use "
            "another --output_dir"
        )
    if output_dir.resuming and data.train is not None:
        say_extension(run, output_dir.previous, total_steps)


def say_extension(run: Run, saved: dict, total_steps: int) -> None:
    """One line when this resume changed the run's length: the rate of the last step taken, of the next one, and
    what the other --lr_scheduler_on_extension would give."""
    found = [e for e in run.extensions if e.at_step == run.resume_step]
    if not found:  # an earlier version's run_config.json, of a length from epochs: not recorded
        control = run.args.control
        if "total_steps" not in saved and (saved.get("max_steps"), saved.get("num_train_epochs")) != (
            control.max_steps,
            control.num_train_epochs,
        ):
            log.warning(
                "the run's length changed, and its run_config.json (of an earlier version) does not say how long "
                "it was: the learning-rate schedule starts over for the %d steps",
                total_steps,
            )
        return
    extension, step = found[-1], run.resume_step
    if extension.steps_before == total_steps:
        return
    cfg, kind = run.args.optimization, run.args.optimization.lr_scheduler_type
    before = learning_rate_schedule(cfg, run.schedule_length(extension.steps_before))
    now = learning_rate_schedule(cfg, run.schedule_length(total_steps))
    other = dataclasses.replace(extension, restart=not extension.restart)
    alternative = dataclasses.replace(run, extensions=(*run.extensions[:-1], other))
    otherwise = learning_rate_schedule(cfg, alternative.schedule_length(total_steps))
    rates = [float(schedule(s)) for schedule, s in ((before, step - 1), (now, step), (otherwise, step))]
    change = f"the run's length changed from {extension.steps_before} to {total_steps} steps"
    if extension.restart:
        log.info(
            "%s: the %s schedule restarts over the %d steps, the learning rate going from %.3g (step %d) to %.3g "
            "at step %d (--lr_scheduler_on_extension continue would go on from the rate reached: %.3g)",
            *(change, kind, total_steps, rates[0], step, rates[1], step + 1, rates[2]),
        )
    else:
        log.info(
            "%s: the learning rate goes on from %.3g (step %d) to %.3g at step %d, along the %s schedule of %d "
            "steps scaled to start there (--lr_scheduler_on_extension restart would restart it: %.3g at step %d)",
            *(change, rates[0], step, rates[1], step + 1, kind, total_steps, rates[2], step + 1),
        )


def check_fingerprints(run: Run, output_dir: OutputDir, now: dict[str, Any]) -> None:
    """A resume on changed data (a corpus appended to or edited in place) or another tokenizer (even of the same
    size) is refused in one line, unless --allow_data_change. Runs of earlier versions recorded none: accepted."""
    saved = output_dir.previous.get("fingerprints") or {}
    if not output_dir.resuming or not saved:
        return
    names = {"train_data": "the training data", "validation_data": "the held-out data", "tokenizer": "the tokenizer"}
    changed = []
    for key, after in now.items():
        before = saved.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            # a mixture's sources: those both runs have (one added or left out is a mixture change, checked before)
            changed += [f"{names[key]} of source {n}" for n in after if n in before and before[n] != after[n]]
        elif after and before and type(before) is type(after) and before != after:
            changed.append(names[key])
    if not changed:
        return
    what = " and ".join(changed)
    if not run.args.control.allow_data_change:
        raise RunError(
            f"--output_dir {run.out} holds a run of other data: {what} changed since it started "
            "(fingerprints in run_config.json); restore them, use another --output_dir, or pass "
            "--allow_data_change to resume on the new data"
        )
    log.warning("resuming on changed data (--allow_data_change): %s changed since the run started", what)


def read_results(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "eval_results.json").read_text())
    except (OSError, ValueError):
        return {}


def export_done(out: Path) -> bool:
    """Whether the run's hf/ export is whole: its marker, written last, over the files it lists (an interrupted
    export has none, and is done again)."""
    return export_complete(out / "hf")


def missing_outputs(run: Run, data: Data, previous_results: dict) -> list[str]:
    """What a finished run would still have to write: its evaluation, its export or the export's model card."""
    missing = []
    if data.validation_splits and run.args.control.evaluating and "eval_loss" not in previous_results:
        missing.append("evaluation")
    if run.tasks is not None and not any(key.startswith(TASK_METRICS + "/") for key in previous_results):
        missing.append("LM-harness tasks")
    if run.args.output.export_hf and not export_done(run.out):
        missing.append("export")
    elif run.args.output.export_hf and not (run.out / "hf" / "README.md").is_file():  # killed before it
        missing.append("model card")
    return missing


def finished_before(run: Run, output_dir: OutputDir, data: Data, total_steps: int, previous: dict) -> bool:
    """A finished run found whole (its evaluation and export there): nothing to do."""
    if data.train is None or output_dir.latest_step < total_steps or missing_outputs(run, data, previous):
        return False
    log.info(
        "the run in %s is complete (step %d of %d) and its evaluation and export are there: nothing to do "
        "(a larger --max_steps trains it further, the learning rate going on from where it is)",
        run.out,
        output_dir.latest_step,
        total_steps,
    )
    return True
