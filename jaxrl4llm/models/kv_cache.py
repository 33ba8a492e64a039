"""KV cache for incremental decoding: a pytree of preallocated key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl4llm.models.config import ModelConfig

# Logical axes of KVCache.k / KVCache.v, for sharding (see sharding.cache_shardings).
CACHE_LOGICAL_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer, post-RoPE.

    k, v: [L, B, S, KVH, Dh]; slot s of row b holds the token written there by
    `forward_with_cache`. Which slots are real is the caller's `kv_mask` [B, S].
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """Zero cache [L, batch, max_len, KVH, Dh] in `dtype` (default: config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
