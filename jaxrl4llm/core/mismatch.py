"""Sampler-trainer mismatch corrections: per-token weights from pi_old / pi_sampler.

The sampler (vLLM, or our JAX sampler in bf16) and the trainer assign slightly different
log-probs to the same sampled tokens. With old_logp [B, T] the trainer's recomputed behaviour
log-probs and sampler_logp [B, T] the sampler's, every correction here returns a
`Correction(weights, touched)`:

  weights [B, T] float32, stop-gradient: multiply the per-token loss by it before aggregation.
          A weight of 0 removes the token's loss *and* its gradient.
  touched [B, T] bool: the counted tokens the correction changed (truncated or masked).

Let d_t = old_logp_t - sampler_logp_t (log of rho_t = pi_old / pi_sampler; 0 where mask == 0,
NaN -> 0, +-inf -> +-1e4) and S_i = sum_t m_t·d_t the row's log of prod_t rho_t.

  tis_token  w_t = min(rho_t, C)                         touched: rho_t > C       (truncated)
  tis_seq    w_i = min(exp(S_i), C) on every token of i  touched: exp(S_i) > C    (truncated)
  mis_token  w_t = rho_t if rho_t <= C else 0            touched: rho_t > C       (masked)
  mis_seq    w_i = exp(S_i) if exp(S_i) <= C else 0      touched: exp(S_i) > C    (masked)
  icepop     w_t = 1 if alpha <= rho_t <= beta else 0    touched: rho_t outside [alpha, beta]
  seq_mask   w_i = 0 if A_i < 0 and D_i > delta else 1,  D_i = mean_t m (sampler_logp - old_logp)

Sources: truncated IS, Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training" (fengyao.notion.site), and verl's rollout importance sampling
(`rollout_is`, token / sequence level, truncate / mask modes); MIS, the masked variant of the
same (verl's "mask" mode keeps the IS weight on the kept tokens, so do we); IcePop, Ring-1T
(inclusionAI, arXiv 2510.18855); off-policy sequence masking, DeepSeek-V3.2 (DeepSeek-AI 2025).

Every correction is row-local (a row's weights depend only on that row), so it is exact under
any split of the batch into micro-batches. Masked tokens keep counting in the loss
denominators (they are tokens with weight 0, as a truncated token is one with a smaller
weight): the denominators stay the ones `compute_advantages` fixed on the full batch (the
prompt weights of "prompt-mean-token-mean" need no recomputation), and a step that masks many
tokens makes a smaller update instead of up-weighting the tokens it kept.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl4llm.core.surrogate import truncated_is_weights

IS_CORRECTIONS = ("tis_token", "tis_seq", "mis_token", "mis_seq", "icepop", "seq_mask")
# Stand-in for an infinite log-ratio (a token one side gives probability 0): finite, and far
# beyond any cap's log.
_LOG_INF = 1e4


class Correction(NamedTuple):
    """weights [B, T] float32 (no gradient; 0 = masked) and touched [B, T] bool (counted tokens changed)."""

    weights: chex.Array
    touched: chex.Array


def _counted(mask: chex.Array) -> chex.Array:
    return mask > 0


def mismatch_log_ratio(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array) -> chex.Array:
    """d = old_logp - sampler_logp on counted tokens (0 elsewhere), NaN -> 0, +-inf -> +-1e4; no gradient."""
    chex.assert_rank([old_logp, sampler_logp, mask], 2)
    chex.assert_equal_shape([old_logp, sampler_logp, mask])
    d = old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)
    d = jnp.nan_to_num(d, nan=0.0, posinf=_LOG_INF, neginf=-_LOG_INF)
    return jax.lax.stop_gradient(jnp.where(_counted(mask), d, 0.0))


def _row_log_ratio(old_logp, sampler_logp, mask) -> chex.Array:
    """[B, 1] S_i = sum_t m·d_t, the log of the row's product of token ratios."""
    return jnp.sum(mismatch_log_ratio(old_logp, sampler_logp, mask), axis=1, keepdims=True)


def _check_cap(cap: float) -> float:
    if cap is None or not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}.")
    return math.log(cap)


def tis_token(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, cap: float) -> Correction:
    """w_t = min(pi_old_t / pi_sampler_t, C): token-level truncated IS (Yao et al. 2025; verl rollout_is, token, truncate).

    The weights are `truncated_is_weights` (the legacy `tis_cap` path): the same float32 formula,
    equal to within one ulp (XLA may evaluate exp differently inside a larger jitted program).
    touched: counted tokens whose ratio exceeds C.
    """
    log_cap = _check_cap(cap)
    w = truncated_is_weights(old_logp, sampler_logp, cap)
    d = mismatch_log_ratio(old_logp, sampler_logp, mask)
    return Correction(w, _counted(mask) & (d > log_cap))


