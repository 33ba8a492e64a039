"""Token log-probabilities and entropies from logits or from hidden states, full or chunked.

At a Qwen3 vocabulary (151,936) and 8k response tokens, the float32 log-softmax over
[B, T, V] is the largest tensor of an RL step. The chunked variants walk the sequence in
chunks of `chunk_size` positions under `lax.map` (each chunk rematerialised in the backward
pass), so at most [B, chunk_size, V] float32 values exist at once.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp


def _gather_logprob_and_entropy(logits: chex.Array, tokens: chex.Array, temperature: float, logprob_fn=None):
    """[..., V] logits, [...] tokens -> (log p[token], entropy), both float32 [...]; logprob_fn: log p
    computed by logprob_fn(z, tokens), z = logits / temperature (`token_logprobs_from_head`)."""
    z = logits.astype(jnp.float32) / temperature
    shifted = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))  # else logZ - E[z] cancels
    logz = jax.nn.logsumexp(shifted, axis=-1)
    if logprob_fn is not None:
        logp = logprob_fn(z, tokens)
    else:
        picked = jnp.take_along_axis(shifted, tokens[..., None].astype(jnp.int32), axis=-1, mode="clip")[..., 0]
        logp = picked - logz
    probs = jnp.exp(shifted - logz[..., None])
    entropy = jnp.maximum(logz - jnp.sum(probs * shifted, axis=-1), 0.0)
    return logp, entropy


def token_logprobs(logits: chex.Array, tokens: chex.Array, temperature: float = 1.0) -> chex.Array:
    """log p(token) = log_softmax(logits / temperature)[token] = (z_tok - c) - log sum_v exp(z_v - c).

    c = max_v z_v (no gradient; the value does not depend on it): without it, z_tok - logZ
    subtracts two numbers of size |z| and float32 keeps only ~|z|·6e-8 of their difference
    (at z ~ 1e4, errors ~1e-4). torch's log_softmax (verl's fallback path) and our chunked
    variants subtract it too.

    Args:
      logits: [B, T, V] (any float dtype; computed in float32).
      tokens: [B, T] int token ids whose log-probs are wanted (the *next* tokens: align
        logits[:, t] with tokens[:, t] before calling).
      temperature: the sampling temperature; the policy being trained is softmax(z / tau).

    Returns:
      [B, T] float32 log-probabilities.
    """
    chex.assert_rank([logits, tokens], [3, 2])
    chex.assert_equal_shape_prefix([logits, tokens], 2)
    z = logits.astype(jnp.float32) / temperature
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    picked = jnp.take_along_axis(z, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def entropy_from_logits(logits: chex.Array, temperature: float = 1.0) -> chex.Array:
    """H = -sum_v p_v log p_v with p = softmax(logits / temperature); H = logZ - E_p[z].

    Stable for large logits (|z| ~ 1e4): computed from the log-partition, never from log(p).

    Args:
      logits: [..., V].

    Returns:
      [...] float32 entropies (nats).
    """
    z = logits.astype(jnp.float32) / temperature
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))  # else logZ - E[z] cancels
    logz = jax.nn.logsumexp(z, axis=-1)
    probs = jnp.exp(z - logz[..., None])
    return jnp.maximum(logz - jnp.sum(probs * z, axis=-1), 0.0)


def _chunked_over_time(fn, arrays, chunk_size: int, seq_len: int):
    """Applies fn to [B, c, ...] slices of each array along axis 1, concatenating [B, T] outputs.

    The sequence is padded to a multiple of chunk_size; the chunk body is rematerialised so
    the backward pass never stores more than one chunk's [B, c, V] intermediates.
    """
    num_chunks = -(-seq_len // chunk_size)
    padded = num_chunks * chunk_size

    def pad_and_split(x):
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, padded - seq_len)
        x = jnp.pad(x, pad)
        x = x.reshape(x.shape[0], num_chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    outs = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(pad_and_split(a) for a in arrays))

    def merge(y):  # [N, B, c] -> [B, T]
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], padded)[:, :seq_len]

    return jax.tree.map(merge, outs)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def token_logprobs_chunked(
    logits: chex.Array, tokens: chex.Array, temperature: float = 1.0, *, chunk_size: int = 512
) -> chex.Array:
    """token_logprobs computed over sequence chunks: same values, [B, chunk_size, V] float32 peak.

    Args:
      logits: [B, T, V] (e.g. bfloat16 from the model).
      tokens: [B, T] int.
      temperature: sampling temperature.
      chunk_size: positions per chunk (static); T need not be a multiple.

    Returns:
      [B, T] float32 log-probabilities.
    """
    chex.assert_rank([logits, tokens], [3, 2])
    chex.assert_equal_shape_prefix([logits, tokens], 2)
    fn = lambda z, t: _gather_logprob_and_entropy(z, t, temperature)[0]
    return _chunked_over_time(fn, (logits, tokens), chunk_size, tokens.shape[1])


def token_logprobs_from_head(
    head, hidden: chex.Array, tokens: chex.Array, *, temperature: float = 1.0, chunk_size: int = 512,
    return_entropy: bool = False, logprob_fn=None,
):
    """log p(token) = log_softmax(head(hidden) / temperature)[token], chunked over T.

    `head` maps a [B, c, D] chunk of hidden states to [B, c, V] logits (a model's LM head, which
    may close over its weights); it is applied chunk by chunk, rematerialised in the backward
    pass, so the [B, T, V] logits never exist at once. Call it inside your own jit.

    Args:
      head: callable [B, c, D] -> [B, c, V] logits.
      hidden: [B, T, D] final hidden states (after the final norm).
      tokens: [B, T] int target tokens (out-of-range ids are clipped: mask those positions).
      temperature: sampling temperature. chunk_size: positions per chunk (static).
      return_entropy: also return the per-token entropy (max-subtracted, as `entropy_from_logits`).
      logprob_fn: z [..., V] float32 (the chunk's logits / temperature), tokens [...] -> log p [...], in
        place of the XLA log-softmax (None); `models.score_tokens` passes `kernels.exact.token_logprobs`
        under `model.numerics=exact` (the log-normaliser summed in a fixed order, the sampler's).

    Returns:
      logp [B, T] float32, or (logp, entropy) each [B, T] float32.
    """
    chex.assert_rank([hidden, tokens], [3, 2])
    chex.assert_equal_shape_prefix([hidden, tokens], 2)
    fn = lambda h, t: _gather_logprob_and_entropy(head(h), t, temperature, logprob_fn)
    logp, ent = _chunked_over_time(fn, (hidden, tokens), min(chunk_size, tokens.shape[1]), tokens.shape[1])
    return (logp, ent) if return_entropy else logp


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_entropy", "preferred_element_type"))
def token_logprobs_from_hidden(
    hidden: chex.Array,
    unembed: chex.Array,
    tokens: chex.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
    preferred_element_type=jnp.float32,
):
    """log p(token) = log_softmax((hidden @ unembed) / temperature)[token], chunked over T.

    `token_logprobs_from_head` with the head h -> h @ unembed: the memory-saving path of
    verl's / tunix's fused log-prob computation.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm).
      unembed: [D, V] LM-head matrix (the transposed embedding when tied).
      tokens: [B, T] int target tokens.
      temperature: sampling temperature.
      chunk_size: positions per chunk (static).
      return_entropy: also return the per-token entropy of the (tempered) distribution.
      preferred_element_type: accumulation dtype of the matmul (float32).

    Returns:
      logp [B, T] float32, or (logp, entropy) each [B, T] float32.
    """
    chex.assert_rank([hidden, unembed, tokens], [3, 2, 2])
    if hidden.shape[-1] != unembed.shape[0]:
        raise ValueError(f"hidden has width {hidden.shape[-1]} but unembed is {unembed.shape} ([D, V] expected).")
    head = lambda h: jnp.einsum("bcd,dv->bcv", h, unembed.astype(h.dtype), preferred_element_type=preferred_element_type)
    return token_logprobs_from_head(head, hidden, tokens, temperature=temperature, chunk_size=chunk_size,
                                    return_entropy=return_entropy)


__all__ = [
    "token_logprobs",
    "token_logprobs_chunked",
    "token_logprobs_from_hidden",
    "token_logprobs_from_head",
    "entropy_from_logits",
]
