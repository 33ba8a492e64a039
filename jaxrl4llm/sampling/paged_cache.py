"""A paged KV cache for the continuous sampler: a page pool, a free-page stack, and attention over live pages.

    pool[l]   [D, pages, KVH, page, Dh]   keys (and values) of layer l; page 0 is a trash page
    free      [D, pages]                   stack of free page ids: free[d, :top[d]] are free
    table     [D, S, pages_per_slot]       a slot's logical pages: its prompt's full pages, then its own

D is the number of data-parallel shards of the sampler (each shard has its own pool, slots and
prompts, so every page lookup stays on its shard); S the slots of a shard. A prompt's pages are
written once at prefill; its full pages are read in place by the G slots that sample it, its
last, partial page is copied into each slot's first own page, where the slot's tokens continue
(so a slot's tokens are contiguous over its logical pages, the layout of vLLM and of the TPU
ragged paged attention kernel, and shared pages are never written). A slot's own pages are
taken from the stack as its length crosses a page boundary and given back when it finishes.
Writes of idle slots go to the trash page, which no slot ever attends to.

Attention reads each slot's live pages only, C pages at a time: the chunk loops run
ceil(max over live slots of live pages / C) times, bounded by the longest live slot (up to one
chunk of rounding), not by the cache's capacity:

    s = q K^T / sqrt(Dh) chunk by chunk into a float32 row;  p = softmax(s);  out = sum_chunks p_c V_c

(an online softmax would read each page in one pass, but it rounds unnormalised probabilities
to bf16, not the normalised ones the training forward rounds; the score row is small).
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


def pool_pages(slots: int, prompts: int, prompt_pages: int, response_pages: int) -> int:
    """Pages of one shard's pool that never run out: the trash page, every slot's response pages
    and the pages of `prompts` prompts (a prompt holds its pages while any of its rows is unfinished)."""
    return 1 + slots * response_pages + prompts * prompt_pages


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

    Two loops over the first num_chunks chunks of pages: scores into a [.., W * page] float32
    buffer, then (after one softmax over the buffer, -1e30 where not valid) probabilities cast to
    `dtype` times V. The same rounding as the static engine and the training forward (both
    round normalised probabilities); each page is read once.

    Args:
      q [D, S, KVH, H/KVH, Dh] float32.
      pool_k, pool_v [D, pages, KVH, page, Dh].
      table [D, S, W] int32: each slot's logical pages (W a multiple of pages_per_chunk);
      counts [D, S, W] int32: valid tokens in each logical page (the first counts of its slots).
      num_chunks: int32 scalar, chunks of pages_per_chunk logical pages to read (every valid page
        of a slot must lie in the first num_chunks chunks).
      dtype: matmul input dtype (scores and softmax in float32).
    Returns: [D, S, KVH, H/KVH, Dh] float32.
    """
    d, s, kvh, hg, dh = q.shape
    page, width = pool_k.shape[3], table.shape[2]
    c = pages_per_chunk
    scale = dh**-0.5
    chunk = lambda a, i: jax.lax.dynamic_slice_in_dim(a, i * c, c, axis=2)  # [D, S, W] -> [D, S, C]

    def scores(i, buf):
        valid = jnp.arange(page) < chunk(counts, i)[..., None]  # [D, S, C, page]
        k = gather_pages(pool_k, chunk(table, i))  # [D, S, C, KVH, page, Dh]
        sc = jnp.where(valid[:, :, None, None], einsum("dskhe,dsckpe->dskhcp", q, k, dtype) * scale, _MASKED)
        return jax.lax.dynamic_update_slice_in_dim(buf, sc.reshape(d, s, kvh, hg, c * page), i * c * page, axis=4)

    buf = jax.lax.fori_loop(0, num_chunks, scores, jnp.full((d, s, kvh, hg, width * page), _MASKED, jnp.float32))
    probs = jax.nn.softmax(buf, axis=-1)

    def values(i, out):
        p = jax.lax.dynamic_slice_in_dim(probs, i * c * page, c * page, axis=4).reshape(d, s, kvh, hg, c, page)
        return out + einsum("dskhcp,dsckpe->dskhe", p, gather_pages(pool_v, chunk(table, i)), dtype)

    return jax.lax.fori_loop(0, num_chunks, values, jnp.zeros((d, s, kvh, hg, dh), jnp.float32))
