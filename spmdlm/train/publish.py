"""The model card of every export (OUTPUT_DIR/hf/README.md) and `--push_to_hub`: uploads to the Hugging Face Hub, or
to the hub that HF_ENDPOINT names (docs/hub.md).

The card is built with huggingface_hub's ModelCardData and EvalResult (the YAML header and `model-index` the Hub
shows) around a body written from the run's context; what it says about the model's use follows the family's
`generation` and `hf_auto_class`, so a family from another package gets a card that fits it too.

Uploads go from process 0, through HfApi (create_repo once, then upload_folder), each bounded in time (network.py: a
hub that does not answer is a failure like any other). A failed upload is one warning line and changes nothing
local: the run goes on, its exit code and outputs are what they would have been without it. That includes a full disk
where an upload writes on this host (hf_xet's cache, a bucket export's local copy, the temporary export of an upload
during training): the warning names the folder and its space.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from spmdlm import __version__, checkpoint, network, storage
from spmdlm.crashpoints import crash_point
from spmdlm.data import datasets, readers
from spmdlm.engine.optim import evaluation_needs_optimizer
from spmdlm.engine.step import model_for_evaluation
from spmdlm.errors import ArgumentError, UserError
from spmdlm.families import families
from spmdlm.hf_export import (
    TASKS,
    card_path,
    card_usage_lines,
    export_complete,
    export_state,
    save_hf,
    what_it_needs,
)
from spmdlm.mesh import batch_axis_size
from spmdlm.train.prepared import Prepared
from spmdlm.train.reporting.metrics_log import write_json
from spmdlm.train.reporting.report import Reporter
from spmdlm.train.reporting.trackers import is_eval_key
from spmdlm.train.stages.outputs import export_done
from spmdlm.train.stages.resolve import Run, is_main

log = logging.getLogger("spmdlm")

DEFAULT_ENDPOINT = "https://huggingface.co"  # huggingface_hub's own default
CARD_NAME = "README.md"
CHECKPOINT_DIR_IN_REPO = "last-checkpoint"
# The model-index metrics: eval_results.json's key -> (metric type, pretty name)
METRICS = {
    "eval_loss": ("loss", "Eval loss"),
    "eval_perplexity": ("perplexity", "Perplexity"),
    "eval_accuracy": ("accuracy", "Token accuracy"),
    "eval_bits_per_byte": ("bits_per_byte", "Bits per byte"),
}
TOKENIZER_KINDS = {"bpe": "byte-level BPE", "unigram": "Unigram (SentencePiece)"}


# -- the model card --------------------------------------------------------------------------------------------------
def write_model_card(folder, prepared: Prepared, results: dict[str, Any], *, step: int | None = None) -> None:
    """README.md of the export in `folder` (local or gs://): the run's model, data, training and `results` (as
    eval_results.json has them; none yet at an intermediate upload, whose `step` the card names)."""
    card = str(model_card(folder, prepared, results, step=step))
    storage.write_atomic(storage.path(folder) / CARD_NAME, card, "model_card.before_write")


def model_card(folder, prepared: Prepared, results: dict[str, Any], *, step: int | None = None):
    from huggingface_hub import ModelCard

    family = prepared.run.family
    model_id = repo_id_of(prepared)
    data = card_data(prepared, results, model_id)
    body = "\n".join(
        [
            f"# {model_id}",
            "",
            _summary(prepared, folder, step),
            "",
            "## Model",
            "",
            *_model_lines(prepared, folder),
            "",
            "## Training data",
            "",
            *_data_lines(prepared),
            "",
            "## Training procedure",
            "",
            *_training_lines(prepared),
            "",
            "## Evaluation",
            "",
            *_evaluation_lines(results, step, prepared.total_steps),
            "",
            "## How to use",
            "",
            *card_usage_lines(family, usage_id(prepared, folder), card_path(folder)),
            "",
            trained_with(),
            "",
        ]
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def card_data(prepared: Prepared, results: dict[str, Any], model_id: str):
    """The card's YAML header: the Hub's metadata and `model-index` of the held-out metrics."""
    from huggingface_hub import EvalResult, ModelCardData

    output, family = prepared.run.args.output, prepared.run.family
    task = TASKS[family.generation]
    datasets_given = _split(output.card_datasets)
    return ModelCardData(
        library_name="transformers",
        license=output.card_license,
        pipeline_tag=task,
        tags=[family.name, "spmdlm", task, *_split(output.card_tags)],
        datasets=datasets_given or None,
        model_name=model_id,
        eval_results=[
            EvalResult(
                task_type=task,
                dataset_type=datasets_given[0] if datasets_given else "text",
                dataset_name=datasets_given[0] if datasets_given else "held-out text",
                dataset_split="validation",
                metric_type=metric,
                metric_name=name,
                metric_value=results[key],
            )
            for key, (metric, name) in METRICS.items()
            if key in results
        ]
        or None,
    )


def trained_with() -> str:
    """The card's last line: spmdlm's version and what it pretrains (every registered family)."""
    names = list(families())
    listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else "".join(names)
    return f"Trained with spmdlm {__version__} (JAX and Flax NNX pretraining of {listed})."


def usage_id(prepared: Prepared, folder) -> str:
    """What the usage snippet of the card of the export in `folder` loads: the model's Hub id with --push_to_hub or
    --hub_model_id, else the export by a relative path (hf_export.card_path: never an absolute local one)."""
    on_hub = prepared.hub is not None or prepared.run.args.output.hub_model_id
    return repo_id_of(prepared) if on_hub else card_path(folder)


def repo_id_of(prepared: Prepared) -> str:
    """The model's name on the card: its Hub repository (user/name once the repository exists), else the output
    dir's name."""
    return prepared.hub.repo_id if prepared.hub is not None else default_repo_id(prepared.run)


