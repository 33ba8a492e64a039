"""SwiGLU feed-forward block."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.models.layers.linear import einsum


def swiglu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """y = (silu(x W_gate) * (x W_up)) W_down.

    Args: x [B, T, D]; gate, up [D, F]; down [F, D]. Returns [B, T, D] float32.
    """
    g = einsum("btd,df->btf", x, gate, dtype)
    u = einsum("btd,df->btf", x, up, dtype)
    return einsum("btf,fd->btd", swiglu_gate(g, u), down, dtype)


def swiglu_gate(g: jax.Array, u: jax.Array) -> jax.Array:
    """silu(g) * u, elementwise (Shazeer 2020, "GLU Variants Improve Transformer")."""
    return jax.nn.silu(g) * u

