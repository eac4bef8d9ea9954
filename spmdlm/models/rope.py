"""Rotary position embeddings (RoPE) on queries and keys, as transformers computes them (`rope_theta`, and the
`rope_scaling` / `rope_parameters` of type `default` or `llama3`).

A `Rope` is static (hashable): it is part of an attention layer's definition. Positions are given per token, so
packed documents restart at 0 (`attention.segment_positions`) and generation counts a row's real tokens
(`kv_cache.Cache.advance`). The inverse frequencies are computed in float32 as transformers does, and the
rotation is transformers' `rotate_half` form: the two halves of each head, not interleaved pairs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE over the whole head (`head_dim`) with base `theta`; `llama3` rescales the low frequencies (Llama 3.1+)."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def inverse_frequencies(self) -> np.ndarray:
        """[head_dim / 2] float32, as transformers' `_compute_default_rope_parameters` and
        `_compute_llama3_parameters` compute them."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        inv_freq = np.float32(1.0) / (np.float32(self.theta) ** exponents)
        if self.rope_type == "default":
            return inv_freq
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(self.factor), inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, heads, head_dim] rotated by each token's position (`positions` [B|1, T])."""
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inverse_frequencies())
        angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # over the heads
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        half = self.head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin


def rope_from_hf(values: dict[str, Any], head_dim: int, layer_type: str | None = None) -> Rope:
    """The `Rope` of an HF config's values: `rope_theta` with `rope_scaling` (released checkpoints), or transformers
    5's `rope_parameters` (which save_pretrained writes), flat or by layer type (ModernBERT's `full_attention` /
    `sliding_attention`; `layer_type` picks one). Raises ValueError for a type or key we do not reproduce."""
    parameters = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = dict(parameters[layer_type])
    theta = parameters.get("rope_theta", values.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return Rope(head_dim, float(theta))
    return Rope(
        head_dim,
        float(theta),
        rope_type,
        float(parameters["factor"]),
        float(parameters["low_freq_factor"]),
        float(parameters["high_freq_factor"]),
        int(parameters.get("original_max_position_embeddings", values.get("max_position_embeddings", 8192))),
    )
