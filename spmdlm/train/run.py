"""A training run, stage by stage, in order: `run_stages` names them. Each stage takes the frozen records and the
argument sections it needs and returns a frozen record; none writes into a shared object.

resolve (`Run`: everything that can be refused before a file is written; stages/resolve.py) -> documents (read and
refused before the output dir is touched; stages/corpora.py) -> output dir (`OutputDir`: refuse, resume or clear;
stages/outputs.py) -> tokenizer (`Vocabulary`; stages/vocabulary.py) -> data (`Data`: tokenized or opened
prepared; stages/corpora.py) -> state (`Model`: the sharded model and optimizer, its steps; stages/program.py) ->
compile (and the memory gate) -> train (`Trained`, or a checkpoint restored; loop.py) -> evaluate -> export and
publish (publish.py). `Prepared` (prepared.py) holds the records the later stages read.
"""

from __future__ import annotations

import logging
import tempfile
import time
from typing import Any

from spmdlm.run_args import RunArgs
from spmdlm.train import publish
from spmdlm.train.loop import evaluate_model, train
from spmdlm.train.prepared import Prepared
from spmdlm.train.reporting.report import Reporter, RunShape
from spmdlm.train.safety.guard import RunLock
from spmdlm.train.stages.corpora import Reading, prepare_data, read_documents, training_schedule, training_texts
from spmdlm.train.stages.outputs import (
    OutputDir,
    check_output_dir,
    check_resumable,
    finished_before,
    outputs_undone_on_failure,
    prepare_output_dir,
    read_results,
    write_run_files,
)
from spmdlm.train.stages.program import Model, compile_step, log_model, setup_state
from spmdlm.train.stages.resolve import Run, is_main, resolve
from spmdlm.train.stages.vocabulary import Vocabulary, setup_tokenizer

log = logging.getLogger("spmdlm")


def run(args: RunArgs) -> dict[str, Any]:
    if args.control.dry_running:  # writes nothing: the records go to a scratch cache, removed at the end
        with tempfile.TemporaryDirectory(prefix="spmdlm-dry-run-") as scratch:
            return run_stages(args.replace(cache_dir=scratch))
    return run_stages(args)


def run_stages(args: RunArgs) -> dict[str, Any]:
    """The run: its stages in order."""
    run = resolve(args, time.perf_counter())
    hub = publish.hub_for(run)  # a bad repository id or no token: refused before anything is written
    documents = read_documents(args.data, run.sources)
    # the lock before anything is written or removed in the output dir (a dry run does neither)
    with RunLock(run.out, enabled=is_main() and not args.control.dry_running):
        output_dir = prepare_output_dir(run, check_output_dir(run))
        prepared = prepare(run, output_dir, documents, hub)
        vocabulary, data = prepared.vocabulary, prepared.data
        check_resumable(run, output_dir, vocabulary, data, prepared.total_steps)
        reporter = make_reporter(run, vocabulary, data)
        with outputs_undone_on_failure(run.out, output_dir.resuming):  # a tracker that cannot start, a step that
            start_trackers(prepared, reporter)  # does not fit: nothing left
            model = build_model(prepared)
            previous = read_results(run.out) if output_dir.resuming else {}
            results = {"total_steps": prepared.total_steps, "parameters": model.parameters}
            if finished_before(run, output_dir, data, prepared.total_steps, previous):
                return publish.finish_again(prepared, {**results, **previous})
            stats = compile_step(model, data.objective, run, reporter) if prepared.steps_left else None
        if args.control.dry_running:  # reported in the log only: nothing is written
            return {**results, **(stats or {})}
        run_config = write_run_files(run, vocabulary, data, model.layer_plan)
        trained = train(prepared, model, reporter, run_config, stats, previous)
        results.update(trained.results)
        results.update(evaluate_model(prepared, model, trained, reporter, previous))
        publish.export_and_publish(
            prepared, model.graphdef, trained.state, trained.trained, reporter, {**previous, **results}
        )
        return results


def prepare(run: Run, output_dir: OutputDir, documents, hub=None) -> Prepared:
    """The tokenizer and data stages, and the step schedule over the data."""
    vocabulary = setup_tokenizer(run, output_dir.previous, training_texts(documents, run.sources))
    data = prepare_data(reading(run, vocabulary), documents, run.sources)
    schedule = training_schedule(data, run.args.control, run.ramp, run.args.reporting.monitor_every)
    return Prepared(run, output_dir, vocabulary, data, schedule, hub)


def reading(run: Run, vocabulary: Vocabulary) -> Reading:
    """What the data stage reads with: the run's data section and the family's objective for this tokenizer."""
    args, family = run.args, run.family
    objective = family.build_objective(args.objective, vocabulary.config, vocabulary.tokenizer)
    return Reading(args.data, args.control, vocabulary.tokenizer, family, objective)


def make_reporter(run: Run, vocabulary: Vocabulary, data) -> Reporter:
    shape = RunShape(
        run.family, vocabulary.config, data.objective, run.global_batch, run.mesh, run.args.model.dtype, run.ramp
    )
    return Reporter(run.out, enabled=is_main(), shape=shape, run_start=run.run_start, args=run.args)


def start_trackers(prepared: Prepared, reporter: Reporter) -> None:
    """First of the work under the output dir: a login or a server that fails costs no set-up."""
    if prepared.steps_left and not prepared.run.args.control.dry_run:
        reporter.start_trackers(prepared.output_dir.latest_step)


def build_model(prepared: Prepared) -> Model:
    """The sharded train state (abstract when resuming: the checkpoint fills it), logged with the run's shape."""
    run, vocabulary = prepared.run, prepared.vocabulary
    model = setup_state(
        run,
        vocabulary.config,
        prepared.data.objective,
        prepared.total_steps,
        tokenizer=vocabulary.tokenizer,
        abstract=prepared.output_dir.resuming,
    )
    log_model(run, model, prepared.total_steps)
    return model
