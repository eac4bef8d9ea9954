"""Settings a run cannot start with, refused in one line (exit 2) before the output dir holds anything of it: a
--compile_for slice that names no TPU (before libtpu is asked for), a --profile_steps window past the run's last step,
a --report_to tracker that cannot start its run."""

import pytest
from test_reliability import flags, launch
from test_reliability_inputs import refused, small_run


def test_compile_for_names_a_wrong_slice_before_asking_for_libtpu(capsys, tmp_path):
    out = tmp_path / "run"
    code, _, err = launch(capsys, "--compile_for", "v9:3x3", "--output_dir", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --compile_for v9:3x3: the TPU generation 'v9' is not one of v2, v3, v4, v5e, v5p")
    assert "v5e:16x16" in err and "libtpu" not in err and not out.exists()
    code, _, err = launch(capsys, "--compile_for", "v5e:16by16", "--output_dir", str(out))
    assert code == 2 and "the topology '16by16' is not chips per dimension" in err and not out.exists()


def test_a_profile_window_past_the_last_step_is_refused(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    out = tmp_path / "run"
    argv = flags(out, cache_dir, tiny_gpt2_config, "--max_steps", "2", "--profile_steps", "100-200")
    code, _, err = launch(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --profile_steps 100-200 starts after the run's last step (--max_steps 2)")
    assert not out.exists()


def test_a_tracker_that_cannot_start_leaves_the_output_dir_as_it_was(
    capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install -e '.[mlflow]')")
    from spmdlm.train.stages.outputs import OUR_OUTPUTS

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://nowhere")  # refused by MLflow at once
    out = tmp_path / "run"
    line = refused(capsys, *small_run(out, cache_dir, tiny_gpt2_config, "--report_to", "mlflow"))
    assert line.startswith("error: --report_to mlflow: could not start its run:"), line
    assert line.endswith("; fix that or leave mlflow out of --report_to")
    # nothing a retry without mlflow would refuse (an earlier run's metrics.jsonl, run_config.json, mlruns/)
    assert not out.exists() or not {p.name for p in out.iterdir()} & set(OUR_OUTPUTS)
