"""The registry of optimizers (--optim) and learning-rate schedules (--lr_scheduler_type), by name.

Optimizers come from the modules of this package (each, but `entries`, holds one `OPTIMIZER`) and from any installed
package that names an `Optimizer` under the `spmdlm.optimizers` entry-point group; schedules from the modules of
`spmdlm.optimizers.schedules` (each holds one `SCHEDULE`) and the `spmdlm.schedules` group. E.g. in a plugin's
pyproject.toml:

    [project.entry-points."spmdlm.optimizers"]
    sgd = "my_package.sgd:OPTIMIZER"

so a new optimizer is one file (docs/optimizers.md, "Adding an optimizer"); two of one name are refused. Each entry
owns its flags, which reach the launcher's parser, its validation and --help from here (`declared_flags`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil

from spmdlm.errors import ConfigError
from spmdlm.optimizers import schedules as schedule_modules
from spmdlm.optimizers.entries import Flag, Optimizer, Schedule

OPTIMIZER_GROUP, SCHEDULE_GROUP = "spmdlm.optimizers", "spmdlm.schedules"
DEFAULT_OPTIMIZER, DEFAULT_SCHEDULE = "adamw", "linear"  # listed first; the other built-ins after them by name
NOT_ENTRIES = ("entries", "schedules")  # this package's modules that hold no optimizer


def _registry(kind: type, attribute: str, package, group: str, default: str) -> dict:
    """name -> entry of `kind`: `attribute` of each module of `package` (the default first, then by name), then the
    entry points of `group` by name. A name twice, or an entry point that fails to load, is a ConfigError."""
    found: dict[str, tuple] = {}
    what = kind.__name__.lower()

    def add(entry, source: str) -> None:
        if not isinstance(entry, kind):
            raise ConfigError(f"{what} {source} is a {type(entry).__name__}, not a spmdlm {kind.__name__}")
        if entry.name in found:
            raise ConfigError(
                f"two {what}s are named {entry.name!r}: {found[entry.name][1]} and {source}; uninstall or rename one"
            )
        found[entry.name] = (entry, source)

    modules = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in NOT_ENTRIES)
    for module in sorted(modules, key=lambda name: name != default):
        add(getattr(importlib.import_module(f"{package.__name__}.{module}"), attribute), f"{package.__name__}.{module}")
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        source = f"entry point {entry.name} = {entry.value}"
        try:
            loaded = entry.load()
        except Exception as e:  # a broken plugin: say which, not a traceback from deep inside importlib
            raise ConfigError(f"{what} {source} failed to load: {type(e).__name__}: {e}") from None
        add(loaded, source)
    return {name: entry for name, (entry, _) in found.items()}


@functools.cache
def optimizers() -> dict[str, Optimizer]:
    """--optim's choices: this package's, then the entry points' (loaded once, on first use)."""
    return _registry(Optimizer, "OPTIMIZER", importlib.import_module(__name__), OPTIMIZER_GROUP, DEFAULT_OPTIMIZER)


@functools.cache
def lr_schedules() -> dict[str, Schedule]:
    """--lr_scheduler_type's choices: spmdlm.optimizers.schedules', then the entry points'."""
    return _registry(Schedule, "SCHEDULE", schedule_modules, SCHEDULE_GROUP, DEFAULT_SCHEDULE)


def clear() -> None:
    """Forget the entries found (a test that installs a plugin on the path)."""
    optimizers.cache_clear()
    lr_schedules.cache_clear()


def declared_flags() -> tuple[Flag, ...]:
    """Every optimizer's and schedule's flags, each name once (entries share a flag by sharing its declaration)."""
    flags: dict[str, Flag] = {}
    for entry in (*optimizers().values(), *lr_schedules().values()):
        for flag in entry.flags:
            if flags.setdefault(flag.name, flag) != flag:
                raise ConfigError(
                    f"{entry.name} declares --{flag.name} differently from another optimizer or schedule; "
                    "share one Flag declaration"
                )
    return tuple(flags.values())


def owners(flag_name: str, entries) -> list[str]:
    """The names of the `entries` that take --flag_name."""
    return [entry.name for entry in entries if any(flag.name == flag_name for flag in entry.flags)]