def default_repo_id(run: Run) -> str:
    return run.args.output.hub_model_id or storage.absolute(run.out).name


def _summary(prepared: Prepared, folder, step: int | None) -> str:
    what = (
        f"the model at step {step} of {prepared.total_steps} (an upload during training)"
        if step is not None
        else f"the model after {prepared.total_steps} steps"
    )
    start = (
        f"from `{prepared.run.args.model.model_name_or_path}`"
        if prepared.run.args.model.model_name_or_path
        else "from scratch"
    )
    return (
        f"A {prepared.run.family.name} model ({_count(parameter_count(folder))} parameters) pretrained {start} with "
        f"spmdlm: {what}, exported in transformers format for `{prepared.run.family.hf_auto_class}`."
    )


def parameter_count(folder) -> int:
    """The parameters of the export's model.safetensors, from its header (tied weights are stored once)."""
    with storage.path(folder).joinpath("model.safetensors").open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def _model_lines(prepared: Prepared, folder) -> list[str]:
    config, family, tok = prepared.vocabulary.config, prepared.run.family, prepared.vocabulary.tokenizer
    counts = list(family.table.layer_counts(config).values())
    layers = (
        f"{counts[0]} encoder and {counts[1]} decoder layers"
        if family.is_encoder_decoder and len(counts) == 2
        else f"{sum(counts)} layers"
    )
    width = next(
        (getattr(config, name) for name in ("hidden_size", "d_model", "n_embd") if hasattr(config, name)), None
    )
    spec = family.tokenizer
    origin = "trained on the training corpus" if prepared.vocabulary.trained else "given"
    return [
        f"- family: {family.name} (`{family.hf_auto_class}`), config {prepared.run.config_source}",
        f"- size: {parameter_count(folder):,} parameters, {layers}" + (f", width {width}" if width else ""),
        f"- positions: {config.max_length}, vocabulary {config.vocab_size:,}",
        f"- tokenizer: {TOKENIZER_KINDS.get(spec.kind, spec.kind)}, {tok.get_vocab_size():,} tokens ({origin})",
    ]