def tis_sequence(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, cap: float) -> Correction:
    """w_i = min(prod_t pi_old_t / pi_sampler_t, C) = exp(min(S_i, log C)) on every token of row i.

    Sequence-level truncated IS (Yao et al. 2025; verl rollout_is, sequence level, truncate).
    The log S_i = sum_t m·(old_logp - sampler_logp) is clamped to log C before exp, so the
    weight is finite for any gap. touched: every counted token of rows with exp(S_i) > C.
    """
    log_cap = _check_cap(cap)
    s = _row_log_ratio(old_logp, sampler_logp, mask)
    w = jnp.broadcast_to(jnp.exp(jnp.minimum(s, log_cap)), mask.shape)
    return Correction(w, _counted(mask) & (s > log_cap))


def mis_token(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, cap: float) -> Correction:
    """w_t = rho_t·1[rho_t <= C], rho_t = pi_old_t / pi_sampler_t: token-level masked IS.

    Instead of truncating, a token whose ratio exceeds C is masked (weight 0, no loss, no
    gradient); kept tokens keep their IS weight rho_t (verl rollout_is "mask" mode; Yao et
    al.'s MIS). touched: the masked tokens.
    """
    log_cap = _check_cap(cap)
    d = mismatch_log_ratio(old_logp, sampler_logp, mask)
    over = d > log_cap
    w = jnp.where(over, 0.0, jnp.exp(jnp.minimum(d, log_cap)))
    return Correction(w, _counted(mask) & over)


def mis_sequence(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, cap: float) -> Correction:
    """w_i = rho_i·1[rho_i <= C], rho_i = prod_t pi_old_t / pi_sampler_t = exp(S_i): sequence-level masked IS.

    A row whose sequence ratio exceeds C leaves the loss (all its tokens weight 0); the other
    rows keep rho_i on every token (verl rollout_is, sequence level, "mask" mode). The log is
    clamped before exp. touched: every counted token of the masked rows.
    """
    log_cap = _check_cap(cap)
    s = _row_log_ratio(old_logp, sampler_logp, mask)
    over = s > log_cap
    w = jnp.broadcast_to(jnp.where(over, 0.0, jnp.exp(jnp.minimum(s, log_cap))), mask.shape)
    return Correction(w, _counted(mask) & over)


def icepop(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, low: float, high: float) -> Correction:
    """w_t = 1[alpha <= pi_old_t / pi_sampler_t <= beta]: IcePop's two-sided band mask.

    IcePop (Ring-1T, inclusionAI, arXiv 2510.18855): tokens whose training/inference
    probability ratio leaves [alpha, beta] are discarded from the update (loss and gradient);
    the rest keep weight 1 (a pure mask, not an IS weight: with weight rho_t in the band it
    would be a two-sided token MIS). touched: the masked tokens.

    Args:
      low, high: alpha >= 0 and beta > alpha (alpha = 0: no lower bound).
    """
    if not (low >= 0 and high > low):
        raise ValueError(f"IcePop needs 0 <= low < high, got low={low}, high={high}.")
    d = mismatch_log_ratio(old_logp, sampler_logp, mask)
    inside = d <= math.log(high)
    if low > 0:
        inside = inside & (d >= math.log(low))
    return Correction(inside.astype(jnp.float32), _counted(mask) & ~inside)


