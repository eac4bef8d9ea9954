"""python -m spmdlm.export: a training run's checkpoint to a transformers directory with a model card
(spmdlm.load.export_checkpoint)."""

from __future__ import annotations

import argparse
import sys

from spmdlm.errors import ArgumentError, UserError
from spmdlm.load import Weights, export_checkpoint


def parse_steps(text: str) -> tuple[int, ...]:
    """--average_steps 10,20,30 as (10, 20, 30)."""
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ArgumentError(
            f"--average_steps {text!r}: give checkpoint steps separated by commas, e.g. 10,20,30"
        ) from None
    if text and len(steps) < 2:
        raise ArgumentError(f"--average_steps {text!r}: give two steps or more (one checkpoint: --step)")
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spmdlm.export", description="Export an spmdlm checkpoint to transformers format."
    )
    parser.add_argument("--checkpoint", required=True, help="the training run's --output_dir")
    parser.add_argument("--out", required=True, help="directory to write config.json, model.safetensors, tokenizer")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--mesh", default="data=-1", help="mesh to restore on (default: all devices, data axis)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument(
        "--weights",
        choices=("raw", "ema"),
        default="raw",
        help="raw: the trained parameters (schedule-free: its average), ema: their moving average (--ema_decay)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--average_last", type=int, default=0, help="export the mean of the newest N checkpoints")
    group.add_argument("--average_steps", default="", help="export the mean of these checkpoints, e.g. 10,20,30")
    args = parser.parse_args(argv)
    try:
        weights = Weights(args.weights, args.average_last, parse_steps(args.average_steps))
        out = export_checkpoint(args.checkpoint, args.out, args.step, args.mesh, args.overwrite, weights)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0
