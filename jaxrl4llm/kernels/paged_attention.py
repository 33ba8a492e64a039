"""Paged decode attention as one CPU kernel call per layer (csrc/paged_attention.cc).

    pool[d, page[d, s], offset[d, s]] = (k_new[d, s], v_new[d, s])              in place
    out[d, s, k, h] = softmax_j(q[d, s, k, h] . K[j] / sqrt(Dh)) V[j]           j < kv_len[d, s]

Token j of slot s is at pool[d, table[d, s, j // page], j % page]: the kernel reads a slot's live
pages in place through its page table, where `paged_cache.paged_attention` (XLA) gathers them
into a copy chunk by chunk, and writes the new token into the pool it returns (aliased to its
operand), where XLA:CPU's scatter copies the whole pool. Same rounding as the XLA path: with a
16-bit pool the query and the normalised probabilities are rounded to bfloat16 before their
products, which accumulate in float32. Idle slots (kv_len 0) get 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention(q: jax.Array, pool: jax.Array, k_new: jax.Array, v_new: jax.Array, write_page: jax.Array,
                    write_offset: jax.Array, table: jax.Array, kv_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write one token per slot, then attend over each slot's live pages (CPU only; `kernels.load_kernels`).

    Args:
      q [D, S, KVH, H/KVH, Dh] float32.
      pool [D, pages, page, 2 KVH, Dh] bfloat16, its uint16 bits, or float32 (`paged_cache.write_tokens`'s layout).
      k_new, v_new [D, S, KVH, Dh]: the fed tokens' keys and values (cast to the pool's values).
      write_page, write_offset [D, S] int32: where they go (the trash page for idle slots).
      table [D, S, W] int32: each slot's logical pages; kv_len [D, S] int32: its tokens, the new one included.
    Returns: (out [D, S, KVH, H/KVH, Dh] float32, the pool with the new tokens).
    """
    d, s, kvh, hg, dh = q.shape
    if pool.ndim != 5 or pool.shape[0] != d or pool.shape[3:] != (2 * kvh, dh):
        raise ValueError(f"paged_attention: pool {pool.shape} does not match q {q.shape} ([D, pages, page, 2 KVH, Dh])")
    if pool.dtype not in (jnp.bfloat16, jnp.uint16, jnp.float32):
        raise ValueError(f"paged_attention: pool dtype {pool.dtype}: bfloat16 (or its uint16 bits) or float32")
    values = jnp.bfloat16 if pool.dtype == jnp.uint16 else pool.dtype
    new = [x.reshape(d, s, kvh, dh).astype(values) for x in (k_new, v_new)]
    if pool.dtype == jnp.uint16:
        new = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in new]
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    out_types = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype))
    return jax.ffi.ffi_call("jaxrl4llm_paged_attention", out_types, input_output_aliases={1: 1})(
        q.astype(jnp.float32), pool, *new, i32(write_page), i32(write_offset), i32(table), i32(kv_len))
