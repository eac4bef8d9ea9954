"""`python -m spmdlm.launch [flags | args.json]`: pretrain on a device mesh, from a laptop CPU to a TPU pod.

Process set-up happens here, before JAX touches a device: simulated CPU devices when the mesh asks for more than a
CPU-only machine has, and `jax.distributed.initialize` for multi-host runs (with a bounded wait for a lost process).
`--compile_for TOPOLOGY` compiles the run for a TPU slice instead of running it (spmdlm/train/aot.py).
"""

from __future__ import annotations

import sys

from spmdlm import host

if __name__ == "__main__":  # before JAX loads (~3 s): the allocator is chosen when the process starts
    host.restart_with_huge_page_malloc()

import logging  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402  (importing starts no backend: the device flags below are read when one starts)
from jax._src import distributed  # noqa: E402
from jax.errors import JaxRuntimeError  # noqa: E402

from spmdlm import config, devices  # noqa: E402
from spmdlm.config import RunArgs  # noqa: E402
from spmdlm.errors import ArgumentError, DivergenceError, Preempted, UserError  # noqa: E402
from spmdlm.families import family_choices  # noqa: E402
from spmdlm.mesh import plan_mesh, requested_device_count, simulate_cpu_devices, skip_absent_tpu  # noqa: E402
from spmdlm.train.aot import run_compile_for, use_cpu_backend  # noqa: E402
from spmdlm.train.loop import run  # noqa: E402
from spmdlm.train.network import env_seconds  # noqa: E402

log = logging.getLogger("spmdlm")

# A multi-host job whose process stops sending heartbeats for this long (killed, crashed machine, lost network) is
# over: the others stop with LOST_PROCESS_EXIT_CODE and a line naming it. JAX's default is 100 s.
HEARTBEAT_TIMEOUT_ENV = "SPMDLM_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
LOST_PROCESS_EXIT_CODE = 4


def setup_devices(args: RunArgs) -> None:
    """Simulate CPU devices for the mesh if needed, and join a multi-host job when one is described."""
    skip_absent_tpu()  # an installed libtpu on a machine without a TPU: straight to the CPU backend
    wanted = requested_device_count(args.mesh)
    multi_host = args.coordinator_address is not None or (args.num_processes or 1) > 1
    cluster = not multi_host and _detected_cluster()
    # JAX's CPU backend has one device by default. The flag shapes only that backend, so it is set whatever the
    # machine has; whether the devices are simulated is known once JAX has chosen its backend.
    simulated = bool(wanted and wanted > 1 and not (multi_host or cluster) and simulate_cpu_devices(wanted))
    if multi_host:
        join_job(
            coordinator_address=args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id
        )
    elif cluster:
        join_job()  # TPU pod / SLURM: JAX reads the topology from the environment
    if devices.unused_nvidia_gpu():
        log.warning(
            "this machine has an NVIDIA GPU but JAX has only its CPU backend, so this run computes on the "
            "CPU; for the GPU: %s",
            devices.CUDA_INSTALL_HINT,
        )
    elif simulated and jax.default_backend() == "cpu":
        print(f"spmdlm: CPU-only machine: simulating {wanted} CPU devices for --mesh {args.mesh}", flush=True)


def _detected_cluster() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def heartbeat_timeout() -> int:
    return env_seconds(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S, int)


def join_job(**kwargs) -> None:
    """`jax.distributed.initialize`, then a watch on the other processes (PeerWatch)."""
    timeout = heartbeat_timeout()
    # JAX's own heartbeat check is the backstop: it aborts every process (a C++ stack trace, SIGABRT) once one has
    # been silent for its timeout. Ours fires first and says which process was lost.
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=2 * timeout + 10)
    global _peer_watch
    if jax.process_count() > 1:
        _peer_watch = PeerWatch(timeout).start()


