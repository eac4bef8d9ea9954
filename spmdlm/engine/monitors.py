"""The stability monitors (--monitor_every), computed inside the train step's monitor variant (step.Stepper): the
gradient norm of each layer and of each parameter group, the update-to-parameter RMS ratio of each group, the
output logits' max and mean squared log-partition (the loss sums' `logits_max`, `lse_square_sum`), and what the
forward pass records in that variant only (models/probes.py): each layer's largest attention logit and its output's
RMS.

Layers are found in the parameter paths: a scanned stack (models/stack.py) holds its layers' parameters under
`layers` with a leading layers axis (one norm per index along it); a per-layer stack (--scan_unroll per_layer) under
`layers/<i>`. The recorded values come sown under their stack's path. An encoder-decoder's two stacks are told apart
by their first path name (`encoder/layer_0`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.models import probes

PREFIX = "monitor/"
PROBE = "probe/"  # the loss sums' keys of what the layers recorded (with_probes)
MONITOR_SUMS = ("logits_max", "lse_square_sum")  # loss sums only the monitors read
LAYER = "layer"  # a key ending in it holds one value per layer: metrics.jsonl's `<key>_<index>`
# A parameter's group: the first group any of whose words appears in one of its path names (the head's own norm is
# the head's; a block's attention norm a norm).
GROUPS = (
    ("head", ("head",)),
    ("norms", ("norm", "ln_")),
    ("embeddings", ("embed", "wte", "wpe", "shared")),
    ("attention", ("attn", "attention")),
    ("mlp", ("mlp", "ffn")),
)


def path_names(path) -> tuple:
    """A parameter's tree path as its names and indices (nnx's trailing `.value` left out)."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
        if name != "value":
            names.append(name)
    return tuple(names)


def group_of(names: tuple) -> str:
    """The parameter group (GROUPS) of a parameter's path names; `other` for none."""
    words = [str(n).lower() for n in names if isinstance(n, str)]
    for group, keys in GROUPS:
        if any(key in word for word in words for key in keys):
            return group
    return "other"


def layer_of(names: tuple) -> tuple[tuple, int | None] | None:
    """(the stack's path before `layers`, the layer's index: None for a scanned stack's leading axis), or None for a
    parameter outside the layer stacks."""
    if "layers" not in names:
        return None
    at = len(names) - 1 - names[::-1].index("layers")
    index = names[at + 1] if at + 1 < len(names) and isinstance(names[at + 1], int) else None
    return names[:at], index


def _square_sums(leaf: jax.Array, scanned: bool) -> jax.Array:
    """The sum of squares in fp32: of the whole leaf, or of each index of its leading layers axis."""
    squares = jnp.square(leaf.astype(jnp.float32))
    return jnp.sum(squares, axis=tuple(range(1, leaf.ndim))) if scanned else jnp.sum(squares)


