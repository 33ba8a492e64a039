"""Importance ratio and the policy-gradient surrogates: the clipped PPO surrogate (symmetric
clip, Clip-Higher, dual clip; token-, sequence- (GSPO) or GSPO-token-level ratio), CISPO
(clipped IS weight, MiniMax-M1), SAPO (soft sigmoid gate), and truncated importance weights
for sampler drift.

Each surrogate is one function returning a SurrogateOutput: its per-token loss [B, T] (zero where
mask == 0; reduce it with `aggregate_loss`), its SurrogateStats and its clip flags [B, T]:
ppo_clip_loss, cispo_loss, sapo_loss. clipped_surrogate, cispo_surrogate and sapo_surrogate are
the same functions returning (loss, stats). `core.surrogate_registry` names them for a Recipe.
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


class SurrogateOutput(NamedTuple):
    """What a surrogate returns.

    loss:    [B, T] float32 per-token loss, zero where mask == 0.
    stats:   SurrogateStats over the counted tokens.
    clipped: [B, T] bool, the counted tokens its clip binds: exactly those its stats'
             clip_frac + dual_clip_frac count (the loop's most-clipped-tokens report).
    """

    loss: chex.Array
    stats: SurrogateStats
    clipped: chex.Array


RATIO_LEVELS = ("token", "sequence", "sequence_token")
CISPO_CAP_MODES = ("relative", "absolute")


def _log_ratio(diff: chex.Array, logp: chex.Array, m: chex.Array, ratio_level: str) -> chex.Array:
    """[B, T] log importance ratio at `ratio_level` (see clipped_surrogate); diff = 0 where m == 0."""
    if ratio_level == "token":
        return jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    mean = jnp.sum(diff * m, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
    seq = jnp.clip(mean, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if ratio_level == "sequence":
        return jnp.broadcast_to(seq, diff.shape)
    # GSPO-token: the per-token gradient path exists only where the clamp does not bind, so that
    # beyond the clamp both levels have zero gradient (as the clip's own derivative gives GSPO)
    inside = jax.lax.stop_gradient(jnp.abs(mean) < LOG_RATIO_CLAMP)
    safe_logp = jnp.where((m > 0) & inside, logp, 0.0)
    return jax.lax.stop_gradient(seq) + safe_logp - jax.lax.stop_gradient(safe_logp)


def surrogate_stats(ratio: chex.Array, mask: chex.Array, log_ratio: chex.Array, low_clipped: chex.Array,
                    high_clipped: chex.Array, dual_clipped: chex.Array | None = None) -> SurrogateStats:
    """SurrogateStats over the counted tokens (mask > 0), for a surrogate of one's own.

    Args:
      ratio: [B, T] importance ratio r (no gradient is taken through the statistics).
      mask: [B, T] float mask of counted tokens.
      log_ratio: [B, T] logp - old_logp, 0 where mask == 0 (approx_kl is its masked mean, negated).
      low_clipped, high_clipped: [B, T] bool, tokens where the lower / upper bound binds.
      dual_clipped: [B, T] bool, tokens where the dual clip binds, or None (dual_clip_frac 0).
    """
    counted = mask > 0
    n = jnp.sum(mask)
    denom = jnp.maximum(n, 1.0)
    frac = lambda cond: jnp.sum(jnp.where(counted & cond, 1.0, 0.0)) / denom
    low, high = frac(low_clipped), frac(high_clipped)
    dual = frac(dual_clipped) if dual_clipped is not None else jnp.zeros((), jnp.float32)
    any_counted = n > 0
    return SurrogateStats(
        clip_frac_low=low,
        clip_frac_high=high,
        clip_frac=low + high,
        dual_clip_frac=dual,
        ratio_mean=jnp.where(any_counted, jnp.sum(ratio * mask) / denom, 1.0),
        ratio_min=jnp.where(any_counted, jnp.min(jnp.where(counted, ratio, jnp.inf)), 1.0),
        ratio_max=jnp.where(any_counted, jnp.max(jnp.where(counted, ratio, -jnp.inf)), 1.0),
        approx_kl=jax.lax.stop_gradient(-jnp.sum(log_ratio * mask) / denom),
        num_tokens=n,
    )


def broadcast_advantages(advantages: chex.Array, like: chex.Array) -> chex.Array:
    """[B] (one per response) or [B, T] advantages -> [B, T] float32, the shape of `like`."""
    if advantages.ndim == 1:
        chex.assert_equal_shape_prefix([advantages, like], 1)
        return jnp.broadcast_to(advantages[:, None], like.shape).astype(jnp.float32)
    chex.assert_equal_shape([advantages, like])
    return advantages.astype(jnp.float32)


def ppo_clip_loss(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: Literal["token", "sequence", "sequence_token"] = "token",
) -> SurrogateOutput:
    """L = max(-r·A, -clip(r, 1-eps_low, 1+eps_high)·A); with dual clip c: L = min(L, c·|A|) where A < 0.

    PPO (Schulman et al. 2017, arXiv 1707.06347); Clip-Higher = eps_high > eps_low (DAPO, Yu et
    al. 2025, arXiv 2503.14476); dual clip (Ye et al. 2020, arXiv 1912.09729, verl's
    clip_ratio_c = 3.0). Ratio levels (GSPO, Zheng et al. 2025, arXiv 2507.18071):
      "token":          r_t = exp(logp_t - old_logp_t).
      "sequence":       GSPO, s_i = exp(mean_t m·(logp - old_logp)) on every token of row i; the
                        gradient flows through the mean log-ratio, so token t's gradient mixes
                        the advantages of the whole row: -s_i·(1/|y_i|)·sum_t' A_t'.
      "sequence_token": GSPO-token (eq. 13), s_i,t = sg(s_i)·exp(logp_t - sg(logp_t)): the value
                        s_i on every token, the gradient per token: -s_i·A_t. With A constant
                        over a row both levels give the same loss and gradient, at any gap:
                        the mean log-ratio is clamped to ±LOG_RATIO_CLAMP (20) at both levels,
                        and where it binds (|mean| >= 20) the row gets zero gradient at both
                        levels (GSPO through the clamp's derivative, GSPO-token by dropping
                        its per-token path), whatever the advantages.
    Peers: verl's loss_mode="gspo" is the "sequence_token" form with the log-ratio clamped
    at +10 only (zero gradient above), no dual clip, and seq-mean-token-mean aggregation
    whatever loss_agg_mode says; ROLL's importance_sampling="seq" is "sequence" with no clamp.
    verl's vanilla loss always dual-clips (clip_ratio_c = 3.0); ours only when dual_clip is set.

    Args:
      logp: [B, T] log-probs of the sampled tokens under the policy being optimised.
      old_logp: [B, T] log-probs under the behaviour (rollout) policy; no gradient flows here.
      advantages: [B] (one per response) or [B, T].
      mask: [B, T] 1 for counted response tokens, 0 elsewhere.
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
      dual_clip: c > 1 bounds the loss of negative-advantage tokens by c·|A|, or None.
      ratio_level: "token" (PPO), "sequence" (GSPO) or "sequence_token" (GSPO-token).

    Returns:
      SurrogateOutput: loss [B, T] float32, zero where mask == 0; SurrogateStats; clipped [B, T]:
      (A < 0 and r < 1 - eps_low) or (A > 0 and r > 1 + eps_high) or (dual clip: A < 0 and
      r > c), r at `ratio_level` (GSPO: the row's sequence ratio on every token).
    """
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {ratio_level!r}.")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}.")
    m = mask.astype(jnp.float32)
    counted = m > 0
    adv = broadcast_advantages(advantages, logp)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))

    diff = jnp.where(counted, logp - old, 0.0)
    ratio = jnp.exp(_log_ratio(diff, logp, m, ratio_level))

    unclipped_loss = -adv * ratio
    clipped_loss = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped_loss, clipped_loss)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    loss = jnp.where(counted, loss, 0.0)

    r = jax.lax.stop_gradient(ratio)
    low = (adv < 0) & (r < 1.0 - eps_low)
    high = (adv > 0) & (r > 1.0 + eps_high)
    dual = (adv < 0) & (r > dual_clip) if dual_clip is not None else None
    clipped = low | high if dual is None else low | high | dual
    return SurrogateOutput(loss, surrogate_stats(r, m, diff, low, high, dual), counted & clipped)


def clipped_surrogate(logp: chex.Array, old_logp: chex.Array, advantages: chex.Array, mask: chex.Array, *,
                      eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                      ratio_level: Literal["token", "sequence", "sequence_token"] = "token",
                      ) -> tuple[chex.Array, SurrogateStats]:
    """(loss [B, T], SurrogateStats) of `ppo_clip_loss` (PPO / Clip-Higher / dual clip / GSPO / GSPO-token)."""
    loss, stats, _ = ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                                   dual_clip=dual_clip, ratio_level=ratio_level)
    return loss, stats


def cispo_bounds(eps_low: float, eps_high: float, cap_mode: str) -> tuple[float, float]:
    """CISPO's weight bounds (lo, hi): [1 - eps_low, 1 + eps_high] (relative) or [1 - eps_low, eps_high] (absolute)."""
    if cap_mode not in CISPO_CAP_MODES:
        raise ValueError(f"cap_mode must be one of {', '.join(CISPO_CAP_MODES)}, got {cap_mode!r}.")
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high if cap_mode == "relative" else eps_high
    if hi <= max(lo, 0.0):
        raise ValueError(f"CISPO upper bound {hi} ({cap_mode} eps_high={eps_high}) must exceed the lower bound {max(lo, 0.0)}.")
    return lo, hi


def cispo_loss(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
    cap_mode: Literal["relative", "absolute"] = "relative",
) -> SurrogateOutput:
    """L = -sg(clip(r, lo, hi))·A·logp, r = exp(logp - old_logp): CISPO, clipped IS-weight policy optimisation.

    MiniMax-M1 (MiniMax 2025, arXiv 2506.13585, eq. 4): the importance weight, not the token
    update, is clipped and detached, so every token keeps a gradient, -clip(r)·A per unit of
    logp (PPO gives 0 where its clip binds); at r = 1 it is the REINFORCE/PPO gradient -A.
    The paper sets no lower bound ("eps_low large") and tunes eps_high only. Bounds:
      cap_mode="relative": [1 - eps_low, 1 + eps_high]  (verl's CISPO: clip_ratio_low/high;
                           the paper's eps^IS_low/high). eps_low >= 1 means no lower bound.
      cap_mode="absolute": [1 - eps_low, eps_high]      (TRL's GRPOConfig(loss_type="cispo"):
                           `epsilon_high` is the cap itself, e.g. 5.0).
    The loss *value* is a pseudo-loss (it carries logp, not the ratio); only its gradient means
    something.

    Args:
      logp, old_logp: [B, T] current / behaviour-policy log-probs of the sampled tokens.
      advantages: [B] or [B, T].
      mask: [B, T] 1 for counted response tokens.
      eps_low: lower bound 1 - eps_low (>= 0; 1.0 = no lower bound, r > 0).
      eps_high: upper bound 1 + eps_high (relative) or eps_high itself (absolute).
      cap_mode: "relative" or "absolute" (see above).

    Returns:
      SurrogateOutput: loss [B, T] float32, zero where mask == 0; SurrogateStats with
      clip_frac_low / high = fraction of counted tokens whose weight hit the lower / upper bound,
      any advantage sign; clipped [B, T]: r outside [lo, hi] (`cispo_bounds`).
    """
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    lo, hi = cispo_bounds(eps_low, eps_high, cap_mode)
    m = mask.astype(jnp.float32)
    counted = m > 0
    adv = broadcast_advantages(advantages, logp)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    diff = jnp.where(counted, logp - old, 0.0)
    r = jax.lax.stop_gradient(jnp.exp(jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
    weight = jnp.clip(r, lo, hi)
    safe_logp = jnp.where(counted, logp, 0.0)
    loss = jnp.where(counted, -weight * adv * safe_logp, 0.0)
    low, high = r < lo, r > hi
    return SurrogateOutput(loss, surrogate_stats(r, m, diff, low, high), counted & (low | high))


def cispo_surrogate(logp: chex.Array, old_logp: chex.Array, advantages: chex.Array, mask: chex.Array, *,
                    eps_low: float = 1.0, eps_high: float = 4.0, cap_mode: Literal["relative", "absolute"] = "relative",
                    ) -> tuple[chex.Array, SurrogateStats]:
    """(loss [B, T], SurrogateStats) of `cispo_loss` (CISPO, MiniMax-M1)."""
    loss, stats, _ = cispo_loss(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                                cap_mode=cap_mode)
    return loss, stats


def sapo_gate(ratio: chex.Array, tau: chex.Array) -> chex.Array:
    """f(r) = (4 / tau)·sigmoid(tau·(r - 1)); f(1) = 2/tau, f'(1) = 1, f'(r) = 4·s·(1 - s) -> 0 as |r - 1| grows."""
    return (4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0))


def sapo_loss(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> SurrogateOutput:
    """L = -f_tau(r)·A, f_tau(r) = (4/tau)·sigmoid(tau·(r - 1)), tau = tau_pos if A > 0 else tau_neg: SAPO.

    Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347): a smooth,
    temperature-controlled gate replaces the hard clip. d L / d logp = -A·r·f'(r) with
    f'(r) = 4·sigmoid(tau(r-1))·(1 - sigmoid(tau(r-1))): equal to -A at r = 1 (the unclipped
    PPO / REINFORCE gradient), decaying smoothly (not to a hard 0) as r leaves 1, faster for a
    larger tau; tau_neg > tau_pos damps negative-advantage tokens more (the paper's choice,
    tau_pos = 1.0, tau_neg = 1.05 as in verl / Trinity-RFT defaults). Token-level ratio.
    The paper itself was not read here; the form above is the one public implementations of
    SAPO (verl, Trinity-RFT, torchforge) use, and the property f'(1) = 1 is tested.

    Args:
      logp, old_logp: [B, T] current / behaviour-policy log-probs of the sampled tokens.
      advantages: [B] or [B, T].
      mask: [B, T] 1 for counted response tokens.
      tau_pos, tau_neg: gate temperatures (> 0) for A > 0 and A <= 0.

    Returns:
      SurrogateOutput: loss [B, T] float32, zero where mask == 0; SurrogateStats, clip
      fractions 0; clipped all False (a soft gate clips nothing).
    """
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}.")
    m = mask.astype(jnp.float32)
    counted = m > 0
    adv = broadcast_advantages(advantages, logp)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    diff = jnp.where(counted, logp - old, 0.0)
    ratio = jnp.exp(jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    loss = jnp.where(counted, -sapo_gate(ratio, tau) * adv, 0.0)
    never = jnp.zeros(logp.shape, bool)
    return SurrogateOutput(loss, surrogate_stats(jax.lax.stop_gradient(ratio), m, diff, never, never), never)


def sapo_surrogate(logp: chex.Array, old_logp: chex.Array, advantages: chex.Array, mask: chex.Array, *,
                   tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[chex.Array, SurrogateStats]:
    """(loss [B, T], SurrogateStats) of `sapo_loss` (SAPO's soft gate)."""
    loss, stats, _ = sapo_loss(logp, old_logp, advantages, mask, tau_pos=tau_pos, tau_neg=tau_neg)
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


def clip_flags(logp: chex.Array, old_logp: chex.Array, advantages: chex.Array, mask: chex.Array, *,
               eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
               ratio_level: str = "token") -> chex.Array:
    """[B, T] bool: the counted tokens the PPO clip binds, `ppo_clip_loss(...).clipped` without a gradient.

    Another surrogate's flags are its own SurrogateOutput.clipped (for a Recipe:
    `core.surrogate_registry.apply_surrogate(recipe, ...).clipped`).
    """
    return ppo_clip_loss(jax.lax.stop_gradient(logp), old_logp, advantages, mask, eps_low=eps_low,
                         eps_high=eps_high, dual_clip=dual_clip, ratio_level=ratio_level).clipped
