"""`python -m spmdlm.launch [flags | args.json]`: pretrain on a device mesh, from a laptop CPU to a TPU pod.

The command line: the flags of spmdlm/run_args (their sections, the families' objective flags and quick starts) from
argv or one .json/.yaml file of flags. Every flag has a default that works: with no data flags the run trains the
default family's tiny model on the embedded corpus (the Python standard library) with the quick-start settings
(run_args QUICKSTART_COMMON plus the family's own; `--model_type NAME` for the others).

Process set-up happens here, before JAX touches a device: simulated CPU devices when the mesh asks for more than a
CPU-only machine has, and `jax.distributed.initialize` for multi-host runs (with a bounded wait for a lost process).
`--compile_for TOPOLOGY` compiles the run for a TPU slice instead of running it (spmdlm/train/compile_for/aot.py).
The run itself is spmdlm/train/run.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import textwrap
import threading
import time
import typing
from collections.abc import Mapping

import jax  # (importing starts no backend: the device flags below are read when one starts)
from jax._src import distributed
from jax.errors import JaxRuntimeError

from spmdlm import devices, host, storage
from spmdlm.cli import Parser, args_file_of, bounds_of, read_args_file, remember, to_bool
from spmdlm.data.mixture import name_of, sources_of
from spmdlm.errors import ArgumentError, ConfigError, DivergenceError, Preempted, UserError
from spmdlm.families import all_presets, families, objective_flags, objective_words, preset_names
from spmdlm.mesh import plan_mesh, requested_device_count, simulate_cpu_devices, skip_absent_tpu
from spmdlm.network import env_seconds
from spmdlm.optimizers import declared_flags
from spmdlm.optimizers.entries import Flag
from spmdlm.run_args import FLAG_SECTION, SECTIONS, RunArgs
from spmdlm.run_args.choices import (
    DEFAULT_MODEL_TYPE,
    FLAG_BOUNDS,
    OPTIMIZER_FLAGS,
    QUICKSTART_COMMON,
    SECRET_FLAGS,
    FamilyChoices,
    check_objective_flags,
    quickstart,
)
from spmdlm.run_args.sections import DevicesArgs
from spmdlm.train.compile_for.aot import run_compile_for, use_cpu_backend
from spmdlm.train.run import run

log = logging.getLogger("spmdlm")

# A multi-host job whose process stops sending heartbeats for this long (killed, crashed machine, lost network) is
# over: the others stop with LOST_PROCESS_EXIT_CODE and a line naming it. JAX's default is 100 s.
HEARTBEAT_TIMEOUT_ENV = "SPMDLM_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
LOST_PROCESS_EXIT_CODE = 4


def setup_devices(spec: DevicesArgs) -> None:
    """Simulate CPU devices for the mesh if needed, and join a multi-host job when one is described."""
    skip_absent_tpu()  # an installed libtpu on a machine without a TPU: straight to the CPU backend
    wanted = requested_device_count(spec.mesh)
    multi_host = spec.coordinator_address is not None or (spec.num_processes or 1) > 1
    cluster = not multi_host and _detected_cluster()
    # JAX's CPU backend has one device by default. The flag shapes only that backend, so it is set whatever the
    # machine has; whether the devices are simulated is known once JAX has chosen its backend.
    simulated = bool(wanted and wanted > 1 and not (multi_host or cluster) and simulate_cpu_devices(wanted))
    if multi_host:
        join_job(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
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
        print(f"spmdlm: CPU-only machine: simulating {wanted} CPU devices for --mesh {spec.mesh}", flush=True)


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


def setup_logging(stream=None) -> None:
    """Our log lines on `stream` (default stdout; the evaluator's stderr, its stdout being the results), the
    libraries' at WARNING and without tracebacks (_reported_by_us)."""
    level = logging.INFO if jax.process_index() == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=stream or sys.stdout,
        force=True,
    )
    for noisy in (
        "absl",
        "jax._src",
        "orbax",
        "grain",
        "asyncio",
        "concurrent.futures",
        "datasets",
        "huggingface_hub",
        "filelock",
        "gcsfs",
        "fsspec",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)
        logging.getLogger(noisy).addFilter(_reported_by_us)


def _reported_by_us(record: logging.LogRecord) -> bool:
    """orbax logs a failed asynchronous save or read from its threads, with tracebacks, as several ERROR lines (and
    asyncio and concurrent.futures its orphaned futures); the run reports that failure itself in one line. Other
    records keep just their message."""
    if record.levelno >= logging.ERROR and ("orbax" in record.pathname or record.name == "asyncio"):
        return False
    if record.exc_info and str(record.exc_info[1]) == "Event loop is closed":
        return False  # the callback of a read orbax abandoned (a damaged checkpoint it fell back from), firing late
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


def log_output_dir(args: RunArgs, given: bool) -> None:
    """The first line of a run: where it goes (a dry run: where it would go)."""
    how = "" if given else " (named after the model and the data; --output_dir to choose)"
    dry = ": --dry_run writes nothing there" if args.control.dry_run else ""
    log.info("output dir %s%s%s", args.control.output_dir, how, dry)


