"""An optimizer from outside the package, in one file (tests/plugins/spmdlm_sgd.py), registered by an entry point
only: its flag reaches the launcher's parser, --help and validation, it trains through `python -m spmdlm.launch`
with run_config.json recording it, and one step of the real train step (Stepper) moves each parameter by
-lr · grad. Two optimizers of one name are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, REPO, read_metrics
from flax import nnx

from spmdlm import optimizers
from spmdlm.cli import launch
from spmdlm.cli.launch import build_parser, family_choices, parse_args
from spmdlm.engine.optim import learning_rate_schedule
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Stepper, Training, loss_sums
from spmdlm.errors import ArgumentError, ConfigError
from spmdlm.families import get_family, load_config
from spmdlm.mesh import make_mesh
from spmdlm.optimizers.entries import Flag
from spmdlm.run_args.choices import FLAG_BOUNDS, SECTION_FLAGS
from spmdlm.run_args.sections import OptimizationArgs

PLUGINS = REPO / "tests" / "plugins"
ENTRY = "sgd = spmdlm_sgd:OPTIMIZER\n"
GPT2 = get_family("gpt2")
TINY_GPT2 = load_config("gpt2-tiny", "gpt2").replace(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def site_with(path: Path, entry_points: str) -> Path:
    """A site directory holding only the plugin's distribution metadata (its code is on tests/plugins)."""
    info = path / "spmdlm_sgd-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spmdlm-sgd\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[spmdlm.optimizers]\n{entry_points}")
    return path


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The plugin installed in this process: on the path, the registry read afresh (and forgotten after)."""

    def install(entry_points: str = ENTRY) -> None:
        monkeypatch.syspath_prepend(str(site_with(tmp_path / "site", entry_points)))
        monkeypatch.syspath_prepend(str(PLUGINS))
        optimizers.clear()

    yield install
    optimizers.clear()


def test_its_flag_reaches_the_parser_help_and_checks(installed):
    with pytest.raises(ArgumentError, match="--optim 'sgd' is not supported"):
        parse_args(["--train_file", "x.txt", "--optim", "sgd"])
    installed()
    assert list(optimizers.optimizers())[-1] == "sgd"
    help_text = " ".join(build_parser(family_choices()).format_help().split())
    assert "lion, muon, schedule_free_adamw, sgd" in help_text and "--sgd_momentum FLOAT SGD's momentum" in help_text
    args, _ = parse_args(["--train_file", "x.txt", "--optim", "sgd", "--sgd_momentum", "0.5"])
    assert args.optimization.optimizer == "sgd" and args.optimization.entry_flags == {"sgd_momentum": 0.5}
    recorded = args.to_json()
    assert recorded["optim"] == "sgd" and recorded["sgd_momentum"] == 0.5
    assert (
        OptimizationArgs(**{k: v for k, v in recorded.items() if k in ("optim", "entry_flags")}).flag_value(
            optimizers.optimizers()["sgd"].flags[0]
        )
        == 0.5
    )
    with pytest.raises(ArgumentError, match=r"--sgd_momentum must be in \[0, 1\), got 1.5 \(0 = no momentum\)"):
        parse_args(["--train_file", "x.txt", "--optim", "sgd", "--sgd_momentum", "1.5"])
    # the flag of an optimizer not chosen is ignored, as the --adam_* flags are under adafactor
    assert parse_args(["--train_file", "x.txt", "--sgd_momentum", "0.5"])[0].optimization.optimizer == "adamw"


def test_two_optimizers_of_one_name_are_refused(installed):
    installed(ENTRY + "sgd_again = spmdlm_sgd:OPTIMIZER\n")
    with pytest.raises(
        ConfigError, match="two optimizers are named 'sgd': entry point sgd = .* and entry point sgd_ag"
    ):
        optimizers.optimizers()


@pytest.mark.slow
def test_one_step_moves_each_parameter_by_minus_lr_times_its_gradient(installed):
    installed()
    lr = 0.5
    cfg = OptimizationArgs(optim="sgd", learning_rate=lr, max_grad_norm=0.0, lr_scheduler_type="constant")
    mesh = make_mesh("data=1", jax.devices()[:1])
    graphdef, state = build_train_state(GPT2, TINY_GPT2, mesh, optim=cfg, total_steps=2, compute=Compute(remat="none"))
    stepper = Stepper(
        graphdef, state, mesh, GPT2.forward, training=Training(optim=cfg, schedule=learning_rate_schedule(cfg, 2))
    )
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids}
    model, _ = nnx.merge(graphdef, state)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def mean_loss(p):
        sums = loss_sums(nnx.merge(graph, p, rest), jax.tree.map(jnp.asarray, batch), GPT2.forward)
        return sums["loss_sum"] / sums["tokens"]

    grads = nnx.to_pure_dict(jax.jit(jax.grad(mean_loss))(params))  # one program, not op by op
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    stepper.compile_train(state, spec)
    after, _ = stepper.train_step(state, jax.device_put(batch, stepper.batch_shardings(spec)), 0)
    moved = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, after)[0], nnx.Param))
    flat = lambda tree: dict(jax.tree_util.tree_leaves_with_path(tree))
    assert len(flat(grads)) > 10
    for path, grad in flat(grads).items():
        np.testing.assert_allclose(flat(moved)[path], flat(before)[path] - lr * grad, atol=1e-6, err_msg=str(path))
    assert max(float(np.abs(g).max()) for g in flat(grads).values()) * lr > 1e-3  # the step did move them


@pytest.mark.slow
def test_the_launcher_trains_with_it(tmp_path, cache_dir, tiny_gpt2_config):
    site = site_with(tmp_path / "site", ENTRY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    flags = {
        "config_name": tiny_gpt2_config,
        "train_file": FIXTURES / "overfit.txt",
        "vocab_size": 512,
        "block_size": 32,
        "per_device_train_batch_size": 1,
        "mesh": "data=8",
        "max_steps": 3,
        "logging_steps": 1,
        "max_eval_samples": 8,
        "export_hf": "false",
        "cache_dir": cache_dir,
        "output_dir": out,
        "optim": "sgd",
        "sgd_momentum": 0.9,
        "learning_rate": 0.05,
    }
    launch = lambda **changes: subprocess.run(
        [sys.executable, "-m", "spmdlm.launch"]
        + [word for name, value in {**flags, **changes}.items() for word in (f"--{name}", str(value))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    done = launch()
    assert done.returncode == 0, done.stderr[-3000:]
    run_config = json.loads((out / "run_config.json").read_text())
    recorded = (run_config["optim"], run_config["sgd_momentum"], run_config["entry_flags"])
    assert recorded == ("sgd", 0.9, {"sgd_momentum": 0.9})
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m and "eval" not in m.get("event", "")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # its flag declares that a resume must keep it (Flag.resume): another momentum is refused
    refused = launch(sgd_momentum=0.5, max_steps=4)
    assert refused.returncode == 2 and "holds a run with other settings (sgd_momentum)" in refused.stderr


@pytest.mark.parametrize("name", ["seed", "block_size"])  # another section's flag, an objective flag
def test_a_flag_the_launcher_has_already_is_refused(monkeypatch, name):
    clash = Flag(name, int, 0, "an optimizer's own")
    monkeypatch.setattr(launch, "declared_flags", lambda: (*optimizers.declared_flags(), clash))
    with pytest.raises(ConfigError, match=f"an optimizer or schedule declares --{name}, which the launcher has"):
        parse_args(["--train_file", "x.txt"])


def test_the_built_in_entries_and_the_section_s_fields_of_their_flags():
    assert list(optimizers.optimizers()) == ["adamw", "adafactor", "lion", "muon", "schedule_free_adamw"]
    assert sorted(optimizers.lr_schedules()) == sorted(
        ["linear", "cosine", "constant", "constant_with_warmup", "inverse_sqrt", "wsd"]
    )
    fields = {field.name: field for field in dataclasses.fields(OptimizationArgs)}
    for flag in SECTION_FLAGS:  # the flags older than the registry: fields, as their entries declare them
        assert (fields[flag.name].default, fields[flag.name].metadata["help"]) == (flag.default, flag.help)
        assert FLAG_BOUNDS[flag.name] == flag.bounds and flag in optimizers.declared_flags()
