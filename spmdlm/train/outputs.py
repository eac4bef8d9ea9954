"""The output dir's policy: what a run may find there (a run to resume, our own outputs, someone's data), what it
may remove, and the files it leaves for a resume and for the next run (run_config.json, eval_results.json).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from spmdlm import checkpoint, storage
from spmdlm.data import pipeline
from spmdlm.data.datasets import tokenizer_hash
from spmdlm.data.mixture import describe_change
from spmdlm.data.tokenization import save_tokenizer
from spmdlm.errors import RunError
from spmdlm.generation.harness import TASK_METRICS
from spmdlm.hf_export import export_complete
from spmdlm.optimizers import declared_flags
from spmdlm.train.guard import LOCK_NAME
from spmdlm.train.metrics_log import HIGHEST_STEP_FILE, read_records, write_json
from spmdlm.train.setup import RunContext, is_main

log = logging.getLogger("spmdlm")

# Run arguments that must match for a run to resume in the same output dir, besides the model config, the global
# batch, the family's own (its objective's flags) and the optimizers' own that say so (`Flag.resume`). Others may
# change: logging cadence, the mesh (the state is restored into the new shardings), or the step budget (which also
# stretches the learning-rate schedule).
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
    "gradient_accumulation_steps",
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
    "logging_steps",
    "eval_steps",
    "save_steps",
    "max_grad_norm",
    "z_loss",
    "mesh",
    "dtype",
    "sample_prompts",
    "sample_every",
)
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
    "hf",
    "run_config.json",
    "trackers.json",
    "highest_step.json",  # metrics_log.HIGHEST_STEP_FILE
    "wandb",
    "mlruns",
)
LEFT_BY_A_HANG = "hang-*.txt"  # watchdog.py's stacks of a hung run, one per host: ours, kept when resuming


def outputs_of_ours(out: Path) -> list[Path]:
    """What a run of ours wrote in `out` (the damaged checkpoints aside, which are never deleted)."""
    names = [name for name in OUR_OUTPUTS if name != checkpoint.DAMAGED_DIR]
    return [out / name for name in names] + sorted(out.glob(LEFT_BY_A_HANG))


def read_run_config(out: Path) -> dict:
    path = out / "run_config.json"
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(
            f"{path} is not valid JSON ({e}); restore it, or start afresh with --overwrite_output_dir"
        ) from None
    if not isinstance(saved, dict):
        raise RunError(f"{path} is not a run config; restore it, or start afresh with --overwrite_output_dir")
    return saved


# -- the output dir: check (refuse or resume), then prepare (remove only our own outputs) -----------------------------
def check_output_dir(ctx: RunContext) -> str:
    """-> 'resume' (a run of these settings is there), 'fresh' (nothing to keep) or 'clear' (our outputs to remove).
    Refuses anything else unasked; deletes nothing. Reads the run_config.json found there into ctx.previous."""
    ctx.previous = read_run_config(ctx.out)
    out, saved = ctx.out, ctx.previous or None
    if not out.exists() or not any(out.iterdir()):
        return "fresh"
    if ctx.args.control.overwrite_output_dir:
        return "clear"
    if has_checkpoints(ctx, saved):
        check_resume(ctx, saved)
        return "resume"
    refuse_what_is_not_ours(out)
    return "clear"


def has_checkpoints(ctx: RunContext, saved: dict | None) -> bool:
    """Whether complete checkpoints are there (an interrupted async save leaves a temporary folder), their step in
    ctx.latest_step; checkpoints without the run_config.json to check them against are refused."""
    out = ctx.out
    found = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    if found and saved is not None:
        ctx.latest_step = max(checkpoint.make_manager(out, read_only=True).all_steps(), default=0)
        found = ctx.latest_step > 0
    if found and saved is None:
        raise RunError(
            f"--output_dir {out} holds checkpoints but no run_config.json, so they cannot be checked "
            "against this run; restore the file, choose another --output_dir, or --overwrite_output_dir"
        )
    return found


def check_resume(ctx: RunContext, saved: dict) -> None:
    """A run to resume must have been started with these settings (those that may change are logged)."""
    out = ctx.out
    checkpoint.check_format(saved, out)
    check_data_format(saved, out)
    # run configs written before --optim: the optimizer was Adafactor or AdamW
    saved = {"optim": "adafactor" if saved.get("adafactor") else "adamw", **saved}
    current = ctx.args.to_json()
    changed = changed_settings(ctx, saved, current)
    if changed:
        raise RunError(
            f"--output_dir {out} holds a run with other settings ({', '.join(changed)}); "
            "use the same flags to resume, another --output_dir, or --overwrite_output_dir"
        )
    check_mixture(ctx, saved)
    if saved.get("global_batch") != ctx.global_batch:
        raise RunError(
            f"--output_dir {out} holds a run with a global batch of {saved.get('global_batch')} "
            f"examples, this one has {ctx.global_batch}; resume with --global_batch_size "
            f"{saved.get('global_batch')} (any mesh that divides it), or use another --output_dir"
        )
    logged = [
        f"{k} {saved[k]} -> {current.get(k)}" for k in LOGGED_CHANGES if k in saved and saved[k] != current.get(k)
    ]
    if logged:
        log.info("resuming with changed settings: %s", ", ".join(logged))


def changed_settings(ctx: RunContext, saved: dict, current: dict) -> list[str]:
    """The settings a resume must keep that differ from the saved run's."""
    keys = COMMON_RESUME_KEYS + ctx.family.resume_keys + tuple(f.name for f in declared_flags() if f.resume)
    if ctx.sources or saved.get("mixture"):
        keys = tuple(k for k in keys if k not in MIXTURE_KEYS)
    changed = [k for k in keys if saved.get(k) != current.get(k)]
    # Spike skipping keeps its window in the optimizer state: on/off and the window's size must match; Z may change
    spikes = lambda d: (
        bool(d.get("skip_step_on_spike")),
        d.get("spike_window", 100) if d.get("skip_step_on_spike") else None,
    )
    if spikes(saved) != spikes(current):
        changed.append("skip_step_on_spike/spike_window")
    # Token ids are set from the tokenizer after this check, so they are not compared here.
    shape_of = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("_token_id")}
    if shape_of(saved.get("model_config")) != shape_of(ctx.config.to_hf_dict()):
        changed.append("model config")
    return changed


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


