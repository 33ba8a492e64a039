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
    return _gated_down(g, u, down, dtype)


def swiglu_mlp_fused(x: jax.Array, gate_up: jax.Array, down: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`swiglu_mlp` with gate and up in one matmul: gate_up = stack([W_gate, W_up], axis=1).

    Args: x [B, T, D]; gate_up [D, 2, F]; down [F, D]. Returns [B, T, D] float32.
    """
    gu = einsum("btd,dcf->btcf", x, gate_up, dtype)
    return _gated_down(gu[:, :, 0], gu[:, :, 1], down, dtype)


def _gated_down(g: jax.Array, u: jax.Array, down: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """(silu(g) * u) W_down. g, u [B, T, F] float32; down [F, D]. Returns [B, T, D] float32."""
    return einsum("btf,fd->btd", jax.nn.silu(g) * u, down, dtype)
