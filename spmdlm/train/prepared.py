"""The run as its stages prepared it (spmdlm/train/run.py): the frozen records of resolve, the output dir, the
tokenizer and the data, with the step schedule and the Hub repository; what the training loop, the evaluation and
publishing read, and never write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmdlm.data import pipeline
from spmdlm.engine.evaluation import HeldOut, held_out_of
from spmdlm.train.stages.corpora import Data
from spmdlm.train.stages.outputs import OutputDir
from spmdlm.train.stages.resolve import Run
from spmdlm.train.stages.vocabulary import Vocabulary


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The records of the stages up to the data, and what they give: the step schedule, the Hub repository."""

    run: Run
    output_dir: OutputDir
    vocabulary: Vocabulary
    data: Data
    schedule: pipeline.Schedule | None  # None: the run only evaluates
    hub: Any = None  # publish.Hub: --push_to_hub's repository, on process 0 (publish.hub_for)

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps if self.schedule else 0

    @property
    def training(self) -> bool:
        """Whether the run trains (it has training data)."""
        return self.data.train is not None

    @property
    def steps_left(self) -> bool:
        """Whether steps remain to train (not so for a finished run, or one that only evaluates)."""
        return self.training and self.output_dir.latest_step < self.total_steps

    def held_out(self) -> HeldOut:
        """What the run's evaluation reads (spmdlm/engine/evaluation.py)."""
        args, data = self.run.args, self.data
        return held_out_of(
            data.validation_splits, data.objective, args.control, self.run.mesh, args.data.max_eval_samples
        )