def _data_lines(prepared: Prepared) -> list[str]:
    args, train = prepared.run.args, prepared.data.train
    if prepared.run.sources:
        lines = [
            f"A weighted mixture of {len(prepared.run.sources)} sources:",
            "",
            "| source | weight | records | tokens |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {s.name} | {s.weight:.3g} | {split.num_records:,} | {split.num_tokens:,} |"
            for s, split in zip(prepared.run.sources, train.splits)
        ]
        return lines
    if args.data.dataset_dir:
        card = prepared.data.dataset_cards.get(args.data.dataset_dir) or datasets.read_card(
            args.data.dataset_dir
        )  # trained on
        files = card["read"].get("files")  # none: a launcher run's token cache
        counts = ([f"{files:,} files"] if files else []) + [
            f"{card['splits']['train']['documents']:,} training documents"
        ]
        source = f"the prepared dataset `{args.data.dataset_dir}` ({', '.join(counts)})"
    elif args.data.dataset_name:
        source = f"the datasets dataset `{args.data.dataset_name}`" + (
            f" ({args.data.dataset_config_name})" if args.data.dataset_config_name else ""
        )
    elif args.data.train_file:
        documents = train.documents
        source = f"`{args.data.train_file}` ({len(readers.expand_files(args.data.train_file)):,} files" + (
            f", {documents:,} training documents)" if documents else ")"
        )
    else:
        source = "the embedded corpus (this Python's standard library sources)"
    held_out = (
        f"`{args.data.validation_file}`"
        if args.data.validation_file
        else f"{args.data.validation_split_percentage:g}% of the documents, held out by content hash"
    )
    return [
        f"- corpus: {source}",
        f"- training records: {train.num_records:,} of {train.record_length} tokens ({train.num_tokens:,} tokens)",
        f"- evaluation: {held_out}",
    ]


def _training_lines(prepared: Prepared) -> list[str]:
    run = prepared.run
    args, mesh, optim = run.args, run.mesh, run.args.optimization
    lengths = ", ".join(f"{name} {length}" for name, length in prepared.data.objective.sequence_lengths().items())
    optimizer = optim.optim
    if optim.optim != "adafactor":
        optimizer += f" (beta1 {optim.adam_beta1:g}, beta2 {optim.adam_beta2:g}" + (
            f", epsilon {optim.adam_epsilon:g})" if "adamw" in optim.optim else ")"
        )
    schedule = optim.lr_scheduler_type + (f", floor {optim.min_lr_ratio:g} of the peak" if optim.min_lr_ratio else "")
    device = mesh.devices.flat[0]
    flags = ", ".join(f"--{flag.name} {flag.of(args.objective)}" for flag in run.family.flags)
    axes = {axis: size for axis, size in mesh.shape.items() if size > 1} or dict(mesh.shape)
    kind = f" ({device.device_kind})" if device.device_kind.lower() != device.platform else ""
    return [
        f"- steps: {prepared.total_steps:,}; global batch {run.global_batch} examples ({run.stages[-1].per_device} "
        f"per device x {batch_axis_size(mesh)} batch devices x {run.stages[-1].accumulation} accumulation)"
        + (f", ramped up by --batch_size_ramp {run.ramp.spec()}" if run.ramp.ramps else ""),
        f"- sequence lengths: {lengths}; objective flags: {flags}",
        f"- optimizer: {optimizer}; learning rate {optim.learning_rate:g}, {schedule} schedule, "
        f"{optim.warmup_steps} warmup steps; weight decay {optim.weight_decay:g}; gradient clipping "
        f"{optim.max_grad_norm:g}",
        f"- dtype: {args.model.dtype}; seed {args.control.seed}",
        f"- weights: {_weights_line(optim)}",
        f"- mesh: {', '.join(f'{axis}={size}' for axis, size in axes.items())} over {mesh.size} {device.platform} "
        f"devices{kind}" + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""),
    ]