def named_leaves(tree) -> list[tuple[tuple, jax.Array]]:
    return [(path_names(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def layer_norms(grads: list[tuple[tuple, jax.Array]]) -> dict[str, jax.Array]:
    """The gradient norm of each layer of each stack: `monitor/grad_norm/layer` [layers] for a model of one stack,
    `monitor/grad_norm/<first path name>/layer` for each of several (`by_stack_group`)."""
    scanned: dict[tuple, jax.Array] = {}  # a stack's [layers] sums
    unrolled: dict[tuple, dict[int, jax.Array]] = defaultdict(dict)  # a per-layer stack's sum of each layer
    for names, leaf in grads:
        found = layer_of(names)
        if found is None:
            continue
        stack, index = found
        if index is None:
            scanned[stack] = scanned.get(stack, 0.0) + _square_sums(leaf, scanned=True)
        else:
            unrolled[stack][index] = unrolled[stack].get(index, 0.0) + _square_sums(leaf, scanned=False)
    stacks = {**scanned, **{stack: jnp.stack([s[i] for i in sorted(s)]) for stack, s in unrolled.items()}}
    return {f"{PREFIX}grad_norm/{label}{LAYER}": jnp.sqrt(sums) for label, sums in by_stack_group(stacks).items()}


def by_stack_group(per_stack: dict[tuple, jax.Array], named: bool | None = None) -> dict[str, jax.Array]:
    """Vectors over each stack's layers, keyed by the stack's path, as one vector per group of stacks that share
    their first path name (a list of stacks run one after the other, as Llama's runs of full and sliding-window
    layers: joined in order), keyed by the group's label in the monitors' names: '<first path name>/' (`encoder/`,
    `decoder/`) if `named` (by default: if there are several groups), else ''."""
    order = lambda path: tuple((isinstance(name, str), name) for name in path)
    groups: dict[str, list] = defaultdict(list)
    for stack in sorted(per_stack, key=order):
        groups[str(stack[0]) if stack else "stack"].append(per_stack[stack])
    named = len(groups) > 1 if named is None else named
    joined = {group: vectors[0] if len(vectors) == 1 else jnp.concatenate(vectors) for group, vectors in groups.items()}
    return {(f"{group}/" if named else ""): vector for group, vector in joined.items()}


def with_probes(model, sums_of: Callable[[], dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """`sums_of()`, the loss sums of a forward pass of `model`, run recording (models/probes.py), with what the
    layers recorded: `probe/<label><name>` [layers] per group of stacks (`by_stack_group`). Merged across
    micro-batches as the sums are (`step.merge_sums`): a `*_max` by its max, a mean square added."""
    with probes.recording():
        sums = sums_of()
    per_name: dict[str, dict[tuple, jax.Array]] = defaultdict(dict)
    for names, value in named_leaves(nnx.pop(model, nnx.Intermediate)):
        at = next(i for i, name in enumerate(names) if name in probes.NAMES)
        per_name[names[at]][names[:at]] = value
    named = len({stack[0] if stack else None for per_stack in per_name.values() for stack in per_stack}) > 1
    for name, per_stack in per_name.items():  # (a decoder's cross-attention: named as the decoder's other values)
        sums.update({f"{PROBE}{label}{name}": vector for label, vector in by_stack_group(per_stack, named).items()})
    return sums


def probe_metrics(sums: dict[str, jax.Array], micro_steps: int) -> dict[str, jax.Array]:
    """The monitors of `with_probes`' sums: `monitor/attn_logit_max/<label>layer` (and `cross_attn_logit_max`) and
    `monitor/act_rms/<label>layer`, the RMS of each layer's output (the mean of `micro_steps` mean squares)."""
    out = {}
    for key in (k for k in sums if k.startswith(PROBE)):
        label, _, name = key.removeprefix(PROBE).rpartition("/")
        label = f"{label}/" if label else ""
        if name == probes.OUTPUT_SQUARE_MEAN:
            out[f"{PREFIX}act_rms/{label}{LAYER}"] = jnp.sqrt(sums[key] / micro_steps)
        else:
            out[f"{PREFIX}{name}/{label}{LAYER}"] = sums[key]
    return out


def group_sums(leaves: list[tuple[tuple, jax.Array]]) -> dict[str, jax.Array]:
    """Each parameter group's sum of squares."""
    sums: dict[str, jax.Array] = {}
    for names, leaf in leaves:
        group = group_of(names)
        sums[group] = sums.get(group, 0.0) + _square_sums(leaf, scanned=False)
    return sums


def monitor_metrics(grads, before: list[tuple[tuple, jax.Array]], params_after, sums: dict) -> dict[str, jax.Array]:
    """The monitors of one step (`monitor/...`): gradient norm per layer and per group, update-to-parameter RMS
    ratio per group (RMS of the applied update over RMS of the parameters `before` it, their `named_leaves`: the
    group's sizes cancel), and, of the loss `sums`, the logits' max and z-loss (mean logsumexp² over the targets)."""
    grads, after = named_leaves(grads), named_leaves(params_after)
    if [names for names, _ in before] != [names for names, _ in after]:
        raise ValueError("monitor_metrics: the parameters before and after the update differ in their paths")
    updates = [(names, new - old) for (names, old), (_, new) in zip(before, after)]
    out = layer_norms(grads)
    out.update({f"{PREFIX}grad_norm/{g}": jnp.sqrt(s) for g, s in group_sums(grads).items()})
    weights = group_sums(before)
    for group, update in group_sums(updates).items():
        out[f"{PREFIX}update_ratio/{group}"] = jnp.sqrt(update / jnp.maximum(weights[group], 1e-30))
    out[f"{PREFIX}logits_max"] = sums["logits_max"]
    out[f"{PREFIX}z_loss"] = sums["lse_square_sum"] / jnp.maximum(sums["tokens"], 1.0)
    return out


def with_monitors(metrics: dict, grads, before, params_after, micro_steps: int) -> dict[str, jax.Array]:
    """A monitor step's `metrics` (its loss sums among them) with the monitors, less the sums only they read."""
    sums = dict(metrics)
    out = {k: v for k, v in metrics.items() if k not in MONITOR_SUMS and not k.startswith(PROBE)}
    out.update(monitor_metrics(grads, before, params_after, sums))
    out.update(probe_metrics(sums, micro_steps))
    return out


def flat_record(values: dict) -> dict[str, float]:
    """Fetched monitor values as metrics.jsonl's scalars: a per-layer vector `.../layer` as `.../layer_<i>`."""
    out = {}
    for key, value in values.items():
        if key.endswith(LAYER) and getattr(value, "ndim", 0) == 1:
            out.update({f"{key}_{i}": float(v) for i, v in enumerate(value)})
        else:
            out[key] = float(value)
    return out
