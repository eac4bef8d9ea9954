"""The rules a resume follows (issues 61 and 68): what may change and what the run then does.

- Extending a run (--max_steps 6 -> 9) keeps the learning rate continuous by default and says so in one line;
  --lr_scheduler_on_extension restart restarts the schedule as before.
- The same corpus by another path (relative for absolute, or a byte-identical copy) resumes: data is compared by
  content (the fingerprints in run_config.json), and the losses are the uninterrupted run's, bit for bit.
- The global batch kept with less per device and more accumulation resumes: the losses are the uninterrupted run's
  within 1e-5 relative (the sums are added in another order).
- A run in the middle of a --batch_size_ramp moves to a mesh that an entry it has passed does not fit.
- No refusal advises --overwrite_output_dir where checkpoints may exist.

The launcher runs are the tiny GPT-2 of test_reliability.py (block 16, data=4,fsdp=2), 6 steps of a global batch of
16, checkpoints at 3 and 6: `whole` is the uninterrupted run; a copy without its step-6 checkpoint is that run
stopped at step 3.
"""

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, read_metrics
from test_reliability import flags, launch, same_params

from spmdlm.data.batch_ramp import BatchRamp, BatchStage, largest_stage, plan_stages
from spmdlm.errors import ArgumentError
from spmdlm.launch import main
from spmdlm.train.stages.outputs import read_run_config

SIX_STEPS = ("--max_steps", "6", "--save_steps", "3", "--logging_steps", "1", "--export_hf", "false")
SIX_STEPS += ("--validation_split_percentage", "0", "--per_device_train_batch_size", "2")  # 16 on data=4,fsdp=2
SPMDLM = Path(__file__).resolve().parents[1] / "spmdlm"


def six_steps(out, cache_dir, config, *extra) -> list[str]:
    return flags(out, cache_dir, config, *SIX_STEPS, *extra)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, cache_dir, tiny_gpt2_config):
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(six_steps(out, cache_dir, tiny_gpt2_config)) == 0
    return out


def trained(out) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(out) if "loss" in m and "learning_rate" in m}


