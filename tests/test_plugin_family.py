"""A model family from outside the package: OPT (tests/plugins/spmdlm_opt), registered under the `spmdlm.families`
entry-point group by a distribution's metadata on the path, as `pip install` of a plugin package would leave it. It
trains through `python -m spmdlm.launch`, resumes exactly, exports, and transformers loads the export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, REPO, final_params, read_metrics

PLUGINS = REPO / "tests" / "plugins"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """A site directory holding only the plugin's distribution metadata (its code is on tests/plugins)."""
    site = tmp_path_factory.mktemp("site")
    info = site / "spmdlm_opt-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spmdlm-opt\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[spmdlm.families]\nopt = spmdlm_opt.family:FAMILY\n")
    return site


def run_launcher(site: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python -m spmdlm.launch --model_type opt FLAGS` with the plugin installed as pip would leave it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "spmdlm.launch", "--model_type", "opt", *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def launch(out: Path, site: Path, cache_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return run_launcher(
        site,
        "--config_name",
        "opt-tiny",  # a preset of the plugin's presets/ folder
        "--train_file",
        str(FIXTURES / "overfit.txt"),
        "--vocab_size",
        "512",
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "2",
        "--mesh",
        "data=2,fsdp=4",
        "--max_steps",
        "3",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--max_eval_samples",
        "8",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(out),
        *flags,
    )


@pytest.mark.slow
def test_out_of_tree_family_trains_resumes_exports(tmp_path, plugin_site, cache_dir, monkeypatch):
    whole = tmp_path / "whole"
    done = launch(whole, plugin_site, cache_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_metrics(whole) if "loss" in m and "eval" not in m.get("event", "")] == [1, 2, 3]

    # The run as a job killed after its checkpoint at step 2 leaves it: that checkpoint and the records before it.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for name in ("checkpoints/3", "hf", "eval_results.json"):
        shutil.rmtree(resumed / name) if (resumed / name).is_dir() else (resumed / name).unlink()
    again = launch(resumed, plugin_site, cache_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from the checkpoint at step 2" in again.stdout
    params = [final_params(out) for out in (whole, resumed)]
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        np.testing.assert_array_equal(params[0][name], params[1][name], err_msg=name)

    # transformers loads the export; its logits equal ours (spmdlm reading the same export, the family registered
    # in this process through the same entry point).
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spmdlm import families
    from spmdlm.hf_export import load_hf

    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.syspath_prepend(str(PLUGINS))
    families.families.cache_clear()
    try:
        ours, config = load_hf(whole / "hf")
        assert config.model_type == "opt" and "opt" in families.families()
        hf, info = AutoModelForCausalLM.from_pretrained(whole / "hf", output_loading_info=True)
        assert type(hf).__name__ == "OPTForCausalLM"
        assert not any(info.values()), info
        tokenizer = AutoTokenizer.from_pretrained(whole / "hf")
        ids = tokenizer(["def main(self):", "import os"], padding=True, return_tensors="np")["input_ids"][:, :8]
        with torch.no_grad():
            expected = hf(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(ours(ids)), expected, atol=1e-5)
        run_config = json.loads((whole / "run_config.json").read_text())
        assert run_config["model_config"]["model_type"] == "opt" and run_config["block_size"] == 32
    finally:
        families.families.cache_clear()


def test_nothing_in_the_package_names_the_plugin():
    for path in (REPO / "spmdlm").rglob("*.py"):
        text = path.read_text()
        assert "spmdlm_opt" not in text and "OPTFor" not in text and '"opt"' not in text, path


@pytest.mark.slow
def test_one_folder_and_one_entry_point_train_on_the_quick_start(tmp_path, plugin_site, cache_dir):
    """All a new family takes is its folder (tests/plugins/spmdlm_opt: the family, its network and table, its
    presets/) and one entry point (the plugin's metadata, `plugin_site`): the embedded quick start, which names only
    --model_type, trains it with the family's own quick-start flags and preset and exports it."""
    assert sorted(p.name for p in plugin_site.rglob("*") if p.is_file()) == ["METADATA", "entry_points.txt"]
    out = tmp_path / "quickstart"
    flags = [
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--max_eval_samples",
        "8",
        "--mesh",
        "data=2,fsdp=4",
    ]
    done = run_launcher(plugin_site, *flags, "--cache_dir", str(cache_dir), "--output_dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["model_config"]["model_type"] == "opt" and run_config["config_name"] == "opt-tiny"
    assert run_config["block_size"] == 64 and not run_config["train_file"]  # the quick start's, on the embedded corpus
    assert [m["step"] for m in read_metrics(out) if "loss" in m and "eval" not in m.get("event", "")][-1] == 2
    assert (out / "hf" / "spmdlm_export.json").is_file()
