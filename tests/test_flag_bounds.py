"""Every numeric flag's one rule: a finite number within the bounds the flag declares (every numeric flag of the run's
sections and of each objective declares them), refused in one line before any output."""

import dataclasses
import typing

import pytest
from test_reliability_inputs import refused, small_run

from spmdlm.cli.launch import _base_type
from spmdlm.families import objective_flags
from spmdlm.run_args import SECTIONS
from spmdlm.run_args.choices import FLAG_BOUNDS


# -- every numeric flag: finite, in range, refused before any output ---------------------------------------------
@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--num_train_epochs", "nan", "--num_train_epochs must be a finite number at least 0, got nan"),
        ("--num_train_epochs", "inf", "--num_train_epochs must be a finite number at least 0, got inf"),
        ("--spike_window", str(2**31), "--spike_window must be in [2, 100000], got 2147483648"),
        ("--max_steps", "1" + "0" * 400, "--max_steps must be in [-1, 2147483647], got 1000"),
        ("--adam_epsilon", "-1e-8", "--adam_epsilon must be above 0, got -1e-08 (e.g. 1e-8"),
        ("--adam_epsilon", "0", "--adam_epsilon must be above 0, got 0.0"),
        ("--adam_epsilon", "nan", "--adam_epsilon must be a finite number above 0, got nan"),
        ("--z_loss", "-1", "--z_loss must be at least 0, got -1.0 (0 = off"),
        ("--skip_step_on_spike", "nan", "--skip_step_on_spike must be a finite number at least 0, got nan"),
        ("--save_every_minutes", "nan", "--save_every_minutes must be a finite number at least 0, got nan (0 = off)"),
        ("--mean_noise_span_length", "inf", "--mean_noise_span_length must be a finite number at least 1, got inf"),
    ],
)
def test_numeric_flags_one_rule(capsys, tmp_path, cache_dir, tiny_gpt2_config, flag, value, expected):
    line = refused(capsys, *small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, f"{flag}={value}"))
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_every_numeric_flag_is_bounded():
    """A numeric flag added without bounds would be judged only as finite: each must say its range."""
    numeric = {
        f.name
        for section in SECTIONS.values()
        for f in dataclasses.fields(section)
        if _base_type(typing.get_type_hints(section)[f.name]) in (int, float)
    }
    assert numeric - set(FLAG_BOUNDS) == set()
    assert set(FLAG_BOUNDS) <= numeric
    unbounded = [flag.name for flag in objective_flags() if flag.type in (int, float) and flag.bounds is None]
    assert unbounded == []
