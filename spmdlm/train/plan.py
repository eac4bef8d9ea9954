"""`--remat auto` and `--scan_unroll auto`: what each scanned layer keeps for its backward pass, and how far the layer
scan is unrolled, chosen from the model, the batch and the platform. An explicit flag always wins; run_config.json
records what ran and why (`layer_plan`).

The rules follow measurements (benchmarks/README.md, "Base sizes: op profiles", item 5, and "Scanned vs unrolled
layers"):
- remat: `dots` (the weight matmuls' outputs kept, the rest recomputed) was as fast as or faster than `none` at
  every size measured on CPU, and needs a fraction of its memory; `full` (only each layer's input kept) when the
  activations `dots` keeps would take more than REMAT_MEMORY_SHARE of a device's memory.
- scan_unroll: on CPU a small encoder-decoder (at most UNROLL_MAX_LAYERS layers per stack, width at most
  UNROLL_MAX_WIDTH) runs faster fully unrolled: ~0.82x the step time at d256 for T5 4+4 and 12+12 (its layers carry
  loop constants — the encoder output, T5's position bias — whose gradients the scan accumulates in every
  iteration), at a longer compile. At base width (d768) unrolling was slower for T5 12+12 (0.91x the speed) and
  BART 6+6 (0.92x), and for decoder- or encoder-only stacks of 12 layers and more at any width (GPT-2 d256: 1.34x
  the step time at 12 layers); all those stay scanned, as every model does on GPUs and TPUs (the compile time of a
  scan does not grow with depth).
"""

from __future__ import annotations

import collections
import dataclasses

from flax import nnx

from spmdlm.models.layers import Dense
from spmdlm.models.stack import LayerStack
from spmdlm.run_args.choices import parse_scan_unroll

REMAT_MEMORY_SHARE = 0.5
UNROLL_MAX_LAYERS = 12
UNROLL_MAX_WIDTH = 256


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    remat: str  # a policy of models/stack.py REMAT_POLICIES
    scan_unroll: int  # layers per scan iteration; 0 = fully unrolled
    reasons: dict[str, str]  # flag -> why auto chose it ({} when both were given)

    def record(self) -> dict:
        return {"remat": self.remat, "scan_unroll": self.scan_unroll, "auto": self.reasons}


def layer_stacks(model: nnx.Module) -> list[LayerStack]:
    return [module for _, module in nnx.iter_graph(model) if isinstance(module, LayerStack)]


def dots_bytes_per_token(model: nnx.Module, itemsize: int) -> int:
    """Bytes that `--remat dots` keeps per token for the backward pass: every weight matmul's output, in every layer
    of every stack (an upper bound for cross-attention, whose keys and values are per encoder token)."""
    features = 0
    for stack in layer_stacks(model):
        for _, module in nnx.iter_graph(stack.layers):
            if isinstance(module, Dense):
                kernel = module.kernel.get_value()
                features += stack.count * int(kernel.size // (kernel.shape[0] * kernel.shape[1]))  # out features
    return features * itemsize


def plan_layers(
    remat: str,
    scan_unroll: str,
    model: nnx.Module,
    *,
    platform: str,
    itemsize: int,
    tokens_per_device: int,
    memory_bytes: int | None,
) -> LayerPlan:
    """The plan for `model` (an abstract one will do) with `tokens_per_device` tokens per micro-batch and device,
    computing in a dtype of `itemsize` bytes on `platform`, whose devices have `memory_bytes` each (None: unknown)."""
    reasons = {}
    if remat == "auto":
        need = dots_bytes_per_token(model, itemsize) * tokens_per_device
        gib = lambda b: f"{b / 2**30:.2f} GiB"
        if memory_bytes and need > REMAT_MEMORY_SHARE * memory_bytes:
            remat = "full"
            reasons["remat"] = (
                f"full: the matmul outputs dots would keep ({gib(need)} per device) exceed "
                f"{REMAT_MEMORY_SHARE:.0%} of its memory ({gib(memory_bytes)})"
            )
        else:
            remat = "dots"
            reasons["remat"] = f"dots: the matmul outputs it keeps take {gib(need)} per device"
    layers = parse_scan_unroll(scan_unroll)
    if layers is None:
        stacks = layer_stacks(model)
        depths, width = [stack.count for stack in stacks], min((residual_width(stack) for stack in stacks), default=0)
        if platform != "cpu":
            layers, why = 1, "a GPU or TPU"
        elif len(depths) < 2:
            layers, why = 1, "a single layer stack"
        elif max(depths) > UNROLL_MAX_LAYERS or width > UNROLL_MAX_WIDTH:
            layers, why = 1, f"more than {UNROLL_MAX_LAYERS} layers per stack or wider than {UNROLL_MAX_WIDTH}"
        else:
            layers, why = 0, f"an encoder-decoder of {'+'.join(map(str, depths))} layers, width {width}, on CPU"
        reasons["scan_unroll"] = f"{layers} ({'fully unrolled' if layers == 0 else 'scanned'}): {why}"
    return LayerPlan(remat, layers, reasons)


def residual_width(stack: LayerStack) -> int:
    """The width of the stream between a stack's layers (d_model): the input width most of its weight matmuls have
    (queries, keys, values and the MLP's input do; attention and MLP outputs read other widths)."""
    widths = [
        module.kernel.get_value().shape[1] for _, module in nnx.iter_graph(stack.layers) if isinstance(module, Dense)
    ]
    return collections.Counter(widths).most_common(1)[0][0]
