"""Covariance-based entropy control: Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism
of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

The paper finds that policy entropy falls when tokens with a high covariance between their
log-prob and their advantage get trained; it leaves the bulk of tokens alone and acts on the few
with the largest covariance:

  Cov_t = (logp_t - mean(logp)) * (A_t - mean(A))        means over the counted tokens of the call

  Clip-Cov: among counted tokens with low < Cov_t < high (and not already clipped by the
            surrogate), pick max(1, floor(ratio * N)) at random; their surrogate gets no gradient.
  KL-Cov:   pick the max(1, floor(ratio * N)) tokens of largest Cov_t; add coef * |logp - old_logp|
            to their loss.

N is the number of counted tokens. The selection scope is the batch given to one loss call
(the train step's micro-batch, all data shards together), as in verl, where it is each rank's
micro-batch: the selection, and so the loss, depends on how the batch is split. Every function
is pure and the random pick is a function of the PRNG key only: the same key and inputs select
the same tokens.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

COV_CONTROLS = ("clip_cov", "kl_cov")


def token_covariance(logp: chex.Array, advantages: chex.Array, mask: chex.Array) -> chex.Array:
    """Cov_t = (logp_t - mean_m logp) * (A_t - mean_m A), without gradient.

    Args:
      logp: [B, T] current log-probs.
      advantages: [B] or [B, T].
      mask: [B, T] counted tokens (weights > 0 count); means are over them.

    Returns:
      [B, T] float32 per-token covariance terms (0 where mask == 0).
    """
    logp = jax.lax.stop_gradient(logp).astype(jnp.float32)
    adv = jnp.broadcast_to(advantages.reshape(advantages.shape[0], -1), logp.shape).astype(jnp.float32)
    m = (mask > 0).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    dl = logp - jnp.sum(logp * m) / n
    da = adv - jnp.sum(adv * m) / n
    return jax.lax.stop_gradient(dl * da * m)


def selection_count(mask: chex.Array, ratio: float) -> chex.Array:
    """k = max(1, floor(ratio * N)), N = counted tokens ([] int32; traced, so N may vary per batch)."""
    n = jnp.sum((mask > 0).astype(jnp.int32))
    return jnp.maximum(jnp.floor(ratio * n.astype(jnp.float32)).astype(jnp.int32), 1)


def top_k_mask(scores: chex.Array, eligible: chex.Array, k: chex.Array) -> chex.Array:
    """The min(k, #eligible) eligible entries of highest score; ties go to the lower flat index.

    Args:
      scores: [B, T] float.
      eligible: [B, T] bool.
      k: [] int (may be traced).

    Returns:
      [B, T] bool.
    """
    flat = jnp.where(eligible, scores.astype(jnp.float32), -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return ((rank < k) & eligible.reshape(-1)).reshape(scores.shape)


def clip_cov_mask(
    logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    key: chex.PRNGKey,
    *,
    ratio: float,
    low: float,
    high: float,
    exclude: chex.Array | None = None,
) -> chex.Array:
    """Clip-Cov's tokens: a uniform random pick of max(1, floor(ratio*N)) counted tokens with
    low < Cov_t < high, outside `exclude` (arXiv 2505.22617, Sec. 4.2; the exclusion of tokens the
    PPO clip already stops follows verl's implementation).

    Args:
      logp: [B, T]; advantages: [B] or [B, T]; mask: [B, T] counted tokens.
      key: PRNG key; the pick is a function of it.
      ratio: fraction of counted tokens to pick (the paper: 2e-4).
      low, high: the covariance band (the paper: 1 and 5).
      exclude: [B, T] bool tokens that may not be picked (e.g. core.surrogate.clip_flags), or None.

    Returns:
      [B, T] bool, the picked tokens (fewer than k when fewer are in the band).
    """
    cov = token_covariance(logp, advantages, mask)
    eligible = (mask > 0) & (cov > low) & (cov < high)
    if exclude is not None:
        eligible = eligible & ~exclude
    scores = jax.random.uniform(key, logp.shape)
    return top_k_mask(scores, eligible, selection_count(mask, ratio))


def kl_cov_mask(logp: chex.Array, advantages: chex.Array, mask: chex.Array, *, ratio: float) -> chex.Array:
    """KL-Cov's tokens: the max(1, floor(ratio*N)) counted tokens of largest Cov_t (arXiv
    2505.22617, Sec. 4.2). Args as clip_cov_mask (ratio: the paper's k, 2e-3 for 7B models).

    Returns:
      [B, T] bool.
    """
    cov = token_covariance(logp, advantages, mask)
    return top_k_mask(cov, mask > 0, selection_count(mask, ratio))


def kl_cov_penalty(logp: chex.Array, old_logp: chex.Array) -> chex.Array:
    """|logp - old_logp| [B, T], the KL-Cov term (gradient through logp)."""
    return jnp.abs(logp - old_logp)
