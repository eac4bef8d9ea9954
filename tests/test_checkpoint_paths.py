"""A file path read from a checkpoint stays inside that checkpoint's folder: a shard an index
(`model.safetensors.index.json`, `pytorch_model.bin.index.json`) lists as `../other/model.safetensors` or as an
absolute path is refused in one line, never opened (it would load another model's weights); so is an export
marker's or a prepared dataset card's file outside its folder. A folder of links (the Hub cache's snapshots) reads as
before: the rule is on the names the checkpoint writes, not on where its files link to."""

import json

import numpy as np
import pytest
from conftest import run_argv
from safetensors.numpy import save_file
from test_reliability_inputs import FIXTURES, refused

from spmdlm import hf_export, storage
from spmdlm.data import datasets
from spmdlm.errors import ExportError
from spmdlm.hf_weights import CheckpointTensors


def shard(folder, name="model.safetensors", value=1.0):
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full((2, 2), value, np.float32)}, str(folder / name))


def index(folder, target, layout="model.safetensors.index.json"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / layout).write_text(json.dumps({"metadata": {}, "weight_map": {"w": target}}))
    return folder


@pytest.mark.parametrize(
    "name", ["../other/model.safetensors", "ABSOLUTE", "sub/../../other/model.safetensors", "..\\other\\x", "C:x"]
)
@pytest.mark.parametrize("layout", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused_unopened(tmp_path, name, layout):
    shard(tmp_path / "other", value=7.0)  # another model's weights, there to be taken
    target = str(tmp_path / "other" / "model.safetensors") if name == "ABSOLUTE" else name
    ckpt = index(tmp_path / "ckpt", target, layout)
    with pytest.raises(ExportError) as refusal:
        CheckpointTensors(ckpt)
    line = str(refusal.value)
    assert "\n" not in line and f"{layout} lists a shard outside its checkpoint folder" in line, line
    assert "must be inside that folder" in line


def test_shards_inside_the_folder_and_linked_ones_read_as_before(tmp_path):
    shard(tmp_path / "blobs", "abc123", value=3.0)  # the Hub cache: a snapshot's files link to its blobs
    ckpt = index(tmp_path / "snapshot", "model-00001.safetensors")
    (ckpt / "model-00001.safetensors").symlink_to(tmp_path / "blobs" / "abc123")
    with CheckpointTensors(ckpt) as tensors:
        assert tensors.get("w")[0, 0] == 3.0
    nested = index(tmp_path / "nested", "parts/./model.safetensors")
    shard(nested, "parts/model.safetensors", value=5.0)
    with CheckpointTensors(nested) as tensors:
        assert tensors.get("w")[0, 0] == 5.0


def test_an_index_without_a_mapping_is_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["../other/model.safetensors"]}))
    with pytest.raises(ExportError, match=r"is not a checkpoint index \(no weight_map: a list, not a mapping\)"):
        CheckpointTensors(ckpt)


def test_the_launcher_refuses_such_a_checkpoint_before_writing(capsys, tmp_path, tiny_gpt2_config, cache_dir):
    shard(tmp_path / "other")
    ckpt = index(tmp_path / "ckpt", "../other/model.safetensors")
    (ckpt / "config.json").write_text(tiny_gpt2_config.read_text())
    out = tmp_path / "run"
    argv = run_argv(out, None, cache_dir, train_file=FIXTURES / "overfit.txt", model_name_or_path=ckpt)
    line = refused(capsys, *argv)
    assert "lists a shard outside its checkpoint folder ('../other/model.safetensors')" in line, line
    assert not out.exists()


def test_an_export_marker_naming_a_file_outside_is_not_a_whole_export(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (tmp_path / "config.json").write_text("{}")
    (out / hf_export.MARKER).write_text(json.dumps({"files": {"../config.json": 2}}))
    assert not hf_export.export_complete(out)
    (out / "config.json").write_text("{}")
    (out / hf_export.MARKER).write_text(json.dumps({"files": {"config.json": 2}}))
    assert hf_export.export_complete(out)


def test_a_dataset_card_naming_a_shard_outside_is_refused(tmp_path):
    (tmp_path / "elsewhere.bin").write_bytes(b"\0" * 64)
    card = {
        "record_length": 16,
        "splits": {"train": {"shards": [{"file": "../elsewhere.bin", "bytes": 64, "records": 1, "sha256": ""}]}},
    }
    (tmp_path / "ds").mkdir()
    with pytest.raises(datasets.DamagedDataset, match=r"names shard '../elsewhere.bin', outside the dataset folder"):
        datasets.open_split(tmp_path / "ds", card, "train", verify=False)


@pytest.mark.parametrize(
    "name, inside",
    [
        ("model.safetensors", True),
        ("sub/model.safetensors", True),
        ("./model.safetensors", True),
        ("../model.safetensors", False),
        ("/etc/passwd", False),
        ("a/../../b", False),
        ("a\\b", False),
        ("C:b", False),
        ("gs://other-bucket/model.safetensors", False),
        ("", False),
        (None, False),
        (3, False),
    ],
)
def test_the_rule(name, inside):
    assert storage.inside(name) is inside