def _weights_line(optim) -> str:
    """Which parameters this export holds (the run's `hf/`: those it evaluated, step.model_for_evaluation)."""
    if evaluation_needs_optimizer(optim):
        return f"the average {optim.optim} evaluates (not its iterate)"
    if optim.ema_decay is None:
        return "the trained parameters"
    return (
        f"the trained parameters (raw); their moving average (--ema_decay {optim.ema_decay:g} from step "
        f"{optim.ema_start}, evaluated as eval_ema_*) is in the checkpoints: `python -m spmdlm.export --weights ema`"
    )


def _evaluation_lines(results: dict[str, Any], step: int | None, total_steps: int) -> list[str]:
    rows = [
        (key, value)
        for key, value in results.items()
        if (key.startswith(("eval_", "eval/")) or key == "train_loss") and isinstance(value, (int, float))
    ]
    if not rows:
        return [
            f"None yet: this upload is the model at step {step} of {total_steps}; the final upload has the evaluation."
            if step is not None
            else "The run did not evaluate (no held-out data)."
        ]
    return ["| metric | value |", "| --- | --- |", *(f"| {key} | {value:.6g} |" for key, value in rows)]


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


# -- uploads -----------------------------------------------------------------------------------------------------------
class Hub:
    """One repository on one hub (HF_ENDPOINT as it is when the run starts), created at the first upload."""

    def __init__(self, repo_id: str, *, endpoint: str, token: str, private: bool, export_dir):
        from huggingface_hub import HfApi

        self.repo_id, self.endpoint, self.private, self.created = repo_id, endpoint, private, False
        self.export_dir = export_dir  # what a failed upload's warning says to upload by hand
        # endpoint passed explicitly: huggingface_hub reads HF_ENDPOINT only once, when it is first imported
        self.api = HfApi(endpoint=endpoint, token=token, library_name="spmdlm", library_version=__version__)

    def create(self) -> bool:
        """The repository, once (it may exist already); its full id (user/name) from then on."""
        if not self.created:
            try:
                with _quiet_hub_logs():
                    # private=None leaves the visibility to the hub (public, or an organisation's default)
                    url = network.bounded(
                        lambda: self.api.create_repo(self.repo_id, private=self.private or None, exist_ok=True)
                    )
            except Exception as e:  # noqa: BLE001 - any failure (network, HTTP, auth) must leave the run as it is
                self.warn("creating the repository", e)
                return False
            self.repo_id, self.created = url.repo_id, True
        return self.created

    def upload(self, folder, what: str, *, path_in_repo: str | None = None, replace: bool = False) -> bool:
        """`folder` (local or gs://), which holds `what`, into the repository (at `path_in_repo`); `replace`: what
        else was there is deleted in the same commit. True when it is there."""
        if not self.create():
            return False
        try:
            with _local(folder) as local, _quiet_hub_logs():
                size = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
                crash_point("hub.before_upload", _staging(folder, local))
                network.bounded(
                    lambda: self.api.upload_folder(
                        repo_id=self.repo_id,
                        folder_path=local,
                        path_in_repo=path_in_repo,
                        commit_message=f"spmdlm: {what}",
                        delete_patterns="*" if replace else None,
                    ),
                    network.timeout_s() + size / network.UPLOAD_BYTES_PER_S,
                )
        except Exception as e:  # noqa: BLE001 - as in create
            self.warn(f"uploading {what} to", e)
            return False
        log.info(
            "uploaded %s to %s/%s%s",
            what,
            self.endpoint,
            self.repo_id,
            f"/tree/main/{path_in_repo}" if path_in_repo else "",
        )
        return True

    def warn(self, what: str, error: Exception) -> None:
        """The one line of a failed upload: `what` failed, why, and the fix."""
        status = getattr(getattr(error, "response", None), "status_code", None)
        retry = f"re-run the same command to retry, or upload with `hf upload {self.repo_id} {self.export_dir}`"
        if storage.no_space(error):
            first, fix = _full_disk_clause(error), f"free some space there, then {retry}"
        else:
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            fix = (
                "check the token (--hub_token, HF_TOKEN or `hf auth login`) and its write access to the repository"
                if status in (401, 403)
                else retry
            )
        log.warning(
            "--push_to_hub: %s %s on %s failed: %s; the run and its outputs are unaffected; %s",
            what,
            self.repo_id,
            self.endpoint,
            first,
            fix,
        )


