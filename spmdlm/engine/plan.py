"""`--remat auto` and `--scan_unroll auto`: what each scanned layer keeps for its backward pass, and how far the layer
scan is unrolled, chosen from the model, the batch and the platform. An explicit flag always wins; run_config.json
records what ran and why (`layer_plan`).

The rules follow measurements (benchmarks/README.md, "Base sizes: op profiles", item 5, and "Scanned vs unrolled
layers"):
- the HF program on CPU: layers that own their parameters, applied one after another, keeping every activation
  (`--scan_unroll per_layer --remat none`, the program the HF Flax scripts compile) was the fastest step measured
  for T5 v1.1 (gated MLP) at the tiny and the base size (1.14x and 1.24x the scanned step; 1.06-1.13x HF Flax at
  base), and for RoBERTa and BART at width 256 (1.11x, 1.05x), on a quiet 2-core host ("The CPU step against
  nanoGPT and the HF Flax script"). It lost for GPT-2 (fused query/key/value: 0.91x at both sizes) and for RoBERTa
  and BART at width 768 (0.98x, 0.85x), which keep the rules below. Taken when both flags are auto, the stacks are
  at most UNROLL_MAX_LAYERS deep and what `none` keeps (NONE_BYTES_FACTOR x what `dots` keeps, a generous bound)
  fits in REMAT_MEMORY_SHARE of a device's memory.
- remat: `dots` (the weight matmuls' outputs kept, the rest recomputed) was as fast as or faster than `none` at
  every size measured on CPU under the layer scan, and needs a fraction of its memory; `full` (only each layer's
  input kept) when the activations `dots` keeps would take more than REMAT_MEMORY_SHARE of a device's memory.
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

from spmdlm.models.attention import Attention
from spmdlm.models.layers import MLP, Dense
from spmdlm.models.seq2seq import EncoderDecoder
from spmdlm.models.stack import PER_LAYER, LayerStack
from spmdlm.run_args.choices import parse_scan_unroll

REMAT_MEMORY_SHARE = 0.5
UNROLL_MAX_LAYERS = 12
UNROLL_MAX_WIDTH = 256
NONE_BYTES_FACTOR = 4  # what --remat none keeps per token, over what dots keeps: norms, activations, probabilities


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
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    if platform == "cpu" and scan_unroll == "auto" and remat in ("auto", "none"):
        need = NONE_BYTES_FACTOR * dots_bytes_per_token(model, itemsize) * tokens_per_device
        why = hf_program_wins(model)
        if why and (remat == "none" or not memory_bytes or need <= REMAT_MEMORY_SHARE * memory_bytes):
            reasons["scan_unroll"] = f"per_layer (each layer its own arrays, unrolled): {why} on CPU"
            if remat == "auto":
                reasons["remat"] = f"none (the HF program): {why} on CPU, keeping at most {gib(need)} per device"
            return LayerPlan("none", PER_LAYER, reasons)
    if remat == "auto":
        need = dots_bytes_per_token(model, itemsize) * tokens_per_device
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
        elif not isinstance(model, EncoderDecoder):  # measured for encoder-decoders (module docstring)
            layers, why = (
                1,
                "one decoder or encoder (its stacks scanned)" if len(depths) > 1 else "a single layer stack",
            )
        elif max(depths) > UNROLL_MAX_LAYERS or width > UNROLL_MAX_WIDTH:
            layers, why = 1, f"more than {UNROLL_MAX_LAYERS} layers per stack or wider than {UNROLL_MAX_WIDTH}"
        else:
            layers, why = 0, f"an encoder-decoder of {'+'.join(map(str, depths))} layers, width {width}, on CPU"
        reasons["scan_unroll"] = f"{layers} ({'fully unrolled' if layers == 0 else 'scanned'}): {why}"
    return LayerPlan(remat, layers, reasons)


def hf_program_wins(model: nnx.Module) -> str | None:
    """Why the HF program (per-layer arrays, nothing recomputed) is the faster CPU step for `model`, or None where the
    scanned step measured faster (the module docstring's figures)."""
    stacks = layer_stacks(model)
    if not stacks or max(stack.count for stack in stacks) > UNROLL_MAX_LAYERS:
        return None
    modules = [module for stack in stacks for _, module in nnx.iter_graph(stack.layers)]
    if any(isinstance(module, Attention) and module.qkv is not None for module in modules):
        return None  # GPT-2's fused query/key/value
    if any(isinstance(module, MLP) and module.wi is None for module in modules):
        return "a gated MLP"
    width = min(residual_width(stack) for stack in stacks)
    return f"width {width} (at most {UNROLL_MAX_WIDTH})" if width <= UNROLL_MAX_WIDTH else None


def residual_width(stack: LayerStack) -> int:
    """The width of the stream between a stack's layers (d_model): the input width most of its weight matmuls have
    (queries, keys, values and the MLP's input do; attention and MLP outputs read other widths)."""
    widths = [
        module.kernel.get_value().shape[1] for _, module in nnx.iter_graph(stack.layers) if isinstance(module, Dense)
    ]
    return collections.Counter(widths).most_common(1)[0][0]
