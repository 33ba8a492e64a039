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


def swiglu_mlp_fused(x: jax.Array, gate_up_t: jax.Array, down_t: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`swiglu_mlp` with gate and up in one matmul, weights output-major (the decode layout).

    Both matmuls are plain 2-D `[B*T, in] x [out, in]^T` products: XLA:CPU keeps a 2-D
    output-major weight as it is, but transposes the weight of a higher-rank contraction.
    Args: x [B, T, D]; gate_up_t [2F, D], rows interleaved (W_gate^T row f at 2f, W_up^T row f
    at 2f + 1, so a tensor-parallel shard of rows holds matching gate and up units);
    down_t [D, F] = W_down^T. Returns [B, T, D] float32.
    """
    b, t, d = x.shape
    gu = einsum("md,nd->mn", x.reshape(b * t, d), gate_up_t, dtype).reshape(b * t, -1, 2)
    return einsum("mf,df->md", swiglu_gate(gu[..., 0], gu[..., 1]), down_t, dtype).reshape(b, t, d)


def swiglu_gate(g: jax.Array, u: jax.Array) -> jax.Array:
    """silu(g) * u, elementwise (Shazeer 2020, "GLU Variants Improve Transformer")."""
    return jax.nn.silu(g) * u

