"""LM-harness tasks whose data is not on this host, where the Hub cannot be reached (no network, or HF_HUB_OFFLINE
set): one line at once, before any work, instead of ~25 s of huggingface_hub's retries (each warned twice) first.
The Hub is probed once, with a bound; data then comes from this host only (datasets' and huggingface_hub's offline
switches, restored after), so local tasks and a filled cache still run."""

import socket

import datasets.config
import huggingface_hub.constants
import pytest
from test_harness import write_tasks
from test_reliability import launch

from spmdlm.errors import TasksError
from spmdlm.generation.harness import OFFLINE_ENVS, task_manager

HUB_TASK = (
    "task: hub_ppl\ndataset_path: nonesuch-org/nonesuch-corpus\ntest_split: test\n"
    'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    "metric_list:\n  - metric: word_perplexity\n"
)


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt fails at once, and is counted (the Hub's probe included)."""
    for name in (*OFFLINE_ENVS, "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    attempts = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def tasks_dir(tmp_path):
    folder = tmp_path / "tasks"
    write_tasks(folder)
    (folder / "hub_ppl.yaml").write_text(HUB_TASK)
    return folder


def test_a_task_of_hub_data_is_one_line_after_one_probe(tmp_path, no_network):
    with pytest.raises(TasksError) as refusal:
        task_manager("tiny_mc,hub_ppl", [tasks_dir(tmp_path)])
    line = str(refusal.value)
    assert "\n" not in line and line.startswith("the data of tasks tiny_mc, hub_ppl is not on this host ("), line
    assert "and the Hub (https://huggingface.co) is unreachable from here; give tasks over local files" in line
    assert no_network == [("huggingface.co", 443)]  # the probe; no download attempted, so none retried
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_hf_hub_offline_set_asks_nothing(tmp_path, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TasksError, match=r"is not on this host \(.*\) and HF_HUB_OFFLINE is set; give tasks"):
        task_manager("hub_ppl", [tasks_dir(tmp_path)])
    assert no_network == []


def test_local_tasks_load_without_the_hub(tmp_path, no_network):
    manager = task_manager("tiny_mc,tiny_ppl", [tasks_dir(tmp_path)])
    assert {"tiny_mc", "tiny_ppl"} <= set(manager.all_tasks)
    assert datasets.config.HF_HUB_OFFLINE is False


def test_the_launcher_refuses_it_before_any_work(capsys, tmp_path, no_network):
    out = tmp_path / "run"
    code, _, err = launch(
        capsys, "--output_dir", str(out), "--eval_tasks", "hub_ppl", "--eval_tasks_dir", str(tasks_dir(tmp_path))
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --eval_tasks: the data of task hub_ppl"), err
    assert not out.exists()
