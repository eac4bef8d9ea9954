"""`python -m spmdlm.generate`: continue prompts (the causal and encoder-decoder families) or fill masks (the masked
LMs, each with its tokenizer's mask token: RoBERTa's <mask>, ModernBERT's [MASK]) from a training run's checkpoint or
a transformers export. Prints only the continuations, or JSON lines with --json. Errors are one line
on stderr and exit 2.

    python -m spmdlm.generate --checkpoint OUTPUT_DIR [--step N] --prompt "Once upon a time" [--max_new_tokens 64]
        [--temperature 0.8 --top_k 200 --top_p 0.95 --num_samples 3 --seed 0] [--mesh tensor=2] [--json]
    python -m spmdlm.generate --model_name_or_path HF_DIR --prompt "The capital of France is <mask>." --fill_mask
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp

from spmdlm import checkpoint as ckpt
from spmdlm import load, storage
from spmdlm.cli import Parser, remember
from spmdlm.data.tokenization import TOKENIZER_LAYOUTS, TokenizerError, load_tokenizer, tokenizer_layout
from spmdlm.errors import ArgumentError
from spmdlm.families import families
from spmdlm.families.base import Generation
from spmdlm.generation.decoding import GenerateError, continuation_text, fill_mask, generate_ids, mask_token
from spmdlm.hf_export import ExportError, load_hf
from spmdlm.mesh import MeshError, make_mesh, requested_device_count, simulate_cpu_devices
from spmdlm.models.attention import CHOICES as ATTENTION_CHOICES
from spmdlm.models.attention import resolve_attention, set_attention
from spmdlm.models.hf_config import ConfigError


def parser() -> Parser:
    masks = ", ".join(
        f"{name}: {family.tokenizer.specials.get('mask')}"
        for name, family in families().items()
        if family.generation is Generation.FILL_MASK
    )
    p = Parser(
        prog="python -m spmdlm.generate",
        allow_abbrev=False,
        description="Generate text from an spmdlm checkpoint or a transformers export.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a training run's --output_dir (its newest good checkpoint)")
    source.add_argument("--model_name_or_path", help="a transformers directory (e.g. OUTPUT_DIR/hf)")
    p.add_argument("--step", type=int, default=None, help="with --checkpoint: this step instead of the newest")
    p.add_argument("--prompt", action="append", default=[], help="text to continue; repeat for a batch")
    p.add_argument("--prompt_file", help="a file of prompts, one per non-empty line")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument(
        "--top_k",
        type=int,
        default=0,
        help="keep the k most likely tokens (0: all); with --fill_mask, the candidates shown (default 5)",
    )
    p.add_argument("--top_p", type=float, default=1.0, help="keep the most likely tokens up to this mass (1: all)")
    p.add_argument("--num_samples", type=int, default=1, help="continuations per prompt (needs --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same samples")
    p.add_argument("--mesh", default="data=-1", help="device mesh, as in training (e.g. tensor=2 shards the heads)")
    p.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_CHOICES,
        help="attention's core, as in training (auto: the platform's kernel where it applies); the "
        "steps through the generation cache always use the xla einsums",
    )
    p.add_argument(
        "--with_prompt",
        action="store_true",
        help="print each prompt before its continuation (encoder-decoders: on its own line)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    p.add_argument(
        "--fill_mask",
        action="store_true",
        help=f"masked LMs: the top tokens of each mask token of the prompt, the tokenizer's own ({masks})",
    )
    return p


def check(args) -> None:
    if args.step is not None and not args.checkpoint:
        raise GenerateError("--step applies to --checkpoint, not to --model_name_or_path")
    if args.fill_mask:
        changed = [
            f"--{k}"
            for k in ("max_new_tokens", "temperature", "top_p", "num_samples", "seed")
            if getattr(args, k) != parser().get_default(k)
        ]
        if changed:
            raise GenerateError(f"{', '.join(changed)} do not apply to --fill_mask")
    elif args.num_samples > 1 and args.temperature == 0:
        raise GenerateError(
            f"--num_samples {args.num_samples} with --temperature 0 repeats one greedy continuation; "
            "set --temperature > 0 to sample"
        )


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            prompts += [line for line in storage.path(args.prompt_file).read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"--prompt_file {args.prompt_file}: cannot read it ({e})") from None
    if not prompts:
        raise GenerateError("no prompt: give --prompt TEXT or a --prompt_file with text")
    if args.fill_mask and len(prompts) > 1:
        raise GenerateError("--fill_mask takes one text")
    return prompts


def load_run(run_dir: str | Path, step: int | None, mesh):
    """(model, config, tokenizer) of a training run's checkpoint: the newest that verifies, or `step`."""
    model, config, tokenizer_dir, _ = load.load_run(
        run_dir,
        step,
        mesh,
        hint="pass the --output_dir of a training run, or --model_name_or_path for a transformers directory",
    )
    return model, config, load_tokenizer(tokenizer_dir or run_dir)


