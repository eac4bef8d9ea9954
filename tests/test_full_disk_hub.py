"""A full disk while --push_to_hub uploads (spmdlm/crashpoints.py's SPMDLM_ENOSPC_AT, against the loopback Hub
emulator; tests/test_full_disk.py fills the run's other writes): where the final upload stages (hf_xet's cache, at
`hub.before_upload`) or where an upload during training exports the model (TMPDIR, at its `export.before_marker`).
A failed upload is a warning, never the run's end: one line naming the folder and its space, exit 0, the checkpoints
and the export whole, nothing half-written, and the same command, once space is back, uploads the finished run.
"""

import re
import tempfile
from pathlib import Path

import huggingface_hub.constants
import pytest
from hub_emulator import USER, HubEmulator
from test_full_disk import half_written
from test_publish import folder_files, warnings_of
from test_reliability import flags, launch

from spmdlm import checkpoint, crashpoints
from spmdlm.train.stages.outputs import export_done

FULL_AT = {  # with --hub_strategy every_save, 4 steps, checkpoints at 2 and 4: uploads at step 2 and at the end
    "final upload": "hub.before_upload@2",
    "upload at step 2": "export.before_marker@1",  # the temporary export; the run's own comes second
}


@pytest.fixture
def hub(monkeypatch):
    with HubEmulator() as emulator:
        monkeypatch.setenv("HF_ENDPOINT", emulator.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield emulator


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_AT)
def test_a_full_disk_while_uploading_is_one_warning_and_the_same_command_uploads(
    case, hub, monkeypatch, capsys, tmp_path, cache_dir, tiny_gpt2_config
):
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # TMPDIR: where the upload at step 2 exports
    argv = flags(out, cache_dir, tiny_gpt2_config, "--push_to_hub", "--hub_strategy", "every_save")
    argv += ["--hub_token", "hf_emulated"]
    monkeypatch.setenv(crashpoints.ENOSPC_ENV, FULL_AT[case])
    crashpoints.reset()
    code, stdout, err = launch(capsys, *argv)
    assert code == 0, err[-3000:]
    (warning,) = warnings_of(stdout + err)
    assert re.search(r"--push_to_hub: uploading gpt2 .* failed: cannot write (the export )?\S+: no space left", warning)
    assert re.search(r"[\d,]+ are free there\); the run and its outputs are unaffected; free some space", warning)
    staged = Path(huggingface_hub.constants.HF_XET_CACHE) if case == "final upload" else tmp
    assert f" {staged}" in warning
    assert (" bytes, " in warning) == (case == "upload at step 2")  # the export knows what it needed
    assert half_written(out) == [] and list(tmp.glob("spmdlm-*")) == []
    assert export_done(out) and checkpoint.make_manager(out, read_only=True).all_steps() == [2, 4]
    repo = hub.repos[f"{USER}/run"]
    if case == "final upload":
        assert repo.commits == ["spmdlm: gpt2 at step 2 of 4"]
        monkeypatch.delenv(crashpoints.ENOSPC_ENV)  # space is back: the same command uploads the finished run
        code, stdout, err = launch(capsys, *argv)
        assert code == 0 and warnings_of(stdout + err) == [], err[-3000:]
    assert repo.commits[-1] == "spmdlm: gpt2 after 4 steps"
    assert repo.files == folder_files(out / "hf")
