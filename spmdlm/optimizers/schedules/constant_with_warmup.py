"""--lr_scheduler_type constant_with_warmup: transformers' name for `constant` (both warm up over --warmup_steps)."""

from __future__ import annotations

import dataclasses

from spmdlm.optimizers.schedules import constant

SCHEDULE = dataclasses.replace(constant.SCHEDULE, name="constant_with_warmup")
