"""Test-only fault injection: `SPMDLM_TEST_STUCK_STEP=KIND:N` (KIND `train` or `eval`) makes the Nth step of that
kind this process dispatches (from 1) never finish, blocked as a collective waiting for a lost peer is: the main
thread waits inside a device computation, where no Python signal handler can run. It logs one warning when it blocks.
Unset, it costs one dict lookup a step."""

from __future__ import annotations

import collections
import logging
import os
import threading

import jax
import numpy as np

log = logging.getLogger("spmdlm")

STUCK_STEP_ENV = "SPMDLM_TEST_STUCK_STEP"
_dispatched: collections.Counter[str] = collections.Counter()


def maybe_stuck(kind: str) -> None:
    """Called before each step of `kind` is dispatched: blocks forever at the one SPMDLM_TEST_STUCK_STEP names."""
    value = os.environ.get(STUCK_STEP_ENV)
    if not value:
        return
    _dispatched[kind] += 1
    if value == f"{kind}:{_dispatched[kind]}":
        log.warning("%s=%s: this step blocks now", STUCK_STEP_ENV, value)
        never = jax.jit(lambda: jax.pure_callback(_wait_forever, jax.ShapeDtypeStruct((), np.int32)))
        jax.block_until_ready(never())


def _wait_forever() -> np.ndarray:
    threading.Event().wait()
    return np.int32(0)