def load_export(path: str | Path, mesh):
    folder = storage.path(path, "--model_name_or_path")
    if not folder.is_dir():
        raise ConfigError(f"--model_name_or_path {path}: no such directory")
    if not tokenizer_layout(folder):  # before the weights load; every layout transformers writes
        layouts = " or ".join(" + ".join(layout) for layout in TOKENIZER_LAYOUTS)
        raise GenerateError(
            f"--model_name_or_path {path} has no tokenizer ({layouts}): copy the tokenizer the model was trained "
            "with into it (a run's is OUTPUT_DIR/tokenizer.json)"
        )
    tokenizer = load_tokenizer(folder)
    model, config = load_hf(folder, mesh=mesh)
    return model, config, tokenizer


def run(args) -> tuple[list[dict], object]:
    """(one record per continuation or per <mask>, the model config)"""
    check(args)
    prompts = read_prompts(args)
    mesh = make_mesh(args.mesh)
    model, config, tokenizer = (
        load_run(args.checkpoint, args.step, mesh) if args.checkpoint else load_export(args.model_name_or_path, mesh)
    )
    try:
        chosen, _ = resolve_attention(
            model, args.attention, platform=mesh.devices.flat[0].platform, dtype=jnp.float32, training=False
        )  # loaded models compute in float32
    except ValueError as e:
        raise GenerateError(f"--attention {args.attention}: {e}") from None
    set_attention(model, chosen)
    if args.fill_mask:
        candidates = fill_mask(model, config, tokenizer, prompts[0], top_k=args.top_k or 5)
        return [
            {
                "text": prompts[0],
                "mask": i,
                "candidates": [{"token": t, "id": token_id, "probability": p} for t, token_id, p in found],
            }
            for i, found in enumerate(candidates)
        ], config
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_samples=args.num_samples,
    )
    rows = generate_ids(model, config, tokenizer, prompts, **kwargs)
    samples = [(prompt, i) for prompt in prompts for i in range(args.num_samples)]
    return [
        {
            "prompt": prompt,
            "sample": i,
            "continuation": continuation_text(config, tokenizer, row),
            "new_tokens": len(row),
            "stopped_at_eos": row[-1] == config.eos_token_id,
        }
        for (prompt, i), row in zip(samples, rows)
    ], config


def show(args, records: list[dict], joiner: str, mask: str | None = None) -> None:
    """The records on stdout: JSON lines, each mask's candidates (labelled with `mask`, the tokenizer's mask token),
    or the continuations."""
    if args.json:
        for record in records:
            print(json.dumps(record, ensure_ascii=False))
    elif args.fill_mask:
        for record in records:
            print(f"{mask} {record['mask'] + 1}:")
            for c in record["candidates"]:
                print(f"  {c['probability']:.4f}  {c['token']!r}")
    else:
        for n, record in enumerate(records):
            if n:
                print("---")
            print(record["prompt"] + joiner + record["continuation"] if args.with_prompt else record["continuation"])


def main(argv: list[str] | None = None) -> int:
    try:
        given = parser()
        remember(given)  # python -m's quick answer (spmdlm/cli/__init__.py)
        args = given.parse_args(argv)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wanted = requested_device_count(args.mesh)
    if wanted and wanted > 1:  # on CPU, JAX has one device unless asked before it starts (as the launcher does)
        simulate_cpu_devices(wanted)
    try:
        records, config = run(args)
    except (
        GenerateError,
        ckpt.CheckpointError,
        ConfigError,
        ExportError,
        MeshError,
        TokenizerError,
        storage.StorageError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    show(args, records, joiner="\n" if config.is_encoder_decoder else "", mask=mask_token(config))
    return 0
