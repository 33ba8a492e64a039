"""Decode attention as one CPU kernel call per layer (csrc/decode_attention.cc).

    out[n, h] = softmax_s(q[n, h] . K[s] / sqrt(Dh)) V[s]   over the real prompt slots of row n's
                prompt, its sealed generated blocks, and slots 0..slot of the block being filled

Same operands, layouts and result as `models.decode.xla_decode_attention` (the XLA formulation):
with a bfloat16 cache the query and the probabilities are rounded to bfloat16 before their
products, which accumulate in float32, as in the XLA path's mixed-precision einsums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def supports(cache_dtype, compute_dtype) -> bool:
    """The kernel handles a bfloat16 or float32 cache read in its own precision."""
    cache_dtype, compute_dtype = jnp.dtype(cache_dtype), jnp.dtype(compute_dtype)
    return cache_dtype == compute_dtype and cache_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def decode_attention(q: jax.Array, prompt_k: jax.Array, prompt_v: jax.Array, prompt_mask: jax.Array,
                     done_k: list, done_v: list, cur_k: jax.Array, cur_v: jax.Array, slot) -> jax.Array:
    """One query per row against its prompt KV and generated KV (CPU only; see `kernels.load_kernels`).

    Args: q [N, H, Dh] float32 (N = P*G, the G rows of a prompt adjacent); prompt_k [P, KVH, Dh, T];
    prompt_v [P, KVH, T, Dh]; prompt_mask [P, T] (nonzero = real); done_k/v: sealed blocks, keys
    [N, KVH, Dh, blk], values [N, KVH, blk, Dh]; cur_k/v [N, KVH, blk, Dh], visible up to `slot`
    (int32 scalar). All caches share one dtype (bfloat16 or float32).
    Or, bf16 only and when `native.bf16_pairs()`: prompt and sealed operands in the pair layout
    (`sampling.decode_backends.pair_keys` / `pair_values`: prompt_k [P, KVH, Dh/2, T, 2], prompt_v
    [P, KVH, T/2, Dh, 2], sealed [N, KVH, Dh/2, blk, 2] / [N, KVH, blk/2, Dh, 2]), which the
    kernel multiplies with AVX512-BF16 dot products.
    Returns [N, H, Dh] float32.
    """
    n, h, dh = q.shape
    num_prompts, kvh = prompt_k.shape[:2]
    if n % num_prompts or h % kvh:
        raise ValueError(f"decode_attention: {n} rows for {num_prompts} prompts, {h} heads for {kvh} kv heads: "
                         f"rows must be a multiple of prompts and heads of kv heads")
    if len(done_k) != len(done_v):
        raise ValueError(f"decode_attention: {len(done_k)} sealed key blocks but {len(done_v)} value blocks")
    sealed = [a for pair in zip(done_k, done_v) for a in pair]
    out = jax.ffi.ffi_call("jaxrl4llm_decode_attention", jax.ShapeDtypeStruct((n, kvh, h // kvh, dh), jnp.float32))(
        q.astype(jnp.float32).reshape(n, kvh, h // kvh, dh), prompt_k, prompt_v, (prompt_mask != 0).astype(jnp.int32),
        cur_k, cur_v, jnp.asarray(slot, jnp.int32), *sealed)
    return out.reshape(n, h, dh)
