"""The crash-point sweep: a run killed (SIGKILL) at each point where it writes durable state (spmdlm/crashpoints.py,
listed in docs/troubleshooting.md), then the same command run again, finishes with what an uninterrupted run has:
the same final checkpoint, export and eval loss, bit for bit, every logged step, and its upload on the Hub.

Each killed run is a process of its own (the kill must not take pytest with it), forked from one that has the
launcher's imports done (tests/preloaded.py); the re-runs and the one uninterrupted reference run per module are
in-process. The run is test_reliability's 0.14M-parameter GPT-2, 4 steps with
checkpoints at 2 and 4, evaluated, exported and pushed to a loopback Hub emulator.
"""

import json
import os
import re
import subprocess
import sys

import huggingface_hub.constants
import numpy as np
import pytest
from conftest import FIXTURES, REPO, final_params, read_metrics
from hub_emulator import USER, HubEmulator
from preloaded import PreloadedLauncher
from test_reliability import flags, launch

from spmdlm import crashpoints, hf_export
from spmdlm.launch import main
from spmdlm.prepare import main as prepare_main
from spmdlm.train.stages.outputs import export_done

RUN_POINTS = [p for p in crashpoints.POINTS if p != "dataset.before_swap"]  # spmdlm.prepare's: its own test


@pytest.fixture(scope="module")
def hub():
    """A Hub emulator for the module; HF_ENDPOINT points this process (and the killed runs) at it."""
    with HubEmulator() as emulator, pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", emulator.url)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield emulator


def repo_name(out) -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", out.parent.name)[:60]


def run_flags(out, cache_dir, config) -> list[str]:
    hub = ("--push_to_hub", "--hub_model_id", repo_name(out), "--hub_token", "hf_emulated")
    return flags(out, cache_dir, config, "--save_steps", "1", *hub)  # the step before the last is committed at its save


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_gpt2_config, hub):
    """The uninterrupted run, and the points it passed in order (every point of a run passed once at least)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    # a token cache of its own: the session's may hold this corpus already (an earlier test in this worker), and a
    # run that reuses it never passes the cache's points
    own_cache = tmp_path_factory.mktemp("reference-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(crashpoints.CRASH_ENV, "none")  # armed for no point: the points passed are recorded
        crashpoints.reset()
        assert main(run_flags(out, own_cache, tiny_gpt2_config)) == 0
    trail = list(crashpoints.trail)
    missing = set(RUN_POINTS) - set(trail)
    assert not missing, f"a run never passes {missing}"
    return out, trail


@pytest.fixture(scope="module")
def launcher(hub, tmp_path_factory):
    """A process of its own for each killed run (the kill must not take pytest with it), forked from one that has
    the launcher's imports done (tests/preloaded.py), with the Hub emulator's environment."""
    server = PreloadedLauncher(tmp_path_factory.mktemp("preloaded"), {**os.environ, "HF_HUB_OFFLINE": "0"})
    yield server
    server.close()


def killed_at(launcher, point: str, argv: list[str]) -> subprocess.CompletedProcess:
    """The launcher run in a process of its own with the hook armed at `point`."""
    return launcher.run(argv, {**os.environ, crashpoints.CRASH_ENV: point, "HF_HUB_OFFLINE": "0"}, REPO)


def logged(out) -> list[tuple]:
    """What metrics.jsonl holds, in order: each step's train-loss record (its value is the mean since the last
    logged step, or since the resume: a window the kill cut differs), and the eval losses; a re-run logs its own
    compile and, where it evaluates again, the same eval record once more."""
    records = [r for r in read_metrics(out) if {"loss", "eval_loss"} & r.keys()]
    return list(dict.fromkeys((r["step"], "loss" in r, r.get("eval_loss")) for r in records))


@pytest.mark.slow
@pytest.mark.parametrize("point", RUN_POINTS)
def test_a_run_killed_at_each_point_finishes_as_if_uninterrupted(
    point, capsys, tmp_path, tmp_path_factory, cache_dir, tiny_gpt2_config, reference, hub, launcher
):
    ref, trail = reference
    # the last time the run passes the point: after the first checkpoint wherever the point comes again later
    spec = f"{point}@{trail.count(point)}"
    # the token cache: one of its own, the shared one holds this corpus's records already
    cache = tmp_path / "cache" if point.startswith("token_cache") else cache_dir
    out = tmp_path_factory.mktemp(point.replace(".", "-")) / "run"
    argv = run_flags(out, cache, tiny_gpt2_config)
    killed = killed_at(launcher, spec, argv)
    assert killed.returncode == -9, (spec, killed.returncode, killed.stderr[-3000:])

    code, _, err = launch(capsys, *argv)
    assert code == 0, err[-3000:]
    for name, array in final_params(ref).items():
        assert np.array_equal(final_params(out)[name], array), name
    assert (out / "hf" / "model.safetensors").read_bytes() == (ref / "hf" / "model.safetensors").read_bytes()
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] == json.loads((ref / "eval_results.json").read_text())["eval_loss"]
    assert logged(out) == logged(ref)  # every logged step, every eval loss
    assert export_done(out) and (out / "hf" / "README.md").is_file() and (out / "loss_curve.png").is_file()
    assert [p.name for p in out.iterdir() if ".tmp" in p.name] == []
    uploaded = hub.repos[f"{USER}/{repo_name(out)}"].files
    assert uploaded[hf_export.MARKER] == (out / "hf" / hf_export.MARKER).read_bytes()


def tree(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_preparation_killed_before_its_swap_is_done_again_whole(tmp_path, reference):
    ref, _ = reference  # its tokenizer
    argv = lambda out: ["--tokenizer", str(ref), "--for_model", "gpt2", "--block_size", "16", "--workers", "1",
                        "--out", str(out), str(FIXTURES / "overfit.txt")]  # fmt: skip
    assert prepare_main(argv(tmp_path / "whole")) == 0
    env = {**os.environ, crashpoints.CRASH_ENV: "dataset.before_swap"}
    killed = subprocess.run(
        [sys.executable, "-m", "spmdlm.prepare", *argv(tmp_path / "ds")], capture_output=True, text=True, env=env
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "ds").exists()  # only the hidden sibling, which nothing trusts
    assert prepare_main(argv(tmp_path / "ds")) == 0
    assert tree(tmp_path / "ds") == tree(tmp_path / "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "whole"]  # the dead process's sibling is gone


def test_the_docs_list_every_crash_point():
    text = (REPO / "docs" / "troubleshooting.md").read_text().partition("## Crash points")[2]
    assert re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", text, re.MULTILINE) == list(crashpoints.POINTS)
