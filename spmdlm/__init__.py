"""spmdlm: pretrain RoBERTa, GPT-2, T5 v1.1 and BART with JAX on a device mesh."""

__version__ = "0.2.0"
