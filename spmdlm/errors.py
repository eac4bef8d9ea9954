"""Every error spmdlm reports to a user, at the ground floor so any module may raise any of them.

A `UserError` is input or a situation the user can fix: the command-line tools print its message as one line and
exit with status 2. Its message names the problem and the fix. Other exceptions are bugs (a traceback, status 1),
except the few with exit codes of their own below.
"""

from __future__ import annotations

import signal


def yaml_problem(error: Exception) -> str:
    """One line of a YAML parse error: what and where (PyYAML's own message spans several lines)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1} column {mark.column + 1}"
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


class UserError(ValueError):
    """Input that cannot work, with the fix in the message (exit status 2)."""


class ArgumentError(UserError):
    """A flag value that cannot work."""


class ConfigError(UserError):
    """A model config that cannot be found or used."""


class DataError(UserError):
    """A corpus, cache or dataset directory that cannot be read or used."""


class UnwritableDataError(DataError):
    """A token cache or dataset that cannot be written (a full disk, a folder not writable): the run stops, it never
    goes on without the split."""


class TokenizerError(UserError):
    """A tokenizer that cannot serve the requested model type, or one that cannot be found."""


class StorageError(UserError):
    """A gs:// path that cannot be used: no gcs extra, no credentials, no such bucket, another URL scheme."""


class MeshError(UserError):
    """A --mesh that does not match the devices."""


class CheckpointError(UserError):
    """No checkpoint where one was expected, a step that does not exist, or one that cannot be restored."""


class NonFiniteStateError(UserError):
    """The train state holds NaN or infinity: it must not be saved or exported."""


class ExportError(UserError):
    """A transformers directory or checkpoint that cannot be converted."""


class GenerateError(UserError):
    """Input that cannot be generated from: an empty or too long prompt, a model that does not generate text."""


class TasksError(UserError):
    """LM-harness tasks that cannot run: no lm-eval installed, an unknown task, a model without a likelihood."""


class RunError(UserError):
    """A run that cannot start as asked (output dir, shapes, sizes)."""


class LockError(UserError):
    """The output dir is in use by another run, or cannot be written."""


class DoesNotFit(UserError):
    """The compiled step needs more memory per device than the chip's HBM."""


class DivergenceError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite (exit status 3)."""


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint at `step` (exit status 128 + the signal's number)."""

    def __init__(self, signum: int, step: int, where):
        self.signum, self.step = signum, step
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}: the checkpoint is saved in "
            f"{where}; run the same command to resume"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
