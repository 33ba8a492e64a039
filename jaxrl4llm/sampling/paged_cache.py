"""A paged KV cache for the continuous sampler: a page pool, a free-page stack, and attention over live pages.

    pool[l]   [D, pages, KVH, page, Dh]   keys (and values) of layer l; page 0 is a trash page
    free      [D, pages]                   stack of free page ids: free[d, :top[d]] are free
    table     [D, S, pages_per_slot]       a slot's logical pages: its prompt's pages, then its own

D is the number of data-parallel shards of the sampler (each shard has its own pool, slots and
prompts, so every page lookup stays on its shard); S the slots of a shard. A prompt's pages are
written once at prefill and read by the G slots that sample it; a slot's response pages are
taken from the stack as its length crosses a page boundary and given back when it finishes.
Writes of idle slots go to the trash page, which no slot ever attends to.

Attention reads each slot's live pages only, C pages at a time, with an online softmax
(Milakov & Gimelshein 2018; FlashAttention's running max and sum): for chunk c,

    m' = max(m, max_j s_j);  l' = l e^(m - m') + sum_j e^(s_j - m');  o' = o e^(m - m') + sum_j e^(s_j - m') v_j

and out = o / l. The chunk loop runs ceil(max over live slots of live pages / C) times: bounded by
the longest live slot (up to one chunk of rounding), not by the cache's capacity.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl4llm.models.layers.linear import einsum

TRASH_PAGE = 0
_MASKED = -1e30
POOL_AXES = ("batch", None, "kv_heads", None, None)  # [D, pages, KVH, page, Dh]


class FreePages(NamedTuple):
    """stack [D, pages] int32 (free[d, :top[d]] are free page ids); top [D] int32."""

    stack: jax.Array
    top: jax.Array


def empty_free_pages(num_shards: int, num_pages: int) -> FreePages:
    """Every page but the trash page free: stack[d] = [1, 2, ..., pages-1, 0], top = pages - 1."""
    ids = jnp.roll(jnp.arange(num_pages, dtype=jnp.int32), -1)
    return FreePages(jnp.broadcast_to(ids, (num_shards, num_pages)), jnp.full((num_shards,), num_pages - 1, jnp.int32))


def pop_pages(free: FreePages, need: jax.Array) -> tuple[FreePages, jax.Array]:
    """Take one page for every True of need [D, M] (in order): (free', ids [D, M], TRASH_PAGE where not needed).

    The caller sizes the pool so that the stack never runs dry (`pool_pages`)."""
    rank = jnp.cumsum(need, axis=1, dtype=jnp.int32) - 1
    at = jnp.clip(free.top[:, None] - 1 - rank, 0, free.stack.shape[1] - 1)
    ids = jnp.where(need, jnp.take_along_axis(free.stack, at, axis=1), TRASH_PAGE)
    return FreePages(free.stack, free.top - jnp.sum(need, axis=1, dtype=jnp.int32)), ids


def push_pages(free: FreePages, pages: jax.Array, release: jax.Array) -> FreePages:
    """Give back pages [D, M] where release [D, M] is True."""
    size = free.stack.shape[1]
    rank = jnp.cumsum(release, axis=1, dtype=jnp.int32) - 1
    at = jnp.where(release, free.top[:, None] + rank, size)  # out of range: dropped
    stack = jax.vmap(lambda s, i, p: s.at[i].set(p, mode="drop"))(free.stack, at, pages)
    return FreePages(stack, free.top + jnp.sum(release, axis=1, dtype=jnp.int32))


def pool_pages(slots: int, prompt_pages: int, response_pages: int) -> int:
    """Pages of one shard's pool that never run out: the trash page, every slot's response pages
    and the pages of as many prompts as slots (a prompt holds pages while any of its rows runs)."""
    return 1 + slots * (response_pages + prompt_pages)


def write_tokens(pool: jax.Array, pages: jax.Array, offsets: jax.Array, new: jax.Array) -> jax.Array:
    """pool[d, pages[d, m], :, offsets[d, m], :] = new[d, m]. pool [D, P, KVH, page, Dh];
    pages, offsets [D, M] int32; new [D, M, KVH, Dh] (any float dtype)."""
    return jax.vmap(lambda p, i, o, x: p.at[i, :, o, :].set(x.astype(p.dtype)))(pool, pages, offsets, new)


def gather_pages(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """pool [D, P, KVH, page, Dh], pages [D, S, C] -> [D, S, C, KVH, page, Dh]."""
    return jax.vmap(lambda p, i: p[i])(pool, pages)


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, table: jax.Array, counts: jax.Array,
                    num_chunks, *, pages_per_chunk: int, dtype) -> jax.Array:
    """One query per slot against its live pages: softmax(q K^T / sqrt(Dh)) V over the valid tokens.

    Args:
      q [D, S, KVH, H/KVH, Dh] float32.
      pool_k, pool_v [D, pages, KVH, page, Dh].
      table [D, S, W] int32: each slot's logical pages (W a multiple of pages_per_chunk);
      counts [D, S, W] int32: valid tokens in each logical page (the first counts of its slots).
      num_chunks: int32 scalar, chunks of pages_per_chunk logical pages to read (every valid page
        of a slot must lie in the first num_chunks chunks).
      dtype: matmul input dtype (scores and probabilities accumulate in float32).
    Returns: [D, S, KVH, H/KVH, Dh] float32 (0 for a slot without valid tokens).
    """
    d, s, kvh, hg, dh = q.shape
    page = pool_k.shape[3]
    c = pages_per_chunk
    scale = dh**-0.5

    def body(i, carry):
        m, l, o = carry
        ids = jax.lax.dynamic_slice_in_dim(table, i * c, c, axis=2)  # [D, S, C]
        valid = jnp.arange(page) < jax.lax.dynamic_slice_in_dim(counts, i * c, c, axis=2)[..., None]  # [D, S, C, page]
        k, v = gather_pages(pool_k, ids), gather_pages(pool_v, ids)  # [D, S, C, KVH, page, Dh]
        scores = einsum("dskhe,dsckpe->dskhcp", q, k, dtype) * scale
        valid = valid[:, :, None, None]
        scores = jnp.where(valid, scores, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=(-2, -1)))
        p = jnp.where(valid, jnp.exp(scores - m_new[..., None, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=(-2, -1))
        o = o * correction[..., None] + einsum("dskhcp,dsckpe->dskhe", p, v, dtype)
        return m_new, l, o

    init = (jnp.full((d, s, kvh, hg), _MASKED, jnp.float32), jnp.zeros((d, s, kvh, hg), jnp.float32),
            jnp.zeros((d, s, kvh, hg, dh), jnp.float32))
    _, l, o = jax.lax.fori_loop(0, num_chunks, body, init)
    return o / jnp.maximum(l, 1e-30)[..., None]
