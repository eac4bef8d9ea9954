"""A full disk at each point where a run writes durable state (spmdlm/crashpoints.py: SPMDLM_ENOSPC_AT makes the write
there fail with ENOSPC, in-process): one line naming the path and the bytes, exit 2, nothing half-written that a
re-run would trust, the checkpoints saved before intact, and the same command, once space is back, finishes with the
uninterrupted run's model and eval loss. (test_reliability*.py fill real small tmpfs disks where root may mount.)
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, final_params
from test_reliability import flags, launch

from spmdlm import checkpoint, crashpoints
from spmdlm.data import datasets
from spmdlm.launch import main
from spmdlm.train.stages.outputs import export_done

# the Hub upload writes nothing on this disk (and a failed upload is a warning); the dataset is spmdlm.prepare's
RUN_POINTS = [p for p in crashpoints.POINTS if p not in ("hub.before_upload", "dataset.before_swap")]


def run_flags(out, cache_dir, config) -> list[str]:
    return flags(out, cache_dir, config, "--save_steps", "1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_gpt2_config):
    """The run on a disk with room, and the points it passed in order."""
    out = tmp_path_factory.mktemp("reference") / "run"
    # a token cache of its own, as the token-cache points' runs have: the session's may hold this corpus already (an
    # earlier test in this worker), and a run that reuses it never passes the cache's points
    own_cache = tmp_path_factory.mktemp("reference-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(crashpoints.ENOSPC_ENV, "none")  # armed for no point: the points passed are recorded
        crashpoints.reset()
        assert main(run_flags(out, own_cache, tiny_gpt2_config)) == 0
    assert set(RUN_POINTS) <= set(crashpoints.trail), set(RUN_POINTS) - set(crashpoints.trail)
    return out, list(crashpoints.trail)


def full_disk_line(err: str) -> str:
    """The one line a full disk gives: the error, the words, the bytes."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert re.search("no space left on device", lines[0], re.IGNORECASE), lines[0]
    assert re.search(r"[\d,]+ (bytes|are free)", lines[0]), lines[0]
    return lines[0]


def half_written(out) -> list[str]:
    """Files a write left under a temporary name (what a re-run must not take for whole)."""
    return [str(p) for p in out.rglob("*") if ".tmp" in p.name and "orbax-checkpoint-tmp" not in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("point", RUN_POINTS)
def test_a_full_disk_at_each_write_is_one_line_and_the_rerun_finishes(
    point, capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config, reference
):
    ref, trail = reference
    cache = tmp_path / "cache" if point.startswith("token_cache") else cache_dir
    out = tmp_path / "run"
    argv = run_flags(out, cache, tiny_gpt2_config)
    monkeypatch.setenv(crashpoints.ENOSPC_ENV, f"{point}@{trail.count(point)}")
    crashpoints.reset()
    code, _, err = launch(capsys, *argv)
    assert code == 2, err[-3000:]
    line = full_disk_line(err)
    assert str(out) in line or str(cache) in line, line
    assert half_written(out) == [] and half_written(cache) == []
    saved = checkpoint.make_manager(out, read_only=True).all_steps() if (out / "checkpoints").is_dir() else []
    for step in saved:  # every checkpoint the run lists restores and verifies (its fingerprints)
        manager = checkpoint.make_manager(out, read_only=True)
        assert checkpoint.resolve_step(manager, step) == step

    monkeypatch.delenv(crashpoints.ENOSPC_ENV)  # space is back
    code, _, err = launch(capsys, *argv)
    assert code == 0, err[-3000:]
    for name, array in final_params(ref).items():
        assert np.array_equal(final_params(out)[name], array), name
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] == json.loads((ref / "eval_results.json").read_text())["eval_loss"]
    assert export_done(out) and (out / "hf" / "README.md").is_file() and (out / "loss_curve.png").is_file()


@pytest.mark.slow
def test_a_full_disk_while_preparing_leaves_no_dataset(tmp_path, reference):
    ref, _ = reference  # its tokenizer
    argv = ["--tokenizer", str(ref), "--for_model", "gpt2", "--block_size", "16", "--workers", "1",
            "--out", str(tmp_path / "ds"), str(FIXTURES / "overfit.txt")]  # fmt: skip
    prepare = lambda env: subprocess.run(  # the launcher's in-process runs above keep the log handlers of their tests
        [sys.executable, "-m", "spmdlm.prepare", *argv], capture_output=True, text=True, env={**os.environ, **env}
    )
    full = prepare({crashpoints.ENOSPC_ENV: "dataset.before_swap"})
    assert full.returncode == 2
    errors = "\n".join(line for line in full.stderr.splitlines() if " INFO " not in line)  # prepare logs to stderr
    assert str(tmp_path / "ds") in full_disk_line(errors)
    assert list(tmp_path.iterdir()) == []  # neither the dataset nor its staging sibling
    assert prepare({}).returncode == 0 and (tmp_path / "ds" / datasets.CARD_NAME).is_file()
