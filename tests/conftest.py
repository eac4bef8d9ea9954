"""Tests run on CPU with 8 simulated devices so every mesh shape is exercised without accelerators."""

import os

# Must happen before JAX initialises its backends (i.e. before any test imports jax and asks for devices).
# LLVM's optimisation level 1 instead of XLA:CPU's default 2 for the machine code: the same optimised HLO
# (compared) and the same losses (a 100-step run compared bit for bit), compiled ~30% faster; the tiny test
# programs spend more time compiling than running (benchmarks never run under this). Subprocesses inherit both
# flags; those that must simulate their own devices (the launcher adds the count) pass COMPILE_FLAGS alone.
COMPILE_FLAGS = "--xla_backend_optimization_level=1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Many tests compile the same tiny programs (and launch subprocesses that do): one persistent compilation cache for
# the session, inherited by those subprocesses, compiles each once. The executables are the same either way.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmdlm-test-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from spmdlm.mesh import simulated_devices_flags  # noqa: E402  (imports jax: after the variables it reads)

os.environ["XLA_FLAGS"] = simulated_devices_flags(f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_FLAGS}", 8)

import contextlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sysconfig  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "data"
# A small corpus on every machine: the standard library's json package, as a glob of its .py files.
STDLIB_JSON = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")


def run_argv(out, config, cache_dir, *extra: str, train_file=STDLIB_JSON, **flags) -> list[str]:
    """The launcher's command line for a test run into `out`: --train_file (None: none), --config_name (None: none),
    --output_dir and --cache_dir, then each keyword as `--name value` (True: the bare flag, False: `--name false`,
    None: left out), then `extra` (last, so a flag there wins over the same flag before it)."""
    head = {"train_file": train_file, "config_name": config, "output_dir": out, "cache_dir": cache_dir}
    argv = []
    for name, value in {**head, **flags}.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not None:
            argv += [f"--{name}", "false" if value is False else str(value)]
    return [*argv, *extra]


def pytest_collection_modifyitems(items):
    """The files that hold slow tests first, each file's tests together and in order (a stable sort, the same in
    every xdist worker; module fixtures are made once): the last tests to run are then short ones, and neither
    worker waits long on the other at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream() -> Iterator[None]:
    """An in-process launcher run points the root logger at the stdout of its test (capsys's, closed after it): a
    later test whose code logs before its own run sets logging up would get logging's "--- Logging error ---" on
    stderr. Such handlers are dropped before and after every test, whatever the order."""

    def drop() -> None:
        import logging

        for handler in list(logging.root.handlers):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logging.root.removeHandler(handler)

    drop()
    yield
    drop()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole session, so runs of the same corpus tokenize once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def silent_server(monkeypatch) -> Iterator[str]:
    """http://127.0.0.1:PORT of a loopback socket that accepts connections (the kernel's backlog) and never answers:
    a dead server. Network calls are bounded at 2 s (SPMDLM_NETWORK_TIMEOUT) while it lives."""
    monkeypatch.setenv("SPMDLM_NETWORK_TIMEOUT", "2")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture(scope="session")
def tiny_gpt2_config(tmp_path_factory) -> Path:
    """A GPT-2 small enough that a train step takes milliseconds."""
    path = tmp_path_factory.mktemp("configs") / "gpt2-micro.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "vocab_size": 512,
                "n_positions": 64,
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def tiny_configs(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny config (family_fixtures.py) as a JSON file, by family."""
    from family_fixtures import FIXTURES

    folder = tmp_path_factory.mktemp("family-configs")
    paths = {}
    for family, fixture in FIXTURES.items():
        paths[family] = folder / f"{family}.json"
        paths[family].write_text(json.dumps(fixture.tiny_config))
    return paths


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(output_dir: Path) -> dict:
    """The model parameters of the latest checkpoint, by path, as numpy arrays."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from spmdlm import checkpoint

    manager = checkpoint.make_manager(output_dir, read_only=True)
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(model=ocp.args.StandardRestore()))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(restored["model"])}


class Killed(Exception):
    """Stands in for a job killed right after it wrote a checkpoint."""


# What XLA's SPMD partitioner logs when it cannot go from one sharding to the next but by gathering a whole tensor.
INVOLUNTARY_REMAT = "Involuntary full rematerialization"


@contextlib.contextmanager
def uncached_compiles() -> Iterator[None]:
    """Within: programs compile, none comes from the session's persistent cache. XLA partitions (and warns) only
    when it compiles: a cached program would pass unseen."""
    import jax

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def run_killed_after_first_checkpoint(monkeypatch, launch_fn) -> None:
    """Run `launch_fn()` and stop it, as a killed job, as soon as its first checkpoint is on disk."""
    from spmdlm import checkpoint

    original_save = checkpoint.save

    def save_then_die(manager, step, *args, **kwargs):
        original_save(manager, step, *args, **kwargs)
        manager.wait_until_finished()
        raise Killed(step)

    monkeypatch.setattr(checkpoint, "save", save_then_die)
    try:
        launch_fn()
    except Killed:
        return
    finally:
        monkeypatch.setattr(checkpoint, "save", original_save)
    raise AssertionError("the run ended without writing a checkpoint")


@pytest.fixture(scope="session")
def gcs_bucket():
    """A GCS emulator (gcp-storage-emulator, in memory; see tests/gcs_emulator.py) on a free loopback port for the
    whole session, with one bucket; STORAGE_EMULATOR_HOST points this process and its subprocesses at it. Yields "gs://BUCKET"."""
    import importlib.util

    for module in ("gcp_storage_emulator", "gcsfs"):  # (not imported here: spmdlm.storage configures gcsfs)
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is missing: gs:// tests need the test extra (pip install -e '.[test]')")
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bucket = "spmdlm-test"
    server = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "gcs_emulator.py"),
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            bucket,
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail("the GCS emulator did not start")
            time.sleep(0.05)
    saved = {
        k: os.environ.get(k)
        for k in (
            "STORAGE_EMULATOR_HOST",
            "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
        )
    }
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    try:
        yield f"gs://{bucket}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
