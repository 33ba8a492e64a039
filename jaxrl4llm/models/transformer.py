"""The decoder-only transformer as pure functions of (params, config, tokens).

    x_0 = embed(tokens)
    x_{l+1} = x_l' + MLP(norm(x_l')),  x_l' = x_l + Attn(norm(x_l))      (l < L, via lax.scan)
    h = norm(x_L);  logits = h W_head

The residual stream is float32; matmul inputs are `config.dtype` with float32 accumulation.
Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorm, Llama 3 "llama3" RoPE scaling; all
three share this code (the params pytree only holds the weights a family has).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.kv_cache import KVCache
from jaxrl4llm.models.layers.attention import attend, cache_mask, causal_padding_mask, dot_product_attention
from jaxrl4llm.models.layers.linear import einsum
from jaxrl4llm.models.layers.mlp import swiglu_mlp
from jaxrl4llm.models.layers.norm import rms_norm
from jaxrl4llm.models.layers.rope import apply_rope, rope_tables


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """pos[b, t] = max(cumsum(mask[b])[t] - 1, 0): RoPE positions of a left-padded batch.

    Args: attention_mask [B, T] (1 = real token). Returns [B, T] int32.
    """
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


# ---------------------------------------------------------------------------- layer pieces
def _project_qkv(x, p, config: ModelConfig, cos, sin):
    """Normed residual -> (q [B,T,H,Dh], k, v [B,T,KVH,Dh]) float32, q/k normed and rotated."""
    dtype = jnp.dtype(config.dtype)
    h = rms_norm(x, p["input_norm"], config.rms_norm_eps)
    q = einsum("btd,dhk->bthk", h, p["q_proj"], dtype)
    k = einsum("btd,dhk->bthk", h, p["k_proj"], dtype)
    v = einsum("btd,dhk->bthk", h, p["v_proj"], dtype)
    if config.attention_bias:
        q = q + p["q_bias"].astype(jnp.float32)
        k = k + p["k_bias"].astype(jnp.float32)
        v = v + p["v_bias"].astype(jnp.float32)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish_layer(x, attn, p, config: ModelConfig):
    """x' = x + attn W_o (+ b_o);  return x' + MLP(norm(x'))."""
    dtype = jnp.dtype(config.dtype)
    out = einsum("bthk,hkd->btd", attn, p["o_proj"], dtype)
    if config.o_proj_bias:
        out = out + p["o_bias"].astype(jnp.float32)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"], config.rms_norm_eps)
    return x + swiglu_mlp(h, p["gate_proj"], p["up_proj"], p["down_proj"], dtype)


def _maybe_remat(fn, config: ModelConfig):
    return jax.checkpoint(fn, prevent_cse=False) if config.remat else fn


def _embed(params, tokens):
    # mode="clip": an out-of-range id (e.g. -1 padding) must not become NaN, which would leak
    # through masked attention (0 * NaN = NaN).
    return jnp.take(params["embed_tokens"], tokens, axis=0, mode="clip").astype(jnp.float32)


def _lm_head(params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """logits = h W_head. h [B, T, D] -> [B, T, V] float32 (W_head = embed^T when tied)."""
    dtype = jnp.dtype(config.dtype)
    if config.tie_word_embeddings:
        return einsum("btd,vd->btv", h, params["embed_tokens"], dtype)
    return einsum("btd,dv->btv", h, params["lm_head"], dtype)


# ---------------------------------------------------------------------------- public API
@functools.partial(jax.jit, static_argnames=("config",))
def hidden_states(params, config: ModelConfig, tokens, *, positions, attention_mask) -> jax.Array:
    """Final-norm hidden states h = norm(x_L).

    Args:
      tokens [B, T] int32; positions [B, T] int32 (RoPE positions, see `positions_from_mask`);
      attention_mask [B, T] (1 = real token, 0 = padding). Causal + padding masked.
    Returns: [B, T, D] float32.
    """
    cos, sin = rope_tables(config, positions)
    mask = causal_padding_mask(attention_mask)
    dtype = jnp.dtype(config.dtype)

    def layer(x, p):
        q, k, v = _project_qkv(x, p, config, cos, sin)
        attn = dot_product_attention(q, k, v, mask, dtype, query_chunk=config.attention_query_chunk)
        return _finish_layer(x, attn, p, config), None

    x, _ = jax.lax.scan(_maybe_remat(layer, config), _embed(params, tokens), params["layers"])
    return rms_norm(x, params["final_norm"], config.rms_norm_eps)


@functools.partial(jax.jit, static_argnames=("config",))
def forward(params, config: ModelConfig, tokens, *, positions, attention_mask) -> jax.Array:
    """logits = norm(x_L) W_head.

    Args: tokens, positions [B, T] int32; attention_mask [B, T] (1 = real, 0 = padding).
    Returns: [B, T, V] float32. Left-padded rows equal each row run alone (positions from
    `positions_from_mask`); rows at padding positions hold finite garbage.
    """
    h = hidden_states(params, config, tokens, positions=positions, attention_mask=attention_mask)
    return _lm_head(params, config, h)


@functools.partial(jax.jit, static_argnames=("config", "chunk_size"))
def token_logprobs(params, config: ModelConfig, tokens, targets, *, positions, attention_mask,
                   temperature=1.0, chunk_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """logp[b,t] = log_softmax(z)[targets[b,t]], entropy[b,t] = -sum p log p, z = logits / temperature.

    The LM head runs over `chunk_size` positions at a time (lax.map, rematerialised in the
    backward pass), so the [B, T, V] logits never exist at once. Differentiable.

    Args: tokens, targets, positions [B, T] int32; attention_mask [B, T]; temperature scalar.
      Targets outside [0, V) (e.g. -100) are clipped, never NaN: mask those positions.
    Returns: (logp [B, T] float32, entropy [B, T] float32).
    """
    h = hidden_states(params, config, tokens, positions=positions, attention_mask=attention_mask)
    b, t, d = h.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    tg = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
    inv_temperature = 1.0 / jnp.asarray(temperature, jnp.float32)

    @jax.checkpoint
    def chunk(args):
        h_c, tg_c = args
        z = _lm_head(params, config, h_c) * inv_temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, tg_c[..., None], axis=-1, mode="clip")[..., 0] - lse
        entropy = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(chunk, (h, tg))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return unchunk(logp), unchunk(entropy)


@functools.partial(jax.jit, static_argnames=("config",))
def forward_with_cache(params, config: ModelConfig, tokens, *, positions, cache: KVCache, cache_index,
                       kv_mask) -> tuple[jax.Array, KVCache]:
    """Run t new tokens against the KV cache; write their keys/values at slots [cache_index, cache_index + t).

    Query i (slot cache_index + i) attends to slots s <= cache_index + i with kv_mask[b, s] = 1.
    Prefill: t = prompt length, cache_index = 0. Decode: t = 1.

    Args:
      tokens, positions [B, t] int32; cache KVCache [L, B, KVH, S, Dh]; cache_index int32 scalar;
      kv_mask [B, S] (1 where a slot holds a real token, including the t new ones).
    Returns: (logits [B, t, V] float32, new KVCache).
    """
    cos, sin = rope_tables(config, positions)
    cache_index = jnp.asarray(cache_index, jnp.int32)
    mask = cache_mask(kv_mask, cache_index, tokens.shape[1])
    dtype = jnp.dtype(config.dtype)
    zero = jnp.zeros((), jnp.int32)

    def layer(carry, xs):
        x, ck, cv = carry
        p, i = xs
        q, k, v = _project_qkv(x, p, config, cos, sin)
        start = (i, zero, zero, cache_index, zero)
        ck = jax.lax.dynamic_update_slice(ck, k.transpose(0, 2, 1, 3)[None].astype(ck.dtype), start)
        cv = jax.lax.dynamic_update_slice(cv, v.transpose(0, 2, 1, 3)[None].astype(cv.dtype), start)
        attn = attend(q, ck[i], cv[i], mask, dtype)
        return (_finish_layer(x, attn, p, config), ck, cv), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, ck, cv), _ = jax.lax.scan(layer, (_embed(params, tokens), cache.k, cache.v), (params["layers"], layer_ids))
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    return _lm_head(params, config, h), KVCache(ck, cv)
