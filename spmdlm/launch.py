"""`python -m spmdlm.launch [flags | args.json]`: pretrain on a device mesh, from a laptop CPU to a TPU pod.

Process set-up happens here, before JAX touches a device: simulated CPU devices when the mesh asks for more than a
CPU-only machine has, and `jax.distributed.initialize` for multi-host runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from spmdlm.config import ArgumentError, RunArgs, parse_args

log = logging.getLogger("spmdlm")

ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin", "libtpu", "jax_plugins.xla_cuda12")


def _cpu_only() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(importlib.util.find_spec(name.split(".")[0]) for name in ACCELERATOR_PLUGINS)


def setup_devices(args: RunArgs) -> None:
    """Simulate CPU devices for the mesh if needed, and join a multi-host job when one is described."""
    from spmdlm.mesh import requested_device_count, simulate_cpu_devices

    wanted = requested_device_count(args.mesh)
    multi_host = args.coordinator_address is not None or (args.num_processes or 1) > 1
    if wanted and wanted > 1 and _cpu_only() and not multi_host:  # JAX's CPU backend has one device by default
        if simulate_cpu_devices(wanted):
            print(f"spmdlm: CPU-only machine: simulating {wanted} CPU devices for --mesh {args.mesh}", flush=True)

    import jax

    if multi_host:
        jax.distributed.initialize(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)
    elif _detected_cluster():
        jax.distributed.initialize()  # TPU pod / SLURM: JAX reads the topology from the environment


def _detected_cluster() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def setup_logging() -> None:
    import jax

    level = logging.INFO if jax.process_index() == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    for noisy in ("absl", "jax._src", "orbax", "grain", "asyncio", "datasets", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
        logging.getLogger(noisy).addFilter(_reported_by_us)


def _reported_by_us(record: logging.LogRecord) -> bool:
    """orbax logs a failed asynchronous save from its threads, with tracebacks, as several ERROR lines (and asyncio
    its orphaned futures); the run reports that failure itself in one line. Other records keep just their message."""
    if record.levelno >= logging.ERROR and ("orbax" in record.pathname or record.name == "asyncio"):
        return False
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def main(argv: list[str] | None = None) -> int:
    from spmdlm.checkpoint import CheckpointError
    from spmdlm.data.sources import DataError
    from spmdlm.data.tokenizer import TokenizerError
    from spmdlm.export import ExportError
    from spmdlm.mesh import MeshError
    from spmdlm.models.config import ConfigError

    from spmdlm.train.guard import LockError, Preempted
    from spmdlm.train.loop import DivergenceError, RunError

    user_errors = (ArgumentError, MeshError, DataError, TokenizerError, ConfigError, CheckpointError, RunError,
                   ExportError, LockError)
    try:
        args, _ = parse_args(argv)
        from spmdlm.mesh import parse_mesh

        setup_devices(args)
        import jax

        parse_mesh(args.mesh, jax.device_count())  # fail on a bad mesh before reading any data
        setup_logging()
        from spmdlm.train.loop import run

        run(args)
    except user_errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DivergenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Preempted as e:
        print(f"spmdlm: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("spmdlm: interrupted (nothing saved since the last checkpoint)", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a path that is not writable: the OS says what and where
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