def _main(argv: list[str] | None) -> int:
    try:
        args, given = parse_args(argv)
        mask_command_line()
        if (
            args.devices.compile_for
        ):  # compile for a TPU slice this machine does not have: nothing runs, nothing is written
            use_cpu_backend()
            setup_logging()
            run_compile_for(args)
            return 0
        if args.devices.num_slices != 1:
            raise ArgumentError(
                "--num_slices describes the slices --compile_for compiles for; a real multi-slice "
                "run takes its slices from the devices (give --dcn_mesh)"
            )
        setup_devices(args.devices)
        plan_mesh(args.devices.mesh, args.devices.dcn_mesh, jax.devices())  # fail on a bad mesh before reading any data
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
        print(f"error: {storage.os_error_line(e)}", file=sys.stderr)
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


# -- the command line -------------------------------------------------------------------------------------------------
def _base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def family_choices() -> FamilyChoices:
    """What the parser needs to know of the registered families (the run's arguments know no registry)."""
    known = families()
    return FamilyChoices(
        objective_flags(),
        {name: tuple(flag.name for flag in f.flags) for name, f in known.items()},
        {name: f.quickstart for name, f in known.items()},
        tuple(preset_names()),
        {name: f.default_preset for name, f in known.items()},
        {name: objective_words(f) for name, f in known.items()},
    )


def _description(choices: FamilyChoices) -> str:
    fill = lambda text, indent="": textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent * 2)
    values = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())
    return "\n\n".join(
        [
            fill(
                "Pretrain a language model on a device mesh; --model_type chooses its family: "
                + ", ".join(f"{name} ({what})" for name, what in choices.objectives.items())
                + ". Flags follow the Hugging Face Flax scripts; a .json/.yaml file of flags may come first (flags "
                "after it win)."
            ),
            fill(
                "With no --train_file the run trains on the embedded corpus (this Python's standard library) with the "
                "quick-start values, which replace the defaults below for every flag not given: "
                f"{values(QUICKSTART_COMMON)}; and per family (--model_type):"
            )
            + "\n"
            + "\n".join(fill(f"{name}: {values(flags)}", "  ") for name, flags in choices.quickstarts.items()),
            fill("presets (--config_name): " + ", ".join(choices.presets)),
        ]
    )


