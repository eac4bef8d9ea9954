"""Generation from spmdlm models: `generate` text (GPT-2, T5, BART) with a KV cache under jit, and `fill_mask`
(RoBERTa). The command line is `python -m spmdlm.generate` (spmdlm/cli/generate.py); see docs/generation.md."""

from spmdlm.generation.decoding import GenerateError, Request, fill_mask, generate, generate_ids
from spmdlm.generation.sampling import Sampling

__all__ = ["GenerateError", "Request", "Sampling", "fill_mask", "generate", "generate_ids"]
