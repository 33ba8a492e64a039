"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * scale, computed in float32.

    Args: x [..., D] (any float dtype), scale [D]. Returns [..., D] float32.
    """
    x = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * scale.astype(jnp.float32)
