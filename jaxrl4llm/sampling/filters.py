"""Next-token sampling: temperature, top-k, top-p (nucleus), greedy, and the log-probs of the choice.

    z = logits / T;  keep = top-k(z) ∩ nucleus_p(softmax(z));  y ~ softmax(z | keep)

Order as in transformers and vLLM: temperature, then top-k, then top-p on what top-k kept.
Two log-probs come back for every chosen token y:

    logprob             = log softmax(z | keep)[y]   (the distribution y was drawn from)
    logprob_untruncated = log softmax(z)[y]          (temperature only: what a trainer's
                                                      teacher-forced forward recomputes)

All functions are pure and jit-able; `top_k` and `greedy` are static (they fix shapes and
branches), `temperature` and `top_p` may be traced.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenSample(NamedTuple):
    """tokens [N] int32; logprob, logprob_untruncated [N] float32 (see module docstring)."""

    tokens: jax.Array
    logprob: jax.Array
    logprob_untruncated: jax.Array


def top_p_keep(sorted_logits: jax.Array, top_p) -> jax.Array:
    """keep[i] = sum_{j<i} p_j < top_p, p = softmax(sorted_logits): the nucleus of a descending row.

    The most likely token is always kept; top_p >= 1 keeps every token (no float round-off
    dropping the tail).

    Args: sorted_logits [..., K] sorted descending (entries may be -inf); top_p scalar in (0, 1].
    Returns: [..., K] bool.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return (mass_before < top_p) | (top_p >= 1.0)


def sample_tokens(logits: jax.Array, key: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0,
                  use_top_p: bool = False, greedy: bool = False) -> TokenSample:
    """y ~ softmax(z | top-k ∩ top-p), z = logits / temperature (greedy: y = argmax z).

    Args:
      logits: [N, V] float32.
      key: PRNG key for this step (one draw per row).
      temperature: scalar > 0 (ignored for the choice when greedy, still used for the log-probs).
      top_k: static; 0 = off, else keep the k largest logits (ties at the k-th value lose).
      top_p: scalar in (0, 1]; applied only when `use_top_p` (static) is True.
      greedy: static; take the argmax (its `logprob` is then the untruncated one).
    Returns: TokenSample of [N] arrays.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    log_norm = jax.nn.logsumexp(z, axis=-1)
    if greedy:
        tokens = jnp.argmax(z, axis=-1).astype(jnp.int32)
        lp = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - log_norm
        return TokenSample(tokens, lp, lp)

    vocab = z.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else (vocab if use_top_p else 0)
    if k == 0:  # plain temperature sampling over the whole vocabulary
        tokens = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
        lp = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - log_norm
        return TokenSample(tokens, lp, lp)

    candidates, candidate_ids = jax.lax.top_k(z, k)  # [N, k] descending
    if use_top_p:
        candidates = jnp.where(top_p_keep(candidates, top_p), candidates, -jnp.inf)
    choice = jax.random.categorical(key, candidates, axis=-1)
    tokens = jnp.take_along_axis(candidate_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    chosen = jnp.take_along_axis(candidates, choice[:, None], axis=-1)[:, 0]
    lp = chosen - jax.nn.logsumexp(candidates, axis=-1)
    lp_untruncated = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - log_norm
    return TokenSample(tokens, lp, lp_untruncated)


def allowed_tokens(logits: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
    """The support of the sampling distribution: mask[n, v] = 1 if v may be drawn. [N, V] bool.

    A reference (full sort, host-friendly) for tests and debugging, not used by the sampler.
    Ties at the k-th value are all allowed here (a superset of what `sample_tokens` keeps).
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    order = jnp.argsort(-z, axis=-1)
    sorted_z = jnp.take_along_axis(z, order, axis=-1)
    keep_sorted = jnp.ones_like(sorted_z, dtype=bool)
    if top_k > 0:
        kth = sorted_z[:, min(top_k, z.shape[-1]) - 1:min(top_k, z.shape[-1])]
        keep_sorted = sorted_z >= kth
        sorted_z = jnp.where(keep_sorted, sorted_z, -jnp.inf)
    keep_sorted = keep_sorted & top_p_keep(sorted_z, top_p)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)