def seq_mask(
    old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array, advantages: chex.Array, delta: float
) -> Correction:
    """w_i = 0 if A_i < 0 and D_i > delta else 1, D_i = (1/|y_i|)·sum_t m·(sampler_logp - old_logp).

    DeepSeek-V3.2's off-policy sequence masking: a negative-advantage response whose sampling
    policy has drifted from the policy being trained is left out of the loss. D_i is the k1
    estimate of KL(pi_sampler || pi_old) on the row's own tokens (sampled from pi_sampler):
    the mean over the row's counted tokens (|y_i| = their number; D_i = 0 for an empty row) of
    log pi_sampler - log pi_old. DeepSeek compare the sampler with the policy being optimised;
    here pi_old is the trainer's recomputed behaviour policy, so only the sampler-trainer part
    of the drift is measured. Rows with A_i >= 0 are never masked. With [B, T] advantages the
    test A < 0 is per token (D_i stays the row's). touched: the masked counted tokens.
    """
    counted = _counted(mask)
    d = mismatch_log_ratio(old_logp, sampler_logp, mask)
    n = jnp.sum(counted, axis=1, keepdims=True).astype(jnp.float32)
    div = -jnp.sum(d, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
    if advantages.ndim == 1:
        chex.assert_equal_shape_prefix([advantages, mask], 1)
        adv = advantages[:, None]
    else:
        chex.assert_equal_shape([advantages, mask])
        adv = advantages
    masked = jax.lax.stop_gradient(adv.astype(jnp.float32)) < 0
    masked = jnp.broadcast_to(masked & (div > delta), mask.shape)
    return Correction(jnp.where(masked, 0.0, 1.0), counted & masked)


def mismatch_correction(
    kind: str,
    old_logp: chex.Array,
    sampler_logp: chex.Array,
    mask: chex.Array,
    *,
    advantages: chex.Array | None = None,
    cap: float | None = None,
    low: float | None = None,
    high: float | None = None,
    delta: float | None = None,
) -> Correction:
    """Dispatch on kind (one of IS_CORRECTIONS): cap for tis_*/mis_*, low/high for icepop, advantages/delta for seq_mask."""
    if kind == "tis_token":
        return tis_token(old_logp, sampler_logp, mask, cap)
    if kind == "tis_seq":
        return tis_sequence(old_logp, sampler_logp, mask, cap)
    if kind == "mis_token":
        return mis_token(old_logp, sampler_logp, mask, cap)
    if kind == "mis_seq":
        return mis_sequence(old_logp, sampler_logp, mask, cap)
    if kind == "icepop":
        return icepop(old_logp, sampler_logp, mask, low, high)
    if kind == "seq_mask":
        if advantages is None or delta is None:
            raise ValueError("seq_mask needs advantages and delta.")
        return seq_mask(old_logp, sampler_logp, mask, advantages, delta)
    raise ValueError(f"kind must be one of {', '.join(IS_CORRECTIONS)}, got {kind!r}.")


TOKEN_BANDS = {"out_10": (0.9, 1.1), "out_1": (0.99, 1.01)}  # agreement_stats: token-ratio bands, by name
SEQUENCE_BAND = (0.5, 2.0)  # agreement_stats: rows whose product of token ratios leaves [0.5, 2]


def agreement_stats(old_logp: chex.Array, sampler_logp: chex.Array, mask: chex.Array,
                    sequence_ids: chex.Array | None = None, num_sequences: int | None = None) -> dict[str, chex.Array]:
    """How far the trainer's log-probs are from the sampler's on the counted tokens (issue #39).

    With d_t = old_logp_t - sampler_logp_t (`mismatch_log_ratio`) and rho_t = exp(d_t):
      out_10 / out_1: share of counted tokens with rho_t outside [0.9, 1.1] / [0.99, 1.01]
      max_abs, mean_abs: max_t |d_t|, mean_t |d_t|
      seq_out: share of sequences with exp(S_i) outside [0.5, 2], S_i = sum_t m_t d_t
      tokens: the counted tokens.
    old_logp, sampler_logp, mask [B, T]. sequence_ids [B, T] int in [0, num_sequences) on the
    counted tokens (packed rows hold several sequences); None: each row is one sequence.
    Band edges are ratios (0.9 and 1.1, not a symmetric log band), as IcePop's [alpha, beta]
    (Ring-1T, arXiv 2510.18855). Scalars float32; jit with num_sequences static.
    """
    d = mismatch_log_ratio(old_logp, sampler_logp, mask)
    counted = _counted(mask)
    n = jnp.maximum(jnp.sum(counted), 1)
    share = lambda outside: jnp.sum(outside & counted) / n
    band = lambda lo, hi: share((d < math.log(lo)) | (d > math.log(hi)))
    if sequence_ids is None:
        s = jnp.sum(d, axis=1)
        real = jnp.any(counted, axis=1)
    else:
        ids = jnp.where(counted, sequence_ids, num_sequences).reshape(-1)  # padding -> a dropped extra segment
        s = jax.ops.segment_sum(d.reshape(-1), ids, num_segments=num_sequences + 1)[:num_sequences]
        real = jax.ops.segment_sum(counted.reshape(-1).astype(jnp.int32), ids, num_segments=num_sequences + 1
                                   )[:num_sequences] > 0
    seq_out = (s < math.log(SEQUENCE_BAND[0])) | (s > math.log(SEQUENCE_BAND[1]))
    return {
        "tokens": jnp.sum(counted),
        **{name: band(*edges) for name, edges in TOKEN_BANDS.items()},
        "max_abs": jnp.max(jnp.where(counted, jnp.abs(d), 0.0)),
        "mean_abs": jnp.sum(jnp.abs(d)) / n,
        "seq_out": jnp.sum(seq_out & real) / jnp.maximum(jnp.sum(real), 1),
    }