def mixture_record(ctx: RunContext) -> list[dict] | None:
    """The mixture as run_config.json records it: its sources and (normalised) weights; None for one corpus."""
    return [source.to_json() for source in ctx.sources] or None


def check_mixture(ctx: RunContext, saved: dict) -> None:
    """A resume with other sources or weights is refused in one line unless --allow_mixture_change, which continues
    from the same step: the batches from then on are those the new weights give at those global indices."""
    before, now = saved.get("mixture"), mixture_record(ctx)
    if before == now:
        return
    change = describe_change(before, now)
    if not ctx.args.control.allow_mixture_change:
        raise RunError(
            f"--output_dir {ctx.out} holds a run of another data mixture ({change}); resume with the "
            "same sources and weights, use another --output_dir, or pass --allow_mixture_change to "
            "continue from the same step with the new ones"
        )
    log.warning("resuming with a changed data mixture (--allow_mixture_change): %s", change)


def prepare_output_dir(ctx: RunContext, verdict: str) -> None:
    """Remove only what a run of ours wrote (and never the checkpoints set aside as damaged): recipes keep their
    config and tokenizer in the output dir (a tokenizer we trained ourselves goes too, or a new corpus would silently
    reuse it)."""
    ctx.resuming = verdict == "resume"
    if ctx.args.control.dry_running:  # writes nothing: the run is set up as if the dir had been cleared
        if verdict == "clear":
            ctx.previous = {}
        return
    if not is_main():
        return
    if verdict == "clear":
        paths = outputs_of_ours(ctx.out)
        if ctx.previous.get("trained_tokenizer"):
            paths += [ctx.out / name for name in TOKENIZER_FILES]
        for path in paths:
            storage.remove(path)
        ctx.previous = {}
    ctx.out.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def outputs_undone_on_failure(ctx: RunContext):
    """A fresh run's outputs of ours that appear in the block are removed if it fails (e.g. a tracker's folder when
    the tracker cannot start), so the same or the advised command runs next time instead of being refused."""
    ours = is_main() and ctx.out.is_dir()  # a dry run makes no output dir
    before = {p.name for p in ctx.out.iterdir()} if ours else set()
    try:
        yield
    except Exception:
        if ours and not ctx.resuming:
            for name in ({p.name for p in ctx.out.iterdir()} - before) & set(OUR_OUTPUTS):
                storage.remove(ctx.out / name)
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


