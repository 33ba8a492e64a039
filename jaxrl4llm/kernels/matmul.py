"""Decode-sized matmul as one CPU kernel call (csrc/matmul.cc): y = x W^T, bf16 in, float32 out.

    y[m, n] = sum_k x[m, k] W[n, k]

The weight is packed once (`pack_weight`, per rollout) into panels of 32 output units with
the pairs of k side by side, [N/32, K/2, 32, 2], which AVX512-BF16 dot products read
contiguously. Available when `native.bf16_pairs()`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PANEL = 32


def packable(w: jax.Array) -> bool:
    """The kernel takes an output-major weight [N, K] with N a multiple of 32 and K even."""
    return w.ndim == 2 and w.shape[0] % PANEL == 0 and w.shape[1] % 2 == 0


def pack_weight(w: jax.Array) -> jax.Array:
    """Output-major W [N, K] -> bf16 panels [N/32, K/2, 32, 2] (see module docstring)."""
    if not packable(w):
        raise ValueError(f"pack_weight: need W [N, K] with N % {PANEL} == 0 and K even, got shape {w.shape}")
    n, k = w.shape
    return w.astype(jnp.bfloat16).reshape(n // PANEL, PANEL, k // 2, 2).transpose(0, 2, 1, 3)


def matmul(x: jax.Array, packed: jax.Array) -> jax.Array:
    """x [M, K] (rounded to bf16) times a packed weight -> y [M, N] float32, N = 32 * packed.shape[0]."""
    if x.ndim != 2 or packed.ndim != 4 or packed.shape[1] * 2 != x.shape[1]:
        raise ValueError(f"matmul: x {x.shape} does not match the packed weight {packed.shape} (x [M, K], "
                         f"packed [N/32, K/2, 32, 2])")
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call("jaxrl4llm_matmul", out)(x.astype(jnp.bfloat16), packed)