def _staging(folder, local: Path) -> Path:
    """Where uploading `folder` writes on this host: a bucket folder's local copy, else hf_xet's cache."""
    return local if storage.is_remote(folder) else _xet_cache()


def _xet_cache() -> Path:
    """hf_xet's cache (HF_XET_CACHE, default HF_HOME/xet), where upload_folder stages what it sends."""
    from huggingface_hub import constants

    return Path(constants.HF_XET_CACHE)


def _full_disk_clause(error: Exception) -> str:
    """A full disk met by an upload, in one clause: the folder and its space. Our writers' lines (the temporary
    export's, its card's) say it themselves before their fix; an OSError names its file; hf_xet's errors name none:
    its cache, where it stages."""
    if isinstance(error, UserError):
        return str(error).partition("; ")[0]
    return storage.full_disk_clause(getattr(error, "filename", None) or _xet_cache())


def hub_for(run: Run) -> Hub | None:
    """The run's Hub on process 0 with --push_to_hub, else None. Refuses (ArgumentError, before anything is written)
    a repository id the Hub would refuse and a missing token."""
    args = run.args
    if not args.output.push_to_hub or not is_main():
        return None
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = default_repo_id(run)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        given = "--hub_model_id" if args.output.hub_model_id else f"the output dir's name ({args.control.output_dir})"
        reason = str(e).splitlines()[0]
        raise ArgumentError(
            f"--push_to_hub: {given} {repo_id!r} is not a Hub repository id ({reason}); give "
            "--hub_model_id NAME or USER/NAME"
        ) from None
    # --token: the HF scripts' name for it; get_token: HF_TOKEN, else the saved login
    token = args.output.hub_token or args.compat.token or get_token()
    if not token:
        raise ArgumentError("--push_to_hub needs a Hub token: give --hub_token, set HF_TOKEN or run `hf auth login`")
    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    network.timeout_s()  # a bad SPMDLM_NETWORK_TIMEOUT: refused now
    return Hub(repo_id, endpoint=endpoint, token=token, private=args.output.hub_private_repo, export_dir=run.out / "hf")


# -- the end of a run: eval_results.json, the export, the card and the upload ----------------------------------------
def export_and_publish(prepared: Prepared, graphdef, state, trained: bool, reporter: Reporter, results: dict) -> None:
    """eval_results.json and the summary; the export (the parameters evaluation reads, of `state`) unless one is
    there from the same training (`trained`: steps ran in this invocation); the model card, and the upload with
    --push_to_hub."""
    run, vocabulary = prepared.run, prepared.vocabulary
    if is_main():
        if trained:  # goodput is of an invocation that trained; one that only redoes outputs keeps the run's
            results.update(reporter.log_goodput(prepared.total_steps))
        write_json(
            run.out / "eval_results.json",
            {k: v for k, v in results.items() if is_eval_key(k) or k.startswith(("train_", "goodput"))},
            "eval_results.before_write",
        )
        reporter.finish(results)
    if run.args.output.export_hf and prepared.training and (trained or not export_done(run.out)):
        evaluated = nnx.state(model_for_evaluation(graphdef, state, run.args.optimization))
        export_state(graphdef, evaluated, vocabulary.config, run.out / "hf", tokenizer=vocabulary.tokenizer)
        needs = what_it_needs(run.family, run.out / "hf")  # None: PyTorch is installed
        log.info("exported to %s%s", run.out / "hf", f": {needs}" if needs else "")
    publish_export(prepared, results)


