"""Importance ratio and the clipped PPO surrogate: symmetric clip, Clip-Higher, dual clip,
token- or sequence-level (GSPO) ratio, and truncated importance weights for sampler drift.

All functions return per-token values [B, T], zero where mask == 0; reduce them with
`aggregate_loss`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp

# verl clamps the log-ratio before exponentiating; we do the same so a masked or extreme
# token (|logp - old_logp| > 50) yields a finite ratio, loss and gradient.
LOG_RATIO_CLAMP = 20.0


class SurrogateStats(NamedTuple):
    """Statistics over the counted tokens (mask > 0) of one call. Means are over `num_tokens`.

    clip_frac_low:  fraction with A < 0 and r < 1 - eps_low  (the low bound binds only for A < 0)
    clip_frac_high: fraction with A > 0 and r > 1 + eps_high (the high bound binds only for A > 0)
    clip_frac:      clip_frac_low + clip_frac_high
    dual_clip_frac: fraction with A < 0 and r > dual_clip (0 when dual clip is off)
    ratio_mean / ratio_min / ratio_max: of r over counted tokens (1.0 when none counts)
    approx_kl:      masked mean of old_logp - logp (k1 estimate of KL(pi_old || pi))
    num_tokens:     number of counted tokens (to weight these means across micro-batches)
    """

    clip_frac_low: chex.Array
    clip_frac_high: chex.Array
    clip_frac: chex.Array
    dual_clip_frac: chex.Array
    ratio_mean: chex.Array
    ratio_min: chex.Array
    ratio_max: chex.Array
    approx_kl: chex.Array
    num_tokens: chex.Array


def _broadcast_advantages(advantages: chex.Array, like: chex.Array) -> chex.Array:
    if advantages.ndim == 1:
        chex.assert_equal_shape_prefix([advantages, like], 1)
        return jnp.broadcast_to(advantages[:, None], like.shape).astype(jnp.float32)
    chex.assert_equal_shape([advantages, like])
    return advantages.astype(jnp.float32)


def clipped_surrogate(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: Literal["token", "sequence"] = "token",
) -> tuple[chex.Array, SurrogateStats]:
    """L = max(-r·A, -clip(r, 1-eps_low, 1+eps_high)·A); with dual clip c: L = min(L, c·|A|) where A < 0.

    PPO (Schulman et al. 2017); Clip-Higher = eps_high > eps_low (DAPO, Yu et al. 2025);
    dual clip (Ye et al. 2020, verl's clip_ratio_c = 3.0); sequence-level ratio (GSPO, Zheng
    et al. 2025): s_i = exp(mean_t m·(logp - old_logp)) replaces r on every token of row i, and
    its gradient flows through the mean log-ratio (token form sg(s_i)·exp(logp - sg(logp))).

    Args:
      logp: [B, T] log-probs of the sampled tokens under the policy being optimised.
      old_logp: [B, T] log-probs under the behaviour (rollout) policy; no gradient flows here.
      advantages: [B] (one per response) or [B, T].
      mask: [B, T] 1 for counted response tokens, 0 elsewhere.
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
      dual_clip: c > 1 bounds the loss of negative-advantage tokens by c·|A|, or None.
      ratio_level: "token" (PPO) or "sequence" (GSPO).

    Returns:
      (loss [B, T] float32, zero where mask == 0; SurrogateStats).
    """
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}.")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}.")
    m = mask.astype(jnp.float32)
    counted = m > 0
    adv = _broadcast_advantages(advantages, logp)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))

    diff = jnp.where(counted, logp - old, 0.0)
    if ratio_level == "token":
        log_ratio = jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        seq = jnp.sum(diff * m, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
        seq = jnp.clip(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        safe_logp = jnp.where(counted, logp, 0.0)
        log_ratio = jax.lax.stop_gradient(seq) + safe_logp - jax.lax.stop_gradient(safe_logp)
    ratio = jnp.exp(log_ratio)

    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    loss = jnp.where(counted, loss, 0.0)

    r = jax.lax.stop_gradient(ratio)
    n = jnp.sum(m)
    denom = jnp.maximum(n, 1.0)
    frac = lambda cond: jnp.sum(jnp.where(counted & cond, 1.0, 0.0)) / denom
    low = frac((adv < 0) & (r < 1.0 - eps_low))
    high = frac((adv > 0) & (r > 1.0 + eps_high))
    dual = frac((adv < 0) & (r > dual_clip)) if dual_clip is not None else jnp.zeros((), jnp.float32)
    any_counted = n > 0
    stats = SurrogateStats(
        clip_frac_low=low,
        clip_frac_high=high,
        clip_frac=low + high,
        dual_clip_frac=dual,
        ratio_mean=jnp.where(any_counted, jnp.sum(r * m) / denom, 1.0),
        ratio_min=jnp.where(any_counted, jnp.min(jnp.where(counted, r, jnp.inf)), 1.0),
        ratio_max=jnp.where(any_counted, jnp.max(jnp.where(counted, r, -jnp.inf)), 1.0),
        approx_kl=jax.lax.stop_gradient(-jnp.sum(diff * m) / denom),
        num_tokens=n,
    )
    return loss, stats


def truncated_is_weights(trainer_logp: chex.Array, sampler_logp: chex.Array, cap: float = 2.0) -> chex.Array:
    """w = stop_gradient(min(exp(trainer_logp - sampler_logp), cap)).

    Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): the sampler (vLLM, or our JAX sampler in bf16) and
    the trainer assign slightly different log-probs to the same tokens; weighting each
    token's loss by the capped ratio corrects the gap. Multiply the per-token loss by w
    before aggregation.

    Args:
      trainer_logp: [B, T] behaviour-policy log-probs recomputed by the training model.
      sampler_logp: [B, T] log-probs the sampler reported for the same tokens.
      cap: upper truncation C (> 0).

    Returns:
      [B, T] float32 weights in [0, cap], finite for any gap.
    """
    chex.assert_equal_shape([trainer_logp, sampler_logp])
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}.")
    diff = trainer_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)
    diff = jnp.where(jnp.isnan(diff), 0.0, diff)
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(diff, jnp.log(cap))))
