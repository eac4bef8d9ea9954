"""Native Flax NNX models with transformers' attribute names (one file each) and the layers they share.

Models know no data pipeline and no training code; `spmdlm.families` ties each model to its objective, tokenizer,
transformers table and presets.
"""
