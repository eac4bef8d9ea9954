"""What a forward pass measures for the stability monitors (spmdlm/engine/monitors.py), in the train step's monitor
variant only: each attention layer's largest logit and each layer's output mean square.

Nothing is recorded outside `recording()`, which only the monitor variant's loss opens: the plain train step,
evaluation and generation trace none of this and compile exactly as they would without it. Inside it a stack
(models/stack.py) wraps each layer in `LayerRecords`, which opens a list of its own around the layer: the attentions
the layer runs `record` into it (models/attention.py), the wrapper adds the layer's output, and the values leave the
layer as its outputs (under jax.checkpoint and through nnx.scan, stacked over the layers). The stack then sows them,
one vector per name over its layers in order, as `nnx.Intermediate`s under its own path, where the step pops them.
A layer called outside a stack (ModernBERT's first) is not measured.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

LOGIT_MAX = "attn_logit_max"  # a self-attention's largest logit (models/attention.py says which)
CROSS_LOGIT_MAX = "cross_attn_logit_max"  # a decoder's cross-attention's
OUTPUT_SQUARE_MEAN = "act_square_mean"  # the mean square of a layer's output, every position of the batch
NAMES = (LOGIT_MAX, CROSS_LOGIT_MAX, OUTPUT_SQUARE_MEAN)

_records: contextvars.ContextVar[list | None] = contextvars.ContextVar("spmdlm_probes", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, jax.Array]]]:
    """Within: `active()`, and `record` appends (name, value) to the list yielded, in the order recorded."""
    token = _records.set([])
    try:
        yield _records.get()
    finally:
        _records.reset(token)


def active() -> bool:
    """Whether this trace records (the monitor variant's forward pass): what a layer checks before measuring."""
    return _records.get() is not None


def record(name: str, value: jax.Array) -> None:
    """Keep `value` (float32) as this layer's `name` (NAMES); only while `active()`."""
    _records.get().append((name, value.astype(jnp.float32)))


def masked_max(scores: jax.Array, allowed: jax.Array | None) -> jax.Array:
    """The largest of `scores` where `allowed` (broadcast; None: everywhere)."""
    return jnp.max(scores if allowed is None else jnp.where(allowed, scores, -jnp.inf))


class LayerRecords:
    """A stack's `apply(layer, x, key) -> x` as `-> (x, values)`: what the layer recorded, then its output's mean
    square. `names` (set when traced) says what each value is; `per_layer` turns the values, stacked over the
    layers, into one vector per name."""

    def __init__(self, apply: Callable[..., jax.Array]):
        self.apply, self.names = apply, ()

    def __call__(self, layer, x: jax.Array, key) -> tuple[jax.Array, list[jax.Array]]:
        with recording() as records:
            x = self.apply(layer, x, key)
            record(OUTPUT_SQUARE_MEAN, jnp.mean(jnp.square(x.astype(jnp.float32))))
        self.names = tuple(name for name, _ in records)
        return x, [value for _, value in records]

    def per_layer(self, values: list[jax.Array]) -> dict[str, jax.Array]:
        """`values` ([layers] each, in `names`' order) as one vector per name, layer by layer: a layer that records a
        name k times (a ModernBERT period's k attentions) gives k consecutive entries, in the order it ran them."""
        out = {}
        for name in dict.fromkeys(self.names):
            mine = [value for n, value in zip(self.names, values) if n == name]
            out[name] = jnp.stack(mine, axis=1).reshape(-1)
        return out
