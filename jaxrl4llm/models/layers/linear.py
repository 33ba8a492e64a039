"""Mixed-precision contraction: the one place where matmul precision is decided."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """y = einsum(spec, x.astype(dtype), w.astype(dtype)) accumulated and returned in float32.

    With dtype=bfloat16 this is bf16 x bf16 -> f32 (the fast path on CPU/TPU/GPU); with
    dtype=float32 it is a plain float32 contraction (used for parity with transformers).
    """
    return jnp.einsum(
        spec,
        x.astype(dtype),
        w.astype(dtype),
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None,
    )
