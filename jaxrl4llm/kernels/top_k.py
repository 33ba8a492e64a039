"""Top-k of each row as one CPU kernel call (csrc/top_k.cc): `jax.lax.top_k`'s exact result.

    values, ids = the k largest entries of each row, descending; ties to the lower index

Instead of XLA:CPU's per-row sort, the kernel finds a lower bound on the k-th largest entry from
the maxima of ~4k disjoint sets of entries, then sorts only the entries above it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x [N, V] float32 -> (values [N, k] float32, indices [N, k] int32), as `jax.lax.top_k(x, k)`."""
    if x.ndim != 2:
        raise ValueError(f"top_k: expected x [N, V], got shape {x.shape}")
    n, v = x.shape
    if not 1 <= k <= v:
        raise ValueError(f"top_k: k={k} must be in [1, V={v}]")
    out = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.int32))
    return jax.ffi.ffi_call("jaxrl4llm_top_k", out)(x.astype(jnp.float32))
