"""python -m spmdlm.export: a training run's checkpoint to a transformers directory with a model card
(spmdlm.load.export_checkpoint)."""

from __future__ import annotations

import sys

import jax

from spmdlm.cli import Parser, remember
from spmdlm.errors import ArgumentError, UserError
from spmdlm.load import Weights, export_checkpoint
from spmdlm.train.safety.guard import ExportLock


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
    repeated = sorted({step for step in steps if steps.count(step) > 1})
    if repeated:
        raise ArgumentError(
            f"--average_steps {text!r} names step {repeated[0]} more than once (a mean of "
            f"{len(set(steps))} checkpoint{'s' if len(set(steps)) > 1 else ''}, not {len(steps)}); give each step once"
            + (" (one checkpoint: --step)" if len(set(steps)) < 2 else "")
        )
    return steps


def parse_last(value: int | None) -> int:
    """--average_last N: given, at least 1 (0 would export the plain newest checkpoint under an average's name)."""
    if value is not None and value < 1:
        raise ArgumentError(
            f"--average_last {value}: give a number of checkpoints to average, 1 or more (e.g. 3), or leave it out "
            "for the newest checkpoint alone"
        )
    return value or 0


def build_parser() -> Parser:
    parser = Parser(
        prog="python -m spmdlm.export",
        allow_abbrev=False,
        description="Export an spmdlm checkpoint to transformers format.",
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
    group.add_argument("--average_last", type=int, default=None, help="export the mean of the newest N checkpoints")
    group.add_argument("--average_steps", default="", help="export the mean of these checkpoints, e.g. 10,20,30")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        remember(parser)  # python -m's quick answer (spmdlm/cli/__init__.py)
        args = parser.parse_args(argv)
        weights = Weights(args.weights, parse_last(args.average_last), parse_steps(args.average_steps))
        # one export at a time into --out (OUT.export.lock beside it): a second refuses, naming the first
        with ExportLock(args.out, enabled=jax.process_index() == 0):
            out = export_checkpoint(args.checkpoint, args.out, args.step, args.mesh, args.overwrite, weights)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0
