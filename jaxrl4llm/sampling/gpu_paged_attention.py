"""The continuous sampler's decode attention on NVIDIA GPUs: a Pallas (Triton) paged attention
kernel reading our page pool in place.

Our pool keeps a layer's keys and values interleaved on the head axis, [pages, page, 2 KVH, Dh]
per shard (`paged_cache`, the TPU kernel's layout); JAX's GPU paged attention wants k_pages and
v_pages [KVH, pages, page, Dh], which would be a transpose (a copy of the whole pool) every layer
of every step. So the kernel body here (`partition_kernel`, the algorithm of JAX's
`pallas.ops.gpu.paged_attention`, which jax 0.12 deprecates) runs under our own `pallas_call`,
whose block specs pick head h's keys at column 2h and its values at 2h + 1 of the same pool
buffer: the kernel addresses the pool through its strides, nothing is copied. One program per
(slot, kv head, block of 16 query heads, partition of the slot's pages); each reads only the pages
below its slot's length, `pages_per_block` at a time, with an online softmax:

    o_k = sum_t exp(s_t - m_k) V_t,  l_k = sum_t exp(s_t - m_k)  over partition k,  s = q K^T / sqrt(Dh)
    out = sum_k exp(m_k - m) o_k / sum_k exp(m_k - m) l_k,  m = max_k m_k      (flash decoding)

It rounds unnormalised probabilities to the pool's dtype before the V matmul (as the TPU kernel
does), so it equals `paged_cache.paged_attention` (which rounds normalised ones, as the training
forward) to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl4llm.sampling.paged_cache import per_device

BLOCK_H = 16  # query heads a program computes (Triton's dot needs 16 rows; a GQA group is padded up)
# The blocks, the split and the warps: the fastest of 16 configurations at a Qwen3-0.6B rollout's kv
# lengths on an H200 (`scripts/gpu_check --phases attention`, docs/gpu.md, 2026-11-28): 1.22x the
# kernel's previous 4 warps and 1024-program grid alone, the rollout 2.04 s -> 1.96 s.
PAGES_PER_BLOCK = 4  # pages one loop step of a program reads (64 tokens at 16-token pages)
GRID_TARGET = 2048  # programs worth launching: the k-split parallelises long slots when slots are few
NUM_WARPS, NUM_STAGES = 8, 2  # Triton's launch parameters of a program
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # a logit past the slot's length: finite, so no inf - inf


def partition_kernel(q_ref, k_ref, v_ref, table_ref, length_ref, o_ref, l_ref, m_ref, *, pages_per_block: int):
    """One program: a block of query heads against partition k = program_id(2) of its slot's pages.

        o_k = sum_t exp(s_t - m_k) V_t,  l_k = sum_t exp(s_t - m_k),  m_k = max_t s_t,  s = q K^T

    over the partition's tokens below the slot's length, `pages_per_block` pages a loop step with an
    online softmax (exp as exp2 of log2(e) x, the GPU's fast exponential); probabilities are rounded
    to the pool's dtype for the V matmul. A partition past the length leaves o = l = 0, m = the
    float32 minimum (the combine in `gpu_paged_attention_one_shard` then weighs it 0).

    Refs: q [BLOCK_H, Dh] (pre-scaled by 1/sqrt(Dh), the pool's dtype); k, v [pages, page, Dh] (one
    kv head's column of the pool); table [pages of the partition] int32; length [1] int32.
    Outputs: o [BLOCK_H, Dh], l, m [BLOCK_H] float32.
    """
    block_h, dh = q_ref.shape
    page = k_ref.shape[-2]
    per_partition = table_ref.shape[0]
    block_k = pages_per_block * page
    log2e = math.log2(math.e)
    first_page = pl.program_id(2) * per_partition
    last_page = jnp.minimum(pl.cdiv(length_ref[0], page), first_page + per_partition)

    start = (jnp.zeros((block_h, dh), jnp.float32), jnp.full((block_h,), jnp.finfo(jnp.float32).min),
             jnp.zeros((block_h,), jnp.float32))  # (o, m, l) of no token: what an empty partition keeps

    def partition():
        q = q_ref[...]

        def step(i, carry):
            o, m, l = carry
            pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
            k = k_ref[pages].reshape(block_k, dh)
            v = v_ref[pages].reshape(block_k, dh)
            token = (first_page + i * pages_per_block) * page + jnp.arange(block_k)
            s = jnp.where((token < length_ref[0])[None, :], plgpu.dot(q, k.T), MASK_VALUE)  # [BLOCK_H, block_k]
            m_next = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp2((m - m_next) * log2e)
            p = jnp.exp2((s - m_next[:, None]) * log2e)
            return correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v), m_next, correction * l + p.sum(axis=-1)

        return jax.lax.fori_loop(0, pl.cdiv(last_page - first_page, pages_per_block), step, start)

    o, m, l = jax.lax.cond(first_page >= last_page, lambda: start, partition)
    o_ref[...], l_ref[...], m_ref[...] = o, l, m


def kernel_blocks(pages: int, slots: int, kv_heads: int, pages_per_block: int | None = None,
                  k_splits: int | None = None) -> tuple[int, int, int]:
    """(pages_per_block, k_splits, padded_pages) for slots of `pages` logical pages: a program reads
    `pages_per_block` pages a loop step (default `PAGES_PER_BLOCK`); a slot's pages split into
    `k_splits` partitions, one program each (default: as many as bring the grid near `GRID_TARGET`
    programs, at most one per block);
    the page table is padded to `padded_pages`, a multiple of both, with pages no slot's length
    reaches (a partition past a slot's length does no work)."""
    block = max(1, min(pages_per_block or PAGES_PER_BLOCK, pages))
    blocks = -(-pages // block)
    if k_splits is None:
        k_splits = min(blocks, max(1, GRID_TARGET // max(1, slots * kv_heads)))
    if k_splits < 1:
        raise ValueError(f"k_splits={k_splits}: at least 1 partition of a slot's pages")
    return block, k_splits, -(-pages // (block * k_splits)) * block * k_splits


def gpu_paged_attention_one_shard(q: jax.Array, pool: jax.Array, table: jax.Array, kv_len: jax.Array, *,
                                  pages_per_block: int | None = None, k_splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  interpret: bool = False) -> jax.Array:
    """softmax(q K^T / sqrt(Dh)) V over each slot's first kv_len tokens, K and V read in place.

    Args:
      q [S, KVH, H/KVH, Dh] (any float dtype; cast to the pool's).
      pool [pages, page, 2 KVH, Dh] bf16/f16: key of head h at column 2h, its value at 2h + 1.
      table [S, W] int32: a slot's logical pages (its tokens contiguous over them).
      kv_len [S] int32: valid tokens of each slot (0: an idle slot, whose output is 0).
      pages_per_block: pages a program reads per loop step; k_splits: partitions of a slot's
        pages run as separate programs (`kernel_blocks`); num_warps, num_stages: Triton's. None: this
        module's constants, read when the call traces.
      interpret: run the kernel in Pallas' interpreter (any backend; for tests on CPU).
    Returns: [S, KVH, H/KVH, Dh] float32.
    """
    s, kvh, hg, dh = q.shape
    _, page, two_kvh, _ = pool.shape
    width = table.shape[1]
    if two_kvh != 2 * kvh:
        raise ValueError(f"pool [pages, page, 2 KVH, Dh] has {two_kvh} head columns for {kvh} kv heads of q")
    block, splits, padded = kernel_blocks(width, s, kvh, pages_per_block, k_splits)
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, padded - width)))  # page 0: read past the length only
    per_split = padded // splits
    heads = -(-hg // BLOCK_H) * BLOCK_H
    head_blocks = heads // BLOCK_H
    qp = jnp.pad((q * dh**-0.5).astype(pool.dtype), ((0, 0), (0, 0), (0, heads - hg), (0, 0)))
    kernel = functools.partial(partition_kernel, pages_per_block=block)
    head = lambda g: (g // head_blocks, g % head_blocks)  # grid axis 1: (kv head, block of query heads)
    # grid (slot, kv head x head block, partition): the kernel reads its partition as program_id(2)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(s, kvh * head_blocks, splits),
        in_specs=[
            pl.BlockSpec((None, None, BLOCK_H, dh), lambda b, g, k: (b, *head(g), 0)),  # q
            pl.BlockSpec((pool.shape[0], page, None, dh), lambda b, g, k: (0, 0, 2 * head(g)[0], 0)),  # keys
            pl.BlockSpec((pool.shape[0], page, None, dh), lambda b, g, k: (0, 0, 2 * head(g)[0] + 1, 0)),  # values
            pl.BlockSpec((None, None, per_split), lambda b, g, k: (b, k, 0)),  # the partition's pages
            pl.BlockSpec((1,), lambda b, g, k: (b,)),  # the slot's length
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, BLOCK_H, dh), lambda b, g, k: (k, b, *head(g), 0)),  # o_k
            pl.BlockSpec((None, None, None, BLOCK_H), lambda b, g, k: (k, b, *head(g))),  # l_k
            pl.BlockSpec((None, None, None, BLOCK_H), lambda b, g, k: (k, b, *head(g))),  # m_k
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, s, kvh, heads, dh), jnp.float32),
                   jax.ShapeDtypeStruct((splits, s, kvh, heads), jnp.float32),
                   jax.ShapeDtypeStruct((splits, s, kvh, heads), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES),
        name="jaxrl4llm_paged_attention",
    )(qp, pool, pool, table.reshape(s, splits, per_split), kv_len.astype(jnp.int32))
    o, l, m = o[..., :hg, :], l[..., :hg], m[..., :hg]
    w = jnp.exp(m - jnp.max(m, axis=0))  # [K, S, KVH, hg]: each partition's share of the softmax
    total = jnp.sum(w * l, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def gpu_paged_attention(q: jax.Array, pool: jax.Array, table: jax.Array, kv_len: jax.Array, *, mesh=None,
                        batch_axes: tuple = (), tensor_axis: str | None = None, interpret: bool = False,
                        **blocks) -> jax.Array:
    """`gpu_paged_attention_one_shard` for every shard: q [D, S, KVH, H/KVH, Dh], pool [D, pages,
    page, 2 KVH, Dh], table [D, S, W], kv_len [D, S] -> [D, S, KVH, H/KVH, Dh] float32. With a mesh
    the kernel runs per GPU (`paged_cache.per_device`): D over `batch_axes`, kv heads over `tensor_axis` (a GPU
    holds whole key/value column pairs: `paged_cache.POOL_AXES` splits the 2 KVH axis)."""

    def one_device(q, pool, table, kv_len):
        one = functools.partial(gpu_paged_attention_one_shard, interpret=interpret, **blocks)
        if q.shape[0] == 1:  # a shard per device: [1, ...] -> [...] is free
            return one(q[0], pool[0], table[0], kv_len[0])[None]
        return jnp.stack([one(q[i], pool[i], table[i], kv_len[i]) for i in range(q.shape[0])])

    return per_device(one_device, q, pool, table, kv_len, mesh=mesh, batch_axes=batch_axes, tensor_axis=tensor_axis)
