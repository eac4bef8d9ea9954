"""Generation from spmdlm models: `generate` text (the causal and encoder-decoder families) with a KV cache under
jit, and `fill_mask` (the masked LMs, with their tokenizer's `mask_token`). The command line is
`python -m spmdlm.generate` (spmdlm/cli/generate.py); see docs/generation.md."""

from spmdlm.generation.decoding import GenerateError, Request, fill_mask, generate, generate_ids, mask_token
from spmdlm.generation.sampling import Sampling

__all__ = ["GenerateError", "Request", "Sampling", "fill_mask", "generate", "generate_ids", "mask_token"]
