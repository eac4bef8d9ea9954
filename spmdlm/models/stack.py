"""Identical layers as one: stacked parameters applied with one scan, and what each layer keeps for its backward
pass (the launcher's --remat policies over the activations' names). Used by every model's encoder/decoder stacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spmdlm.models import probes
from spmdlm.models.kv_cache import Cache

# What each layer keeps for its backward pass (the launcher's --remat), as jax.checkpoint policies over the names the
# layers give their matmul outputs (Dense's saved_as) and attention probabilities (checkpoint_name). "dots" keeps
# the weight matmuls' outputs (PROJECTIONS) and recomputes the rest from them (norms, activations, attention scores
# and probabilities): less memory than "none" and, through the layer scan, faster, because fewer saved activations
# are stacked per layer and sliced back out (benchmarks/README.md). "dots_with_attention" keeps the attention
# probabilities too (no recomputed score matmul and softmax; [batch, heads, length, length] more per layer); "qkv"
# keeps only the query, key and value projections; "full" keeps only the layer's input.
QKV = ("qkv", "query", "key", "value")  # GPT-2's fused projection, or the three
PROJECTIONS = (*QKV, "attention_out", "mlp_hidden", "mlp_out")
_keep = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {
    "none": None,
    "dots": _keep(*PROJECTIONS),
    "dots_with_attention": _keep(*PROJECTIONS, "attention_weights"),
    "qkv": _keep(*QKV),
    "full": jax.checkpoint_policies.nothing_saveable,
}
# `unroll` for layers that own their parameters (--scan_unroll per_layer): one module per layer, applied in a Python
# loop, as the HF Flax models keep them. Checkpoints hold the stacked layout either way (stack_layers/unstack_layers).
PER_LAYER = -1


class LayerStack(nnx.Module):
    """`count` identical layers with stacked parameters (leading `layers` axis), applied with one scan.

    One traced layer instead of `count`: compile time stays nearly flat with depth. `make_layer(rngs)` builds one
    layer; every call of the stack passes `x` through the layers as the scan carry, with the other arguments the
    same for each layer. `remat` names what each layer keeps for the backward pass (REMAT_POLICIES). Dropout gets
    one key per layer. `unroll` is jax.lax.scan's (True = fully unrolled, same parameters), or PER_LAYER.
    """

    def __init__(
        self,
        make_layer: Callable[[nnx.Rngs], nnx.Module],
        count: int,
        *,
        rngs: nnx.Rngs,
        remat: str = "dots",
        unroll: int | bool = 1,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        self.count, self.remat, self.unroll = count, remat, unroll

        # The layers axis is never sharded (PARTITION_NAME None); the logical name is added for the rule table.
        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create(rngs):
            return make_layer(rngs)

        layers = create(rngs)
        self.per_layer = unroll == PER_LAYER
        if self.per_layer:  # each layer owns its parameters: slices of the stacked ones (the same initialisation)
            self.layers = nnx.List(unstack(layers, count))
            return
        self.layers = layers
        for _, var in nnx.iter_graph(self.layers):
            if isinstance(var, nnx.Param):
                var.set_metadata(logical_axes=("layers", *var.get_metadata()["logical_axes"]))

    def __call__(self, x: jax.Array, *args, rngs: nnx.Rngs | None = None) -> jax.Array:
        """x through the layers. In the monitor variant's forward pass (`probes.active()`), the stack also sows what
        its layers recorded (models/probes.py): `nnx.Intermediate`s named by probes.NAMES, [layers] each."""
        keys = None if rngs is None else jax.random.split(rngs.dropout(), self.count)

        def apply(layer, x, key):
            return layer(x, *args, rngs=None if key is None else nnx.Rngs(dropout=key))

        if not probes.active():
            return self._through_layers(apply, x, keys)
        recorded = probes.LayerRecords(apply)
        x, values = self._through_layers(recorded, x, keys, side_outputs=True)
        for name, value in recorded.per_layer(values).items():
            self.sow(nnx.Intermediate, name, value)
        return x

    def _through_layers(self, apply: Callable, x: jax.Array, keys, side_outputs: bool = False):
        """`apply(layer, x, key)` layer after layer, each rematerialised by the stack's policy; with `side_outputs`
        apply returns (x, values) and this (x, values stacked over the layers)."""
        if self.remat != "none":
            apply = nnx.remat(apply, policy=REMAT_POLICIES[self.remat])

        if self.per_layer:
            outputs = []
            for i, layer in enumerate(self.layers):
                out = apply(layer, x, None if keys is None else keys[i])
                x = out[0] if side_outputs else out
                outputs.append(out[1] if side_outputs else None)
            return (x, jax.tree.map(lambda *v: jnp.stack(v), *outputs)) if side_outputs else x

        @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0) if side_outputs else nnx.Carry, unroll=self.unroll)
        def body(layer, x, key):
            return apply(layer, x, key)

        return body(self.layers, x, keys)

    def scan_with_cache(self, x: jax.Array, cache: Cache, *args, first_layer: int = 0) -> tuple[jax.Array, Cache]:
        """Generation's pass over the layers (no dropout): as __call__, with each layer also given `cache=` the
        cache, `layer` set to its index (counted from `first_layer`: a model of several stacks shares one cache), and
        its slice of the cross-attention keys and values; it writes x's keys and values into the cache. Returns x and
        the cache with its index moved past x's tokens.

        The self-attention cache is part of the scan's carry, not a scanned input: XLA then updates it in place,
        where scanning slices in and out copied the whole cache every step.
        """

        def body(layer, carry, i, cross):
            x, cache = carry
            mine = dataclasses.replace(cache, layer=i, cross_key=cross[0], cross_value=cross[1])
            x = layer(x, *args, cache=mine)
            return x, dataclasses.replace(mine, layer=None, cross_key=None, cross_value=None)

        carried = dataclasses.replace(cache, cross_key=None, cross_value=None)
        cross = (cache.cross_key, cache.cross_value)
        if self.per_layer:
            for i, layer in enumerate(self.layers):
                index = jnp.int32(first_layer + i)
                x, carried = body(layer, (x, carried), index, jax.tree.map(lambda a, i=i: a[i], cross))
        else:
            scanned = nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=nnx.Carry, unroll=self.unroll)(body)
            x, carried = scanned(self.layers, (x, carried), first_layer + jnp.arange(self.count), cross)
        return x, dataclasses.replace(
            carried, cross_key=cache.cross_key, cross_value=cache.cross_value, index=cache.index + x.shape[1]
        )

    def map(self, fn: Callable[[nnx.Module], tuple[jax.Array, ...]]) -> tuple[jax.Array, ...]:
        """`fn(layer)` for every layer, stacked on a leading layers axis (e.g. cross-attention keys and values)."""
        if self.per_layer:
            return jax.tree.map(lambda *xs: jnp.stack(xs), *[fn(layer) for layer in self.layers])

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        def body(layer, carry):
            return carry, fn(layer)

        return body(self.layers, None)[1]


def _remade(variable: nnx.Variable, value, spec: Callable[[tuple], tuple]) -> nnx.Variable:
    """A variable like `variable` holding `value`, its out_sharding mapped by `spec` (a layers axis added or dropped).
    The sharding is set after: given to the constructor, it would place the value, which needs a mesh."""
    metadata = variable.get_metadata()
    sharding = metadata.pop("out_sharding", None)
    remade = type(variable)(value, **metadata)
    if sharding is not None:
        remade.set_metadata(out_sharding=spec(sharding))
    return remade


def unstack(stacked: nnx.Module, count: int) -> list[nnx.Module]:
    """The `count` layers of a stacked module (leading layers axis), each owning its slice of the parameters."""
    graphdef, state = nnx.split(stacked)

    def take(variable: nnx.Variable, i: int) -> nnx.Variable:
        return _remade(variable, variable.get_value()[i], lambda spec: tuple(spec[1:]))

    is_variable = lambda x: isinstance(x, nnx.Variable)
    return [nnx.merge(graphdef, jax.tree.map(lambda v: take(v, i), state, is_leaf=is_variable)) for i in range(count)]


# -- one checkpoint format: a per-layer stack's layers ({"layers": {0: ..., 1: ...}} in a state's pure dict) are
# saved stacked, as the scanned stack holds them, and split again on restore.
def _per_layer(node) -> bool:
    return isinstance(node, dict) and bool(node) and all(isinstance(k, int) for k in node)


def _stack_leaves(*leaves):
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):  # a restore target
        sharding = first.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def stack_layers(tree):
    """A state's pure dict (arrays or their shapes) in the stacked layout: every per-layer stack's layers joined."""
    if not isinstance(tree, dict):
        return tree
    return {
        key: jax.tree.map(_stack_leaves, *value.values())
        if key == "layers" and _per_layer(value)
        else stack_layers(value)
        for key, value in tree.items()
    }


def unstack_layers(tree, like):
    """`tree` (stacked layout, as stack_layers gives) in the layout of the pure dict `like`, each layer's arrays
    placed with `like`'s shardings."""
    if not isinstance(like, dict):
        return tree
    out = {}
    for key, target in like.items():
        value = tree[key]
        if key == "layers" and _per_layer(target) and not _per_layer(value):
            value = {
                i: jax.tree.map(lambda x, t, i=i: jax.device_put(x[i], t.sharding), value, layer)
                for i, layer in target.items()
            }
        out[key] = unstack_layers(value, target)
    return out


def restack(model: nnx.Module) -> nnx.Module:
    """`model` with every per-layer stack turned back into stacked parameters, in place: the layout the export
    tables and the Hub name (the end-of-training export reads the live model)."""
    for stack in [node for _, node in nnx.iter_graph(model) if isinstance(node, LayerStack) and node.per_layer]:
        graphdef = nnx.graphdef(stack.layers[0])

        def join(*variables: nnx.Variable) -> nnx.Variable:
            stacked = jnp.stack([v.get_value() for v in variables])
            joined = _remade(variables[0], stacked, lambda spec: (None, *spec))
            if isinstance(joined, nnx.Param):
                joined.set_metadata(logical_axes=("layers", *joined.get_metadata()["logical_axes"]))
            return joined

        states = [nnx.state(layer) for layer in stack.layers]
        stack.layers = nnx.merge(graphdef, jax.tree.map(join, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))
        stack.per_layer, stack.unroll = False, True  # callable again: fully unrolled over the stacked arrays
    return model