class PeerWatch:
    """Each process of a multi-host job writes a beat to the job's key-value store (on the coordinator) every few
    seconds and reads the others'. One that has been silent for `timeout` seconds (killed, crashed, cut off), or that
    exited with an error that long ago, ends this process too: one line naming it on stderr, exit code 4. Without
    this, the survivors would wait in their next collective until JAX's own heartbeat check aborts them.

    A process that finished normally is not waited for. When process 0, the coordinator, dies, JAX itself stops the
    others at once ("... the leader task was preempted/died ...": the store lives there).
    """

    PREFIX = "spmdlm/peer_watch/"

    def __init__(self, timeout: float):
        self.timeout, self.interval = timeout, max(0.5, min(5.0, timeout / 10))
        self.client = distributed.global_state.client
        self.me, self.count = distributed.global_state.process_id, distributed.global_state.num_processes
        self._finished: int | None = None
        self._thread = threading.Thread(target=self._run, name="spmdlm-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def finish(self, exit_code: int) -> None:
        """This process is leaving in order: a normal end is not waited for, an error is reported to the others.
        The watch goes on while JAX's shutdown waits for the others, so a peer lost then is still reported."""
        self._finished = exit_code
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", f"exit {exit_code}", allow_overwrite=True)
        except Exception:  # the coordinator is gone: nobody is left to tell
            pass

    def _run(self) -> None:
        seen = {p: (None, time.monotonic()) for p in range(self.count) if p != self.me}
        beat = 0
        while True:
            time.sleep(self.interval)
            beat += 1
            if self._finished == 0:  # done: JAX's shutdown waits for the others (its heartbeat check bounds it)
                return
            try:
                if self._finished is None:
                    self.client.key_value_set(f"{self.PREFIX}{self.me}", f"beat {beat}", allow_overwrite=True)
                values = {key.rsplit("/", 1)[-1]: value for key, value in self.client.key_value_dir_get(self.PREFIX)}
            except Exception as e:
                if self._finished is not None:  # the job is ending anyway
                    return
                reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                self._leave(f"lost process 0, the coordinator ({reason})")
            now = time.monotonic()
            for peer, (value, since) in seen.items():
                current = values.get(str(peer))
                if current != value:
                    seen[peer] = (current, now)
                elif current != "exit 0" and now - since >= self.timeout:
                    if current and current.startswith("exit"):
                        self._leave(
                            f"process {peer} stopped with exit status {current.split()[1]} {now - since:.0f} s ago"
                        )
                    self._leave(
                        f"lost process {peer} (no sign of life for {now - since:.0f} s: killed, crashed or cut off)"
                    )

    def _leave(self, what: str) -> None:
        """Report and leave at once: the main thread may be blocked in a collective that will never complete (or,
        after an error here, in JAX's shutdown, waiting for the lost process)."""
        try:
            sys.stdout.flush()
            print(
                f"error: process {self.me} of {self.count}: {what}; stopping this process too (exit "
                f"{LOST_PROCESS_EXIT_CODE}); nothing is saved after the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
        finally:
            os._exit(LOST_PROCESS_EXIT_CODE)


_peer_watch: PeerWatch | None = None


def setup_logging() -> None:
    level = logging.INFO if jax.process_index() == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout, force=True
    )
    for noisy in (
        "absl",
        "jax._src",
        "orbax",
        "grain",
        "asyncio",
        "datasets",
        "huggingface_hub",
        "filelock",
        "gcsfs",
        "fsspec",
    ):
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
    if argv is None:  # the command line (the spmdlm-launch script; `python -m` restarted above already)
        host.restart_with_huge_page_malloc()
    code = 1  # an unexpected exception
    try:
        code = _main(argv)
    finally:
        if _peer_watch is not None:  # tell the other processes of a multi-host job how this one ended
            _peer_watch.finish(code)
    return code


def parse_args(argv: list[str] | None = None) -> tuple[RunArgs, set[str]]:
    """The launcher's flags (the families' objective flags and quick starts included) -> (args, names given)."""
    return config.parse_args(argv, family_choices())


def log_output_dir(args: RunArgs, given: bool) -> None:
    """The first line of a run: where it goes (a dry run: where it would go)."""
    how = "" if given else " (named after the model and the data; --output_dir to choose)"
    log.info("output dir %s%s%s", args.output_dir, how, ": --dry_run writes nothing there" if args.dry_run else "")


def _main(argv: list[str] | None) -> int:
    try:
        args, given = parse_args(argv)
        config.mask_command_line()
        if args.compile_for:  # compile for a TPU slice this machine does not have: nothing runs, nothing is written
            use_cpu_backend()
            setup_logging()
            run_compile_for(args)
            return 0
        if args.num_slices != 1:
            raise ArgumentError(
                "--num_slices describes the slices --compile_for compiles for; a real multi-slice "
                "run takes its slices from the devices (give --dcn_mesh)"
            )
        setup_devices(args)
        plan_mesh(args.mesh, args.dcn_mesh, jax.devices())  # fail on a bad mesh before reading any data
        setup_logging()
        log_output_dir(args, "output_dir" in given)
        run(args)
    except UserError as e:
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
    except Exception as e:
        if _peer_watch is None or not isinstance(e, JaxRuntimeError):
            raise
        # In a multi-host job a failed collective usually means a lost process: the watch names it (exit 4)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        print(
            f"error: {first}; waiting up to {_peer_watch.timeout} s to learn whether another process was lost",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