def finish_again(prepared: Prepared, results: dict[str, Any]) -> dict[str, Any]:
    """A finished run found whole: re-running it retries its upload."""
    if prepared.run.args.output.push_to_hub:
        publish_export(prepared, results)
    return results


def publish_export(prepared: Prepared, results: dict[str, Any]) -> None:
    """The end of a training run: the model card into OUTPUT_DIR/hf (with `results`, as finish() has them), and the
    export uploaded with --push_to_hub. Nothing without a whole export, or in a run that did not train (its context
    does not describe the training)."""
    folder = prepared.run.out / "hf"
    if prepared.data.train is None or not export_complete(folder):
        return
    given_id = prepared.hub.repo_id if prepared.hub is not None else None
    if is_main():  # first, whatever the hub does
        write_model_card(folder, prepared, results)
    if prepared.hub is not None and prepared.hub.create():
        if prepared.hub.repo_id != given_id:  # the card names the repository's full id (user/name), known now
            write_model_card(folder, prepared, results)
        prepared.hub.upload(folder, f"{prepared.run.family.name} after {prepared.total_steps} steps")


def push_checkpoint(prepared: Prepared, graphdef, state, step: int, manager) -> None:
    """After the checkpoint of `step` (every process calls it): --hub_strategy every_save uploads the model as of
    `step`, exported to a temporary folder (every process joins the export's gathers); checkpoint also uploads the
    checkpoint itself under last-checkpoint/ (replacing the one there), once its asynchronous save is complete. The
    final step's model is left to the end's upload (publish_export), which has the evaluation."""
    args = prepared.run.args
    if not args.output.push_to_hub or args.output.hub_strategy == "end":
        return
    if step < prepared.total_steps or not args.output.export_hf:
        _push_model(prepared, graphdef, state, step)
    if args.output.hub_strategy == "checkpoint":
        checkpoint.check_saved(manager, step, wait=True)
        if prepared.hub is not None:
            prepared.hub.upload(
                checkpoint.checkpoint_dir(prepared.run.out) / str(step),
                f"checkpoint at step {step}",
                path_in_repo=CHECKPOINT_DIR_IN_REPO,
                replace=True,
            )


def _push_model(prepared: Prepared, graphdef, state, step: int) -> None:
    """The model as of `step` exported to a temporary folder (every process joins the export's gathers, process 0
    writes), with its card, and uploaded. A full disk there (TMPDIR) fails this upload, not the run: one warning."""
    hub, what = prepared.hub, f"{prepared.run.family.name} at step {step} of {prepared.total_steps}"
    try:
        with tempfile.TemporaryDirectory(prefix="spmdlm-hub-") as tmp:
            model, _ = model_for_evaluation(graphdef, state, prepared.run.args.optimization)
            vocabulary = prepared.vocabulary
            folder = save_hf(model, vocabulary.config, Path(tmp) / "hf", tokenizer=vocabulary.tokenizer)
            if hub is not None and hub.create():
                write_model_card(folder, prepared, {}, step=step)
                hub.upload(folder, what)
    except (OSError, UserError) as e:  # save_hf's and the card's full-disk lines, or the folder's own OSError
        if hub is None or not storage.no_space(e):
            raise
        hub.warn(f"uploading {what} to", e)


@contextlib.contextmanager
def _local(folder) -> Iterator[Path]:
    """`folder` itself, or a bucket folder's copy in a temporary directory removed afterwards (upload_folder reads
    local files)."""
    if not storage.is_remote(folder):
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="spmdlm-hub-") as tmp:
        for file in storage.files_under(folder):
            storage.download(file, Path(tmp) / str(file)[len(str(folder).rstrip("/")) + 1 :], progress=False)
        yield Path(tmp)


@contextlib.contextmanager
def _quiet_hub_logs() -> Iterator[None]:
    """huggingface_hub's own log lines while it works (each HTTP request, retries in smaller commits, unchanged
    files): a failure is reported once, by Hub.warn."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "httpx", "httpx2")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
