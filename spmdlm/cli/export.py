"""python -m spmdlm.export: a training run's checkpoint to a transformers directory with a model card
(spmdlm.load.export_checkpoint)."""

from __future__ import annotations

import argparse
import sys

from spmdlm.errors import UserError
from spmdlm.load import export_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spmdlm.export", description="Export an spmdlm checkpoint to transformers format."
    )
    parser.add_argument("--checkpoint", required=True, help="the training run's --output_dir")
    parser.add_argument("--out", required=True, help="directory to write config.json, model.safetensors, tokenizer")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--mesh", default="data=-1", help="mesh to restore on (default: all devices, data axis)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.step, args.mesh, args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0
