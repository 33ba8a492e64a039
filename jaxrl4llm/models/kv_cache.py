"""KV cache for incremental decoding: a pytree of preallocated key/value buffers."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl4llm.models.config import ModelConfig

# Logical axes of KVCache.k / KVCache.v, for sharding (see sharding.cache_shardings).
CACHE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer, post-RoPE.

    k, v: [L, B, KVH, S, Dh] (heads-major: the score matmul reads S contiguously, no
    transpose); slot s of row b holds the token written there by `forward_with_cache`.
    Which slots are real is the caller's `kv_mask` [B, S].
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """Zero cache [L, batch, KVH, max_len, Dh] in `dtype` (default: config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