def build_parser(choices: FamilyChoices) -> argparse.ArgumentParser:
    """The flags by section, one --help group each; the families' objective flags before run control."""
    parser = Parser(
        allow_abbrev=False,  # a mistyped flag is an error, never silently another flag
        prog="python -m spmdlm.launch",
        usage="%(prog)s [ARGS_FILE.json|.yaml] [--flag VALUE ...]",
        description=_description(choices),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    applies = "; ".join(f"{name}: {', '.join('--' + f for f in names)}" for name, names in choices.family_flags.items())
    for name, section in SECTIONS.items():
        if name == "control":
            group = parser.add_argument_group("objective", textwrap.fill(f"Each family's own flags ({applies}).", 100))
            for flag in choices.objective_flags:
                _add_flag(group, flag.name, flag.type, flag.default, flag.help)
        group = parser.add_argument_group(section.TITLE)
        hints = typing.get_type_hints(section)
        for field in (f for f in dataclasses.fields(section) if f.metadata.get("flag", True)):
            listing = field.metadata.get("listing")  # a registry's choices (--optim, --lr_scheduler_type)
            help_text = field.metadata["help"].format(listing()) if listing else field.metadata["help"]
            _add_flag(group, field.name, _base_type(hints[field.name]), field.default, help_text)
        if name == "optimization":
            for flag in entry_flags(choices):
                _add_flag(group, flag.name, flag.type, flag.default, flag.help)
    return parser


def entry_flags(choices: FamilyChoices) -> list[Flag]:
    """The flags optimizers and schedules declare (spmdlm/optimizers) that are no fields of the optimisation section;
    one named as another section's flag or an objective flag is refused."""
    flags = [flag for flag in declared_flags() if FLAG_SECTION.get(flag.name) != "optimization"]
    objective = {flag.name for flag in choices.objective_flags}
    for flag in flags:
        if flag.name in FLAG_SECTION or flag.name in objective:
            raise ConfigError(
                f"an optimizer or schedule declares --{flag.name}, which the launcher has already; rename it"
            )
    return flags


def _quickstart_family(args: RunArgs) -> str:
    """The family whose quick start fills the flags not given: --model_type's, else a preset --config_name's (so
    `--config_name modernbert-base` alone does not get GPT-2's --block_size)."""
    preset = all_presets().get(args.model.config_name or "", {})
    return args.model.model_type or preset.get("model_type", DEFAULT_MODEL_TYPE)


def parse_args(argv: list[str] | None = None, choices: FamilyChoices | None = None) -> tuple[RunArgs, set[str]]:
    """-> (args, names given explicitly). A first argument ending in .json/.yaml is a file of flags; flags after
    it override its values. `choices`: the families' (default: the registry's)."""
    choices = choices or family_choices()
    argv = list(sys.argv[1:] if argv is None else argv)
    objective_flags = {flag.name: flag for flag in choices.objective_flags}
    known = set(FLAG_SECTION) | set(objective_flags) | {flag.name for flag in entry_flags(choices)}
    parser = build_parser(choices)
    remember(parser, file_keys=sorted(known), bounds=bounds_of(flag_bounds(choices)))  # python -m's quick answer
    if args_file_of(argv):
        argv = read_args_file(args_file_of(argv), known) + argv[1:]
    given = vars(parser.parse_args(argv))
    objective = {name: given.get(name, flag.default) for name, flag in objective_flags.items()}
    optimizers_own = {flag.name: given.get(flag.name, flag.default) for flag in entry_flags(choices)}
    flags = {k: v for k, v in given.items() if k in FLAG_SECTION}
    args = RunArgs.of({**flags, "entry_flags": optimizers_own}, objective=objective)
    if args.uses_embedded_corpus:
        defaults = quickstart(choices, _quickstart_family(args))
        # --optim and --adafactor are one choice: either given replaces the quick start's (T5's adafactor)
        taken = set(given) | (OPTIMIZER_FLAGS if OPTIMIZER_FLAGS & set(given) else set())
        args = args.replace(**{k: v for k, v in defaults.items() if k not in taken})
    check_objective_flags(args.objective, choices.objective_flags)
    args = args.checked(tuple(choices.quickstarts))
    if args.control.output_dir is None:
        args = args.replace(output_dir=default_output_dir(args, choices.default_presets))
    return args, set(given)


def flag_bounds(choices: FamilyChoices) -> dict:
    """Every flag whose numbers the run checks, by name, with its bounds (None: any finite number): each section's
    fields (run_args.choices FLAG_BOUNDS), the objectives' and the optimizers' flags (their Flag.bounds)."""
    fields = {name: FLAG_BOUNDS.get(name) for name in FLAG_SECTION}
    return {**fields, **{flag.name: flag.bounds for flag in (*choices.objective_flags, *entry_flags(choices))}}


def _add_flag(group, name: str, tp: type, default, help_text: str) -> None:
    if "default" not in help_text and "compatibility" not in help_text and default is not None:
        help_text += f" (default: {default})"
    if tp is bool:
        # Both `--flag` and `--flag true/false` like HfArgumentParser; `--no_flag` turns it off.
        group.add_argument(
            f"--{name}", type=to_bool, nargs="?", const=True, default=argparse.SUPPRESS, help=help_text, metavar="BOOL"
        )
        group.add_argument(
            f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    else:
        group.add_argument(f"--{name}", type=tp, default=argparse.SUPPRESS, help=help_text, metavar=tp.__name__.upper())


def masked(argv: list[str]) -> list[str]:
    """A command line with the values of SECRET_FLAGS (`--hub_token X`, `--hub_token=X`) replaced by ***."""
    secret = {f"--{name}" for name in SECRET_FLAGS}
    out = []
    for i, word in enumerate(argv):
        name, equals, _ = word.partition("=")
        out.append(
            f"{name}=***"
            if equals and name in secret
            else "***"
            if i > 0 and argv[i - 1] in secret and not word.startswith("--")
            else word
        )
    return out


def mask_command_line() -> None:
    """Mask the secrets in this process's own command line, which trackers record (W&B's run files): once parsed,
    nothing here needs them from there."""
    sys.argv[1:] = masked(sys.argv[1:])
    if hasattr(sys, "orig_argv"):
        sys.orig_argv[1:] = masked(sys.orig_argv[1:])


def default_output_dir(args: RunArgs, default_presets: Mapping[str, str]) -> str:
    """runs/MODEL-DATA: a run named after its model (preset, config file or checkpoint) and its data, so runs of
    other models or data do not meet in one dir (the embedded quick starts: runs/gpt2-tiny-stdlib and so on)."""
    model_type = args.model.model_type or DEFAULT_MODEL_TYPE
    model = args.model.config_name or args.model.model_name_or_path or default_presets.get(model_type, model_type)
    return f"runs/{name_of(model)}-{_data_name(args)}"


def _data_name(args: RunArgs) -> str:
    """The data's part of a default output dir: the sources' names (at most three), or stdlib for the embedded
    corpus."""
    if args.data.train_file:
        sources = sources_of(args.data.train_file, None)
        names = [s.name for s in sources] or [name_of(part) for part in args.data.train_file.split(",") if part.strip()]
    else:
        named = args.data.data_mixture or args.data.dataset_dir or args.data.dataset_name
        names = [name_of(named)] if named else ["stdlib"]
    names = list(dict.fromkeys(names))
    return "+".join(names[:3] + ([f"{len(names) - 3}more"] if len(names) > 3 else []))
