"""Grouped-query attention: projections, masks and scaled dot-product attention.

Masks are boolean [B, Tq, S] "may attend" arrays. Masked scores get a large finite negative
value (not -inf) so a query with no visible key (a padding row) yields finite values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.models.layers.linear import einsum

_MASKED = -1e30


def causal_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """allowed[b, t, s] = (s <= t) & attention_mask[b, s].

    Args: attention_mask [B, T] (1 = real token, 0 = padding). Returns [B, T, T] bool.
    """
    t = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return causal[None] & (attention_mask[:, None, :] > 0)


def cache_mask(kv_mask: jax.Array, cache_index: jax.Array, num_queries: int) -> jax.Array:
    """allowed[b, i, s] = (s <= cache_index + i) & kv_mask[b, s]: query i sits in slot cache_index + i.

    Args: kv_mask [B, S] (1 where slot s holds a real token); cache_index int32 scalar.
    Returns [B, num_queries, S] bool.
    """
    s = kv_mask.shape[1]
    query_slot = cache_index + jnp.arange(num_queries, dtype=jnp.int32)
    causal = jnp.arange(s, dtype=jnp.int32)[None, :] <= query_slot[:, None]
    return causal[None] & (kv_mask[:, None, :] > 0)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """out = softmax(q k^T / sqrt(Dh) + mask) v, keys/values heads-major (as in the KV cache).

    Args: q [B, T, H, Dh]; k, v [B, KVH, S, Dh]; mask [B, T, S] bool. Returns [B, T, H, Dh] float32.
    The G = H / KVH query heads sharing a kv head are folded into the matmul's M dimension:
    [B, KVH, G*T, Dh] x [B, KVH, S, Dh] has leading batch dims, which XLA:CPU runs ~5x faster
    than the same contraction with the batch dims interleaved.
    """
    b, t, h, dh = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    q = q.reshape(b, t, kvh, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, dh)
    scores = einsum("bkqd,bksd->bkqs", q, k, dtype) * (dh**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores.reshape(b, kvh, g, t, s), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, kvh, g * t, s)
    out = einsum("bkqs,bksd->bkqd", probs, v, dtype)
    return out.reshape(b, kvh, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def attend_in_query_chunks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: jnp.dtype,
                           chunk: int) -> jax.Array:
    """`attend` over blocks of `chunk` queries (lax.map, each block rematerialised in backward).

    Same result as `attend`; the [B, H, T, S] scores never exist at once, only
    [B, H, chunk, S] (training on long sequences). T is padded up to a multiple of `chunk`;
    padded queries see no key and are dropped.
    """
    b, t, h, dh = q.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, chunk, h, dh).swapaxes(0, 1)
    mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
    block = jax.checkpoint(lambda qm: attend(qm[0], k, v, qm[1], dtype))
    out = jax.lax.map(block, (q, mask))  # [n, B, chunk, H, Dh]
    return out.swapaxes(0, 1).reshape(b, n * chunk, h, dh)[:, :t]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dtype: jnp.dtype,
                          query_chunk: int | None = None) -> jax.Array:
    """out = softmax(q k^T / sqrt(Dh) + mask) v with H query heads sharing KVH kv heads.

    Args: q [B, T, H, Dh]; k, v [B, S, KVH, Dh]; mask [B, T, S] bool. Returns [B, T, H, Dh] float32.
    Scores and softmax are float32; matmul inputs are `dtype`. With `query_chunk` < T the
    queries are processed in blocks (`attend_in_query_chunks`).
    """
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if query_chunk and q.shape[1] > query_chunk:
        return attend_in_query_chunks(q, k, v, mask, dtype, query_chunk)
    return attend(q, k, v, mask, dtype)