def write_run_files(ctx: RunContext) -> dict[str, Any]:
    """The tokenizer (unless one is there: a later export finds it beside the checkpoints) and run_config.json:
    written once the run is known to fit."""
    run_config = {
        **ctx.args.to_json(),
        "attention_implementation": ctx.attention,
        "global_batch": ctx.global_batch,
        "layer_plan": ctx.layer_plan.record() if ctx.layer_plan else None,
        "model_config": ctx.config.to_hf_dict(),
        "trained_tokenizer": ctx.trained_tokenizer,
        "checkpoint_format": checkpoint.FORMAT,
        "data_format": pipeline.DATA_FORMAT,
        "mixture": mixture_record(ctx),
        "fingerprints": fingerprints(ctx),
    }
    if is_main():
        if not (ctx.out / "tokenizer.json").exists():
            save_tokenizer(ctx.tokenizer, ctx.out, ctx.family, model_max_length=ctx.config.max_length)
        write_json(ctx.out / "run_config.json", run_config, "run_config.before_write")
    return run_config


def fingerprints(ctx: RunContext) -> dict[str, Any]:
    """What a resumed run must find unchanged: the training records (the token cache's or the dataset's key, which
    hashes the documents, the tokenizer, the lengths and the mode; a mixture's by source) and the tokenizer
    itself."""
    train = ctx.data.train if ctx.data else None
    return {"train_data": train.fingerprint if train else None, "tokenizer": tokenizer_hash(ctx.tokenizer)}


def check_fingerprints(ctx: RunContext) -> None:
    """A resume on changed data (a corpus appended to or edited in place) or another tokenizer (even of the same
    size) is refused in one line, unless --allow_data_change. Runs of earlier versions recorded none: accepted."""
    saved = ctx.previous.get("fingerprints") or {}
    if not ctx.resuming or not saved:
        return
    now = fingerprints(ctx)
    names = {"train_data": "the training data", "tokenizer": "the tokenizer"}
    changed = [
        names[k]
        for k, v in now.items()
        if v and saved.get(k) and type(saved[k]) is type(v) and not isinstance(v, dict) and saved[k] != v
    ]
    # a mixture's sources: those both runs have (a source added or left out is a mixture change, checked before)
    before, after = saved.get("train_data"), now["train_data"]
    if isinstance(before, dict) and isinstance(after, dict):
        changed += [
            f"the training data of source {name}" for name in after if name in before and before[name] != after[name]
        ]
    if not changed:
        return
    what = " and ".join(changed)
    if not ctx.args.control.allow_data_change:
        raise RunError(
            f"--output_dir {ctx.out} holds a run of other data: {what} changed since it started "
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


def missing_outputs(ctx: RunContext, previous_results: dict) -> list[str]:
    """What a finished run would still have to write: its evaluation, its export or the export's model card."""
    missing = []
    if ctx.data.validation_splits and ctx.args.control.evaluating and "eval_loss" not in previous_results:
        missing.append("evaluation")
    if ctx.tasks is not None and not any(key.startswith(TASK_METRICS + "/") for key in previous_results):
        missing.append("LM-harness tasks")
    if ctx.args.output.export_hf and not export_done(ctx.out):
        missing.append("export")
    elif ctx.args.output.export_hf and not (ctx.out / "hf" / "README.md").is_file():  # killed before it
        missing.append("model card")
    return missing
