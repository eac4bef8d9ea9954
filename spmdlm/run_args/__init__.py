"""The run's arguments, in sections: one frozen dataclass per `--help` group (model, data, run control, reporting,
optimisation, mesh and hosts, operations, output, the HF scripts' compatibility flags) plus the families' objective
flags, each section checking its own values when it is made. The fields are the launcher's flags with the Hugging Face
scripts' names; run_config.json records them flat, as before (`RunArgs.to_json` / `RunArgs.of`). The command line
that fills them is spmdlm/cli/launch.py.

Each stage of a run takes the section it uses: the optimizer the optimisation section, the families the objective
flags, the data stage the data section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from spmdlm.errors import ArgumentError
from spmdlm.run_args.choices import SECRET_FLAGS
from spmdlm.run_args.sections import (
    CompatArgs,
    ControlArgs,
    DataArgs,
    DevicesArgs,
    ModelArgs,
    OperationsArgs,
    OptimizationArgs,
    OutputArgs,
    ReportingArgs,
)

SECTIONS = {
    "model": ModelArgs,
    "data": DataArgs,
    "control": ControlArgs,
    "reporting": ReportingArgs,
    "optimization": OptimizationArgs,
    "devices": DevicesArgs,
    "operations": OperationsArgs,
    "output": OutputArgs,
    "compat": CompatArgs,
}
# flag name -> the section that holds it
FLAG_SECTION = {field.name: name for name, cls in SECTIONS.items() for field in dataclasses.fields(cls)}


def check_average(optimization: OptimizationArgs) -> None:
    """--ema_decay as the average keeps it, in float32: strictly between 0 and 1 there (0.9999999999 is 1.0 in float32,
    an average that never moves); --ema_start only with it."""
    decay = optimization.ema_decay
    kept = None if decay is None else float(np.float32(decay))
    if kept is not None and not 0.0 < kept < 1.0:
        effect = "would never move" if kept >= 1.0 else "would only copy the parameters"
        raise ArgumentError(
            f"--ema_decay {decay!r} is {kept:g} in float32, where the average is kept: the average {effect}; give a "
            "decay that float32 keeps between 0 and 1, e.g. 0.999 or 0.9999 (at most 0.99999994)"
        )
    if decay is None and optimization.ema_start:
        raise ArgumentError(
            f"--ema_start {optimization.ema_start} applies to --ema_decay, which is not given (no average is kept); "
            "give --ema_decay too, e.g. 0.999, or leave --ema_start out"
        )


def check_monitors(reporting: ReportingArgs, max_steps: int) -> None:
    """--monitor_every within --max_steps (when given): monitors that never run are refused, not silently skipped (a
    length from epochs is known once the data is: a warning there, corpora.warn_unreached)."""
    if 0 < max_steps < reporting.monitor_every:
        raise ArgumentError(
            f"--monitor_every {reporting.monitor_every} is beyond the run's last step (--max_steps {max_steps}): no "
            f"monitor would be logged; give --monitor_every {max_steps} or less, or leave it out"
        )


@dataclasses.dataclass(frozen=True)
class RunArgs:
    """A run's arguments: its sections, and the objective flags of the families by name (given or default)."""

    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    data: DataArgs = dataclasses.field(default_factory=DataArgs)
    control: ControlArgs = dataclasses.field(default_factory=ControlArgs)
    reporting: ReportingArgs = dataclasses.field(default_factory=ReportingArgs)
    optimization: OptimizationArgs = dataclasses.field(default_factory=OptimizationArgs)
    devices: DevicesArgs = dataclasses.field(default_factory=DevicesArgs)
    operations: OperationsArgs = dataclasses.field(default_factory=OperationsArgs)
    output: OutputArgs = dataclasses.field(default_factory=OutputArgs)
    compat: CompatArgs = dataclasses.field(default_factory=CompatArgs)
    objective: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, flags: Mapping[str, Any] = (), objective: Mapping[str, Any] | None = None) -> RunArgs:
        """From flat flags (as the command line and run_config.json name them); names of no section are objective
        flags unless `objective` is given."""
        return cls().replace(**dict(flags), **({"objective": objective} if objective is not None else {}))

    @classmethod
    def of_run(cls, run_config: Mapping[str, Any]) -> RunArgs:
        """The arguments a run_config.json records (a flag it predates: that flag's default; what is not a flag,
        such as its model config or fingerprints, left out)."""
        flags = {k: v for k, v in run_config.items() if k in FLAG_SECTION}
        return cls.of(flags, objective=dict(run_config.get("objective") or {}))

    def replace(self, **changes) -> RunArgs:
        """A copy with `changes` by flag name (each goes to its section; other names are objective flags), or
        whole sections / `objective` by their names."""
        by_section: dict[str, dict[str, Any]] = {}
        whole = {k: changes.pop(k) for k in list(changes) if k in SECTIONS or k == "objective"}
        objective = {k: v for k, v in changes.items() if k not in FLAG_SECTION}
        for name, value in changes.items():
            if name in FLAG_SECTION:
                by_section.setdefault(FLAG_SECTION[name], {})[name] = value
        updated = {name: dataclasses.replace(getattr(self, name), **values) for name, values in by_section.items()}
        if objective:
            updated["objective"] = {**whole.pop("objective", self.objective), **objective}
        return dataclasses.replace(self, **whole, **updated)

    def checked(self, model_types) -> RunArgs:
        """The rules across sections, and each section's derived defaults resolved (--optim, --remat, --eval_steps,
        --token): what the run reads from here on."""
        self.model.check_family(model_types)
        self.data.check_sources()
        self.optimization.check_steps(self.control.max_steps)
        self.operations.check_steps(self.control.max_steps)
        check_average(self.optimization)
        check_monitors(self.reporting, self.control.max_steps)
        if self.control.evaluating and not self.control.training and not self.data.holds_out:
            raise ArgumentError(
                "nothing to evaluate: --do_eval without training needs held-out documents; give "
                "--validation_file or a --validation_split_percentage above 0"
            )
        return dataclasses.replace(
            self,
            reporting=self.reporting.resolved(),
            optimization=self.optimization.resolved(),
            output=self.output.replace(hub_token=self.output.hub_token or self.compat.token),
        )

    @property
    def uses_embedded_corpus(self) -> bool:
        return not self.data.given and self.model.model_name_or_path is None

    def to_json(self) -> dict[str, Any]:
        """Flat, as run_config.json records it: every section's flags, the objective flags (as one mapping, and
        beside the others), and so the optimizers' flags that are no fields (`entry_flags`, when there are any); never
        the secrets."""
        out = {k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()}
        for name in SECRET_FLAGS:
            out.pop(name)
        entry_flags = out.pop("entry_flags")  # the optimizers' flags that are no fields: recorded only when there are
        if entry_flags:
            out.update(entry_flags=entry_flags, **entry_flags)
        return {**out, "objective": dict(self.objective), **self.objective}
