"""Rotary position embedding (RoPE) with the Hugging Face "rotate half" layout.

Supports rope_type "default", "linear" (positions / factor) and "llama3" (Llama 3.1
frequency-dependent scaling).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.kernels import exact as exact_numerics
from jaxrl4llm.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """inv_freq[i] = theta^(-2i / Dh), i < Dh/2, then the config's rope scaling. [Dh/2] float32."""
    dim = config.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
    scaling = config.rope_scaling_dict()
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of angle = position * inv_freq, duplicated to the full head dim (in C++ under
    `config.numerics=exact`, `kernels.exact.rope_tables`).

    Args: positions [B, T] int32. Returns (cos, sin), each [B, T, Dh] float32.
    """
    if config.numerics == "exact":
        return exact_numerics.rope_tables(positions, inverse_frequencies(config))
    inv_freq = jnp.asarray(inverse_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, exact: bool = False) -> jax.Array:
    """x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a].

    Args: x [B, T, N, Dh] float32; cos, sin [B, T, Dh]; exact: in C++, both products rounded before
    the sum (`model.numerics=exact`, `kernels.exact.apply_rope`: XLA:CPU contracts a * b + c into one
    fma where both sit in one fusion, and its fusions differ between the sampler's programs and the
    trainer's). Returns [B, T, N, Dh] float32.
    """
    if exact:
        return exact_numerics.apply_rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
