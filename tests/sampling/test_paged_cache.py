"""jaxrl4llm/sampling/paged_cache.py: the pool's writes are scatters that say `unique_indices` (XLA:GPU
otherwise writes each 16-bit element with a system-scope atomic compare-and-swap, docs/gpu.md), and
they stay right where idle slots collide on the trash page."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxrl4llm.sampling.paged_cache import (TRASH_PAGE, copy_pages, empty_free_pages, push_pages,
                                            write_tokens)

PAGES, PAGE, KVH, DH = 6, 4, 2, 8


def test_every_write_into_the_pool_and_the_free_stack_says_unique_indices():
    pool = jnp.zeros((1, PAGES, PAGE, 2 * KVH, DH), jnp.bfloat16)
    at = jnp.zeros((1, 3), jnp.int32)
    k = jnp.ones((1, 3, KVH, DH), jnp.float32)
    free = empty_free_pages(1, PAGES)
    for fn, args in [(write_tokens, (pool, at, at, k, k)), (copy_pages, (pool, at, at)),
                     (lambda f, p, r: push_pages(f, p, r), (free, at, at > 0))]:
        text = jax.jit(fn).lower(*args).as_text()
        scatters = text.count("\"stablehlo.scatter\"(")
        assert scatters >= 1, text[:2000]
        assert text.count("unique_indices = true") == scatters, text[:4000]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, PAGES - 1), st.integers(0, PAGE - 1)), min_size=1, max_size=8,
                unique_by=lambda t: (t[1], t[2])))
def test_live_slots_land_where_they_point_whatever_the_idle_ones_write(slots):
    """Live slots write distinct (page, offset) places; idle ones all write the trash page: every live
    token lands, and no page but the trash page is touched otherwise."""
    live = np.array([s[0] for s in slots])
    pages = np.where(live, [s[1] for s in slots], TRASH_PAGE)[None].astype(np.int32)
    offsets = np.where(live, [s[2] for s in slots], 0)[None].astype(np.int32)
    m = len(slots)
    k = jnp.arange(m * KVH * DH, dtype=jnp.float32).reshape(1, m, KVH, DH) + 1
    v = -k
    pool = np.asarray(write_tokens(jnp.zeros((1, PAGES, PAGE, 2 * KVH, DH), jnp.float32), jnp.asarray(pages),
                                   jnp.asarray(offsets), k, v))
    want = np.zeros_like(pool)
    for j in np.flatnonzero(live):
        want[0, pages[0, j], offsets[0, j], 0::2] = np.asarray(k[0, j])
        want[0, pages[0, j], offsets[0, j], 1::2] = np.asarray(v[0, j])
    np.testing.assert_array_equal(pool[:, 1:], want[:, 1:])
