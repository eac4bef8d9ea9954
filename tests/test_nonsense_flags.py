"""Flags that were accepted and then did nothing, or something else than asked: each refused in one line (exit 2)
when the flags are read, before anything is written. --ema_decay that float32 rounds to 1 (an average that never
moves), --ema_start without --ema_decay, --monitor_every beyond --max_steps (a warning where the length comes from
epochs), spmdlm.export's --average_last 0 and repeated --average_steps, and a ModernBERT config whose RoPE is of
another type than the default (trained as the default before)."""

import json
import logging
import types

import pytest
from test_reliability_inputs import refused, small_run

from spmdlm.cli import export as export_cli
from spmdlm.data.pipeline import Schedule
from spmdlm.errors import ArgumentError, ConfigError
from spmdlm.families import checked_config, load_config
from spmdlm.run_args import check_average, check_monitors
from spmdlm.run_args.sections import ControlArgs, OptimizationArgs, ReportingArgs
from spmdlm.train.stages import corpora


# -- the launcher's flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--ema_decay", "0.9999999999"],
            "--ema_decay 0.9999999999 is 1 in float32, where the average is kept: the average would never move",
        ),
        (["--ema_start", "5"], "--ema_start 5 applies to --ema_decay, which is not given"),
        (["--monitor_every", "5"], "--monitor_every 5 is beyond the run's last step (--max_steps 4)"),
    ],
)
def test_refused_in_one_line_before_anything_is_written(capsys, tmp_path, cache_dir, tiny_gpt2_config, extra, expected):
    out = tmp_path / "run"
    line = refused(capsys, *small_run(out, cache_dir, tiny_gpt2_config, *extra))
    assert expected in line, line
    assert not out.exists()


def test_what_float32_keeps_below_1_and_monitors_within_the_run_pass():
    check_average(OptimizationArgs(ema_decay=0.99999994, ema_start=3))  # the largest float32 below 1
    check_average(OptimizationArgs(ema_decay=0.999))
    check_average(OptimizationArgs())
    with pytest.raises(ArgumentError, match="would only copy the parameters"):
        check_average(OptimizationArgs(ema_decay=1e-50))  # above 0, but 0 in float32
    check_monitors(ReportingArgs(monitor_every=4), 4)  # the last step runs them
    check_monitors(ReportingArgs(monitor_every=1000), -1)  # the length from epochs: the data stage warns


def test_monitors_beyond_a_length_from_epochs_are_one_warning(caplog):
    data = types.SimpleNamespace(train=types.SimpleNamespace(num_records=40))
    control = ControlArgs(num_train_epochs=2.0)
    with caplog.at_level(logging.WARNING, logger="spmdlm"):
        schedule = corpora.training_schedule(data, control, 8, monitor_every=11)
        assert schedule == Schedule(steps_per_epoch=5, total_steps=10, num_epochs=2)
        assert corpora.training_schedule(data, control, 8, monitor_every=10) == schedule
    warned = [r.getMessage() for r in caplog.records if "--monitor_every" in r.getMessage()]
    assert warned == [
        "--monitor_every 11 is beyond the run's last step (10, from --num_train_epochs 2): no monitor will be logged; "
        "give --monitor_every 10 or less"
    ]


# -- spmdlm.export -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--average_last", "0"], "--average_last 0: give a number of checkpoints to average, 1 or more"),
        (["--average_last", "-2"], "--average_last -2: give a number of checkpoints to average, 1 or more"),
        (
            ["--average_steps", "2,2,2"],
            "--average_steps '2,2,2' names step 2 more than once (a mean of 1 checkpoint, not 3); give each step "
            "once (one checkpoint: --step)",
        ),
        (["--average_steps", "2,4,2"], "--average_steps '2,4,2' names step 2 more than once"),
    ],
)
def test_export_averages_of_nothing_or_of_one_step_repeated_are_refused(capsys, tmp_path, flags, expected):
    out = tmp_path / "hf"
    code = export_cli.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), *flags])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and lines == [f"error: {lines[0][len('error: ') :]}"] and expected in lines[0], err
    assert "Traceback" not in err and not out.exists()


# -- a ModernBERT config's RoPE ----------------------------------------------------------------------------------------
TINY_MODERNBERT = load_config("modernbert-tiny").to_hf_dict()


@pytest.mark.parametrize(
    "change, where",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        (
            {"rope_parameters": {"full_attention": {"type": "linear"}, "sliding_attention": {"rope_type": "default"}}},
            "rope_parameters.full_attention",
        ),
    ],
)
def test_modernbert_rope_of_another_type_is_refused_naming_it(change, where):
    with pytest.raises(ConfigError) as refusal:
        checked_config({**TINY_MODERNBERT, **change}, None, "test")
    line = str(refusal.value)
    assert "\n" not in line and line.startswith(f"ModernBERT {where}: rope_type '"), line
    assert "supports only the default RoPE" in line


def test_modernbert_default_rope_still_loads():
    config = checked_config(TINY_MODERNBERT, None, "test")
    assert config.global_rope_theta == 160000.0


def test_the_launcher_refuses_a_modernbert_config_of_linear_rope(capsys, tmp_path, cache_dir):
    path = tmp_path / "modernbert-linear.json"
    path.write_text(json.dumps({**TINY_MODERNBERT, "rope_scaling": {"type": "linear", "factor": 4.0}}))
    out = tmp_path / "run"
    line = refused(capsys, *small_run(out, cache_dir, path))
    assert "ModernBERT rope_scaling: rope_type 'linear' is not supported" in line, line
    assert not out.exists()
