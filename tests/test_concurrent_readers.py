"""Readers beside a writer: `spmdlm.export` (and evaluate, generate: the same reads) of a run that is saving reads the
newest committed checkpoint and says in one line that a newer one is being written; a checkpoint deleted under it
(--save_total_limit) is no damage; two exports into one --out take turns (the second refuses, naming the first).

The run "saving" is a run.lock held by a live process (a `sleep`), the checkpoint being written a half-written step
folder laid out beside the committed ones, the deletion a restore that removes its folder: no real concurrency."""

import json
import logging
import os
import shutil
import socket
import subprocess
import threading

import pytest
from test_reliability import flags

from spmdlm import checkpoint
from spmdlm.cli.export import main as export_main
from spmdlm.launch import main
from spmdlm.storage import RUN_LOCK_NAME
from spmdlm.train.safety.guard import ExportLock


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, cache_dir, tiny_gpt2_config):
    """A finished tiny run: checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("readers") / "run"
    assert main(flags(out, cache_dir, tiny_gpt2_config, "--do_eval", "false")) == 0
    return out


@pytest.fixture
def run(saved_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


@pytest.fixture
def live_pid():
    """The pid of a live process of this host that is not this one."""
    child = subprocess.Popen(["sleep", "120"])
    yield child.pid
    child.kill()
    child.wait()


def hold(lock_path, pid: int) -> None:
    lock_path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "2026-12-07 20:00:00"}))


def half_written(out, step: int):
    """A step orbax is writing: its temporary folder (renamed on commit; in a bucket, where there is no rename, it
    writes the step folder in place and orbax does not list it before its commit marker), part of the model in it."""
    folder = out / "checkpoints" / f"{step}{checkpoint.TMP_MARK}-1765137600000000" / "model"
    folder.mkdir(parents=True)
    (folder / "partial").write_bytes(b"\0" * 1000)
    return folder.parent


def steps_read(out, caplog) -> list[int]:
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        return checkpoint.all_complete_steps(checkpoint.make_manager(out, read_only=True), move_aside=False)


@pytest.mark.slow
def test_a_checkpoint_being_written_is_not_damage(run, live_pid, caplog):
    hold(run / RUN_LOCK_NAME, live_pid)
    half_written(run, 6)
    assert steps_read(run, caplog) == [2, 4]
    assert "incomplete or damaged" not in caplog.text
    said = [r.getMessage() for r in caplog.records if "being written" in r.getMessage()]
    assert said == [
        f"a newer checkpoint (step 6) is being written by the run saving in {run}; reading the newest committed one "
        "(step 4)"
    ]


@pytest.mark.slow
def test_without_a_run_saving_a_leftover_temporary_folder_is_passed_over_silently(run, caplog):
    half_written(run, 6)  # an interrupted save's: orbax lists it never, and nobody is writing it
    assert steps_read(run, caplog) == [2, 4]
    assert "being written" not in caplog.text and "damaged" not in caplog.text


@pytest.mark.slow
def test_a_checkpoint_committed_after_the_listing_is_read_not_called_damaged(run, caplog):
    """The reader lists the steps; the run then commits step 6 (its rename): listed again, not 'incomplete'."""
    manager = checkpoint.make_manager(run, read_only=True)
    shutil.copytree(run / "checkpoints" / "4", run / "checkpoints" / "6")
    with caplog.at_level(logging.INFO, logger="spmdlm"):
        assert checkpoint.all_complete_steps(manager, move_aside=False) == [2, 4, 6]
    assert "incomplete or damaged" not in caplog.text


def test_only_another_live_process_holding_run_lock_is_a_run_saving(tmp_path, live_pid):
    """An evaluation-only launch holds its own run.lock, and a lock of a process that is gone is no one's: a step
    folder that fails to read there is damage (no wait for it to vanish)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    manager = checkpoint.make_manager(run, read_only=True)
    assert not checkpoint.run_is_saving(manager)
    hold(run / RUN_LOCK_NAME, os.getpid())
    assert not checkpoint.run_is_saving(manager) and not checkpoint.vanished(manager, 4)
    gone = subprocess.Popen(["true"])
    gone.wait()
    hold(run / RUN_LOCK_NAME, gone.pid)
    assert not checkpoint.run_is_saving(manager)
    hold(run / RUN_LOCK_NAME, live_pid)
    assert checkpoint.run_is_saving(manager)


@pytest.mark.slow
@pytest.mark.parametrize("deletion", ["done", "in_progress"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned reads
def test_a_checkpoint_deleted_while_it_is_read_is_read_again_from_the_newest(
    run, live_pid, tmp_path, monkeypatch, capsys, caplog, deletion
):
    """The export reads step 4; the run deletes it meanwhile (its --save_total_limit): the export reads step 2 and
    says why, instead of 'check that the checkpoints are this run's'."""
    hold(run / RUN_LOCK_NAME, live_pid)
    real_restore, step_4 = checkpoint.restore, run / "checkpoints" / "4"

    def restore_while_deleting(manager, step, *args, **kwargs):
        if step == 4 and step_4.exists():
            next((step_4 / "model").rglob("d/*")).unlink()  # its files go first...
            if deletion == "done":
                shutil.rmtree(step_4)
            else:  # ...the folder last, a moment after the read failed
                threading.Timer(0.3, shutil.rmtree, (step_4,)).start()
        return real_restore(manager, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "restore", restore_while_deleting)
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        code = export_main(["--checkpoint", str(run), "--out", str(tmp_path / "export")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "the checkpoint at step 4 was deleted while it was read" in caplog.text
    assert "check that the checkpoints are this run's" not in captured.err + caplog.text
    assert "checkpoint at step 2" in (tmp_path / "export" / "README.md").read_text()


@pytest.mark.slow
def test_an_export_of_a_run_that_is_saving_reads_the_newest_committed_checkpoint(
    run, live_pid, tmp_path, capsys, caplog
):
    hold(run / RUN_LOCK_NAME, live_pid)
    half_written(run, 6)
    out = tmp_path / "export"
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        code = export_main(["--checkpoint", str(run), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("a newer checkpoint (step 6) is being written"), warned
    assert "checkpoint at step 4" in (out / "README.md").read_text()
    assert not (tmp_path / f"export{ExportLock.SUFFIX}").exists()  # the export's lock, released


def test_a_second_export_into_the_same_out_refuses_naming_the_first(live_pid, tmp_path, capsys):
    """Refused before the checkpoint is read (here: no run at all)."""
    out = tmp_path / "export"
    hold(tmp_path / f"export{ExportLock.SUFFIX}", live_pid)
    code = export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} is being written by another export (pid "), err
    assert f"pid {live_pid} on host {socket.gethostname()}" in err[0]
    assert not out.exists()
    assert (tmp_path / f"export{ExportLock.SUFFIX}").exists()  # the first's lock, left to it


def test_the_export_lock_is_taken_over_from_a_process_that_is_gone(tmp_path):
    lock = tmp_path / f"export{ExportLock.SUFFIX}"
    dead = subprocess.Popen(["true"])
    dead.wait()
    hold(lock, dead.pid)
    with ExportLock(tmp_path / "export"):
        assert json.loads(lock.read_text())["pid"] != dead.pid
    assert not lock.exists() and not (tmp_path / "export").exists()
