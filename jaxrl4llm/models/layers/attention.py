"""Grouped-query attention: the projections module, masks and scaled dot-product attention.

Masks are boolean [B, Tq, S] "may attend" arrays. Masked scores get a large finite negative
value (not -inf) so a query with no visible key (a padding row) yields finite values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl4llm.models.layers.linear import Linear, LoraSettings, einsum
from jaxrl4llm.models.layers.norm import RMSNorm

_MASKED = -1e30


def causal_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """allowed[b, t, s] = (s <= t) & attention_mask[b, s].

    Args: attention_mask [B, T] (1 = real token, 0 = padding). Returns [B, T, T] bool.
    """
    t = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return causal[None] & (attention_mask[:, None, :] > 0)


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


class Attention(nnx.Module):
    """The attention projections of a decoder layer (the attention itself is the caller's `attend`).

    q_proj [D, H, Dh], k_proj / v_proj [D, KVH, Dh] (+ biases [H|KVH, Dh] when
    `attention_bias`, Qwen2), o_proj [H, Dh, D] (+ bias [D] when `o_proj_bias`), per-head
    RMSNorm q_norm / k_norm [Dh] when `qk_norm` (Qwen3).
    """

    def __init__(self, config, *, rngs: nnx.Rngs, lora: LoraSettings | None = None):
        c = config
        d, h, kvh, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

        def linear(name, spec, shape, axes, bias_axes=None, in_ndim=1):
            adapter = lora if lora is not None and name in lora.targets else None
            return Linear(spec, shape, axes, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs, in_ndim=in_ndim,
                          bias_axes=bias_axes, lora=adapter, name=name, exact=c.numerics == "exact")

        qkv_bias = lambda heads: (heads, "head_dim") if c.attention_bias else None
        self.q_proj = linear("q_proj", "btd,dhk->bthk", (d, h, dh), ("embed", "heads", "head_dim"), qkv_bias("heads"))
        self.k_proj = linear("k_proj", "btd,dhk->bthk", (d, kvh, dh), ("embed", "kv_heads", "head_dim"),
                             qkv_bias("kv_heads"))
        self.v_proj = linear("v_proj", "btd,dhk->bthk", (d, kvh, dh), ("embed", "kv_heads", "head_dim"),
                             qkv_bias("kv_heads"))
        self.o_proj = linear("o_proj", "bthk,hkd->btd", (h, dh, d), ("heads", "head_dim", "embed"),
                             ("norm",) if c.o_proj_bias else None, in_ndim=2)
        norm = lambda: RMSNorm(dh, ("head_dim",), eps=c.rms_norm_eps, param_dtype=c.param_dtype,
                               exact=c.numerics == "exact")
        self.q_norm = norm() if c.qk_norm else None
        self.k_norm = norm() if c.qk_norm else None

    def qkv(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """h [B, T, D] -> q [B, T, H, Dh], k, v [B, T, KVH, Dh] float32 (biases added)."""
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head RMSNorm of q and k (Qwen3), identity otherwise."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def out(self, attn: jax.Array) -> jax.Array:
        """attn [B, T, H, Dh] -> attn W_o (+ b_o) [B, T, D] float32."""
        return self.o_proj(attn)
