"""Weighted mixtures of corpora refused in one line naming the source, before any output: YAML errors, a weight that
is not a number, weights whose sum overflows a float, a source too small for one example. YAML 1.1's `1e-3` (a
string to it) is read as the number it means."""

import pytest
from test_reliability_inputs import refused, small_run


# -- mixtures: refused at parse time, naming the source ----------------------------------------------------------
def test_mixture_yaml_errors_and_weights(tmp_path):
    from spmdlm.data.mixture import parse_train_file, read_mixture_file
    from spmdlm.errors import ArgumentError

    path = tmp_path / "mix.yaml"
    path.write_text("sources:\n  - name: a\n   train_file: [a.txt\n")
    with pytest.raises(ArgumentError, match="is not valid YAML: .* at line 3 column 4"):
        read_mixture_file(str(path))
    path.write_text(
        "sources:\n  - {name: a, train_file: a.txt, weight: 1e-3}\n  - {name: b, train_file: b.txt, weight: 1}\n"
    )  # YAML 1.1 reads 1e-3 as a string
    assert [s.weight for s in read_mixture_file(str(path))] == pytest.approx([1e-3 / 1.001, 1 / 1.001])
    path.write_text(
        "sources:\n  - {name: a, train_file: a.txt, weight: 1.0e308}\n  - {name: b, train_file: b.txt, "
        "weight: 1.0e308}\n"
    )
    with pytest.raises(ArgumentError, match="the weights sum to more than a float holds; scale them down"):
        read_mixture_file(str(path))
    with pytest.raises(ArgumentError, match="--train_file: the weights sum to more than a float holds"):
        parse_train_file("a.txt:1e308,b.txt:1e308")
    with pytest.raises(ArgumentError, match="source b needs a numeric weight"):
        path.write_text("- {name: a, train_file: a.txt, weight: 1}\n- {name: b, train_file: b.txt, weight: lots}\n")
        read_mixture_file(str(path))


def test_overflowing_weights_leave_no_output(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    flags = small_run(tmp_path / "run", cache_dir, tiny_gpt2_config)
    at = flags.index("--train_file") + 1
    flags[at] = f"{flags[at]}:1e308,{flags[at]}:1e308"
    assert "the weights sum to more than a float holds" in refused(capsys, *flags)
    assert not (tmp_path / "run").exists()


def test_a_source_too_small_is_named(capsys, tmp_path, cache_dir, tiny_gpt2_config):
    (tmp_path / "tiny.txt").write_text("hello world\n")
    flags = small_run(tmp_path / "run", cache_dir, tiny_gpt2_config, "--validation_split_percentage", "0")
    at = flags.index("--train_file") + 1
    flags[at] = f"{flags[at]}:0.5,{tmp_path / 'tiny.txt'}:0.5"
    line = refused(capsys, *flags)
    assert "--train_file source tiny: the train corpus has" in line and "fewer than one example of 33" in line, line
    assert not (tmp_path / "run").exists()