def copy_of(run, tmp_path, stopped_at: int | None = None):
    """A copy of `run`; `stopped_at`: without the checkpoints after that step (the run as if stopped there)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    for step_dir in (out / "checkpoints").iterdir():
        if stopped_at is not None and step_dir.name.isdigit() and int(step_dir.name) > stopped_at:
            shutil.rmtree(step_dir)
    return out


# -- issue 61: extending a run ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_extending_a_finished_run_keeps_the_learning_rate_continuous(
    capsys, whole, tmp_path, cache_dir, tiny_gpt2_config
):
    out = copy_of(whole, tmp_path)
    code, logged, err = launch(capsys, *six_steps(out, cache_dir, tiny_gpt2_config, "--max_steps", "9"))
    assert code == 0, err
    lr = {step: m["learning_rate"] for step, m in trained(out).items()}
    assert sorted(lr) == list(range(1, 10))
    assert lr[6] == pytest.approx(1e-3 / 6, rel=1e-6) and lr[7] <= 1.5 * lr[6]
    scale = (1 / 6) / (4 / 9)  # the 9-step schedule scaled to start from the rate reached (engine/optim.continued)
    for step in (7, 8, 9):
        assert lr[step] == pytest.approx(1e-3 * (1 - (step - 1) / 9) * scale, rel=1e-6)
    said = [line.split(" INFO ", 1)[-1] for line in logged.splitlines() if "the run's length changed" in line]
    assert said == [
        "the run's length changed from 6 to 9 steps: the learning rate goes on from 0.000167 (step 6) to 0.000125 at "
        "step 7, along the linear schedule of 9 steps scaled to start there (--lr_scheduler_on_extension restart "
        "would restart it: 0.000333 at step 7)"
    ]
    saved = json.loads((out / "run_config.json").read_text())
    assert (saved["total_steps"], saved["lr_schedule_extensions"]) == (9, [{"at_step": 6, "steps_before": 6}])


@pytest.mark.slow
def test_extending_with_restart_restarts_the_schedule_as_before(capsys, whole, tmp_path, cache_dir, tiny_gpt2_config):
    out = copy_of(whole, tmp_path)
    argv = six_steps(out, cache_dir, tiny_gpt2_config, "--max_steps", "9", "--lr_scheduler_on_extension", "restart")
    code, logged, err = launch(capsys, *argv)
    assert code == 0, err
    lr = {step: m["learning_rate"] for step, m in trained(out).items()}
    for step in (7, 8, 9):  # the schedule of a 9-step run: what every extension did before
        assert lr[step] == pytest.approx(1e-3 * (1 - (step - 1) / 9), rel=1e-6)
    assert lr[7] > 1.5 * lr[6]
    assert "the linear schedule restarts over the 9 steps, the learning rate going from 0.000167 (step 6)" in logged
    assert json.loads((out / "run_config.json").read_text())["lr_schedule_extensions"] == []


# -- issue 68: resumes refused that should continue ------------------------------------------------------------------
@pytest.mark.slow
def test_the_same_corpus_by_a_relative_path_to_a_copy_resumes_exactly(
    capsys, monkeypatch, whole, tmp_path, cache_dir, tiny_gpt2_config
):
    out = copy_of(whole, tmp_path, stopped_at=3)
    copy = tmp_path / "elsewhere" / "corpus.txt"
    copy.parent.mkdir()
    shutil.copyfile(FIXTURES / "overfit.txt", copy)
    monkeypatch.chdir(tmp_path)
    code, _, err = launch(capsys, *six_steps(out, cache_dir, tiny_gpt2_config, "--train_file", "elsewhere/corpus.txt"))
    assert code == 0, err
    ours, theirs = trained(out), trained(whole)
    assert [ours[s]["loss"] for s in range(1, 7)] == [theirs[s]["loss"] for s in range(1, 7)]  # bitwise
    assert same_params(out, whole)


@pytest.mark.slow
def test_the_global_batch_kept_with_more_accumulation_resumes(capsys, whole, tmp_path, cache_dir, tiny_gpt2_config):
    out = copy_of(whole, tmp_path, stopped_at=3)
    layout = ("--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2")  # 1 x 8 x 2 = 16, as 2 x 8
    code, _, err = launch(capsys, *six_steps(out, cache_dir, tiny_gpt2_config, *layout))
    assert code == 0, err
    ours, theirs = trained(out), trained(whole)
    # the same examples and gradients, their sums added in another order: within 1e-5 relative, not bitwise
    np.testing.assert_allclose([ours[s]["loss"] for s in (4, 5, 6)], [theirs[s]["loss"] for s in (4, 5, 6)], rtol=1e-5)


@pytest.mark.slow
def test_a_mid_ramp_run_moves_to_a_mesh_an_entry_it_passed_does_not_fit(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    ramp = ("--batch_size_ramp", "0:2,3:8", "--per_device_train_batch_size", "1")
    before = tmp_path / "before"
    argv = lambda out, mesh: flags(out, cache_dir, tiny_gpt2_config, *SIX_STEPS[:10], *ramp, "--mesh", mesh)
    code, _, err = launch(capsys, *argv(before, "data=2,tensor=4"))  # 2 batch devices
    assert code == 0, err
    out = copy_of(before, tmp_path, stopped_at=3)
    code, logged, err = launch(capsys, *argv(out, "data=4,tensor=2"))  # 4: entry 0:2 is passed, 3:8 is 2 x 4 x 1
    assert code == 0, err
    assert "step 3: global batch 8 (1 per device x 4 batch devices x 2 accumulation" in logged
    ours, theirs = trained(out), trained(before)
    np.testing.assert_allclose([ours[s]["loss"] for s in (4, 5, 6)], [theirs[s]["loss"] for s in (4, 5, 6)], rtol=1e-5)


def test_only_the_stages_still_to_run_must_divide_among_the_devices():
    ramp = BatchRamp.parse("0:2,3:8,6:12")
    stages = plan_stages(ramp, batch_devices=4, processes=1, max_per_device=1, resume_step=3)
    assert stages == (BatchStage(0, 2, 0, 1, passed=True), BatchStage(3, 8, 1, 2), BatchStage(6, 12, 1, 3))
    assert largest_stage(stages) == stages[2]
    with pytest.raises(ArgumentError) as refused:  # step 2 still runs the first entry's batch
        plan_stages(ramp, batch_devices=4, processes=1, max_per_device=1, resume_step=2)
    message = str(refused.value)
    assert "entry 0:2: 2 sequences do not divide among the 4 batch devices" in message
    assert "resumes at step 2" in message and "ramp cannot change" in message and "use a multiple" not in message


# -- issue 68 (d): no refusal advises deleting checkpoints -----------------------------------------------------------
# Where a message may name --overwrite_output_dir, and why no checkpoint is lost there.
MAY_NAME_OVERWRITE = {
    ("train/stages/outputs.py", "refuse_what_is_not_ours"): "the output dir holds no checkpoint (checked before)",
    ("checkpoint.py", "check_format"): "names exporting them with spmdlm 0.1 first; this version cannot read them",
    ("checkpoint.py", "restore_newest_good"): "no checkpoint restores; the damaged ones are kept by it",
    ("run_args/sections.py", "ControlArgs"): "the flag's own help",
}


def test_no_refusal_advises_overwrite_output_dir_where_checkpoints_may_exist():
    """Every string of spmdlm/ that names --overwrite_output_dir (docstrings and comments aside) is in a function
    where no checkpoint is lost by it; the refusals of a resume name the ways that keep them instead."""
    named = {where for path in SPMDLM.rglob("*.py") for where in _naming_overwrite(path)}
    assert named - set(MAY_NAME_OVERWRITE) == set()
    assert ("train/stages/outputs.py", "check_resume") not in named  # other settings: another --output_dir


def _naming_overwrite(path: Path):
    """(file, the function or class around it) of each string in `path` that names the flag, docstrings aside."""
    tree = ast.parse(path.read_text())
    scopes = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes) and node.body and isinstance(node.body[0], ast.Expr)
    }

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Constant) and isinstance(child.value, str) and id(child) not in docstrings:
                if "--overwrite_output_dir" in child.value:
                    yield str(path.relative_to(SPMDLM)), owner
            yield from visit(child, child.name if isinstance(child, scopes[1:]) else owner)

    yield from visit(tree, None)


def test_a_damaged_run_config_is_refused_with_its_copy_named_and_goes_with_overwrite(tmp_path):
    (tmp_path / "run_config.json").write_text("{not json")
    with pytest.raises(Exception) as refused:
        read_run_config(tmp_path)
    message = str(refused.value)
    assert "checkpoints/STEP/config" in message and "another --output_dir" in message
    assert "--overwrite_output_dir" not in message
    assert read_run_config(tmp_path, overwriting=True) == {}
