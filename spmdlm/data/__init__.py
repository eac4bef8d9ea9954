"""Data: corpus readers, tokenizers, pure-numpy objectives and the Grain pipeline."""
