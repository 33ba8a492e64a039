"""Per-token loss [B, T] -> (numerator, denominator): token-level and sequence-level aggregation.

Returning a pair instead of a scalar keeps gradient accumulation and data parallelism exact:
a train step sums numerators and denominators over micro-batches and devices and divides
once, so a batch split into k micro-batches has exactly the loss (and gradient) of the
whole batch, for every mode (the pattern of tunix's algo_core).

Modes (Tricks or Traps, arXiv 2508.08221, Sec. 4.3; verl's loss_agg_mode names):
  "token-mean"              sum_bt l·m / sum_bt m                          (DAPO, Lite PPO)
  "seq-mean-token-mean"     mean_b [ sum_t l·m / sum_t m ]                 (GRPO)
  "seq-mean-token-sum"      mean_b [ sum_t l·m ]
  "seq-mean-token-sum-norm" mean_b [ sum_t l·m / norm_length ]             (Dr. GRPO, the paper)
  "seq-sum-token-sum-norm"  sum_b [ sum_t l·m ] / norm_length              (verl's and ROLL's
                                                                            seq-mean-token-sum-norm)
  "prompt-mean-token-mean"  mean_p [ sum_{b in p, t} l·m / sum_{b in p, t} m ]  (ScaleRL)
Sequence means run over rows with at least one counted token; rows with row_weights == 0 are
also left out of the denominator.

The two "-norm" modes differ by a batch-size factor. Dr. GRPO (Liu et al. 2025, arXiv
2503.20783, its objective) writes 1/G sum_i 1/MAX_TOKENS sum_t: a mean over the responses,
which we keep as "seq-mean-token-sum-norm" (the default, and TRL's loss_type="dr_grpo").
verl's and ROLL's mode of that name (`agg_loss`) sums over the rows of the call and divides by
the length only, with no mean over rows: on loss [[1, 2, 0], [3, 0, 0]], mask
[[1, 1, 0], [1, 0, 0]], norm_length 3 ours gives (3/3 + 3/3) / 2 = 1.0 and theirs 6/3 = 2.0.
Their convention is "seq-sum-token-sum-norm" here.
It is a sum, not a mean, so its denominator is no count: it is the share of the optimizer
step's rows this call holds, `rows / total_rows`, and the shares of the micro-batches of one
step add up to 1 (pass total_rows, the step's row count, when a call holds part of the step;
the train step does). The loss, its gradient and what gradient clipping sees then grow with
the number of rows per optimizer step.

"prompt-mean-token-mean" (ScaleRL, Khatri et al. 2025, arXiv 2510.13786): token-mean within
each prompt's group of G rows, then mean over prompts. It is a token-mean with per-row weight
w_b = 1 / N_g(b) (N_g = counted tokens of row b's group): numerator sum_b w_b·sum_t l·m,
denominator sum_b w_b·sum_t m (= the number of prompts with a counted token). The weights need
the whole group, which a strided micro-batch does not hold: compute them once on the full
batch with `prompt_weights` (compute_advantages does, into denominator_weights) and pass them
as row_weights; then micro-batch sums are exact like the other modes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import chex
import jax.numpy as jnp

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-sum-token-sum-norm",
    "prompt-mean-token-mean",
]
AGGREGATION_MODES = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-sum-token-sum-norm",
    "prompt-mean-token-mean",
)
PROMPT_MODES = ("prompt-mean-token-mean",)
# modes that divide by the constant norm_length
NORM_MODES = ("seq-mean-token-sum-norm", "seq-sum-token-sum-norm")
# sums over rows (no mean): the denominator is the call's share of the optimizer step's rows
ROW_SUM_MODES = ("seq-sum-token-sum-norm",)


def prompt_weights(token_counts: chex.Array, group_size: int, row_weights: chex.Array | None = None) -> chex.Array:
    """w_b = [row_weights_b > 0] / N_g(b), N_g = sum_{b' in g, row_weights_b' > 0} token_counts_b' (0 if N_g = 0).

    The per-row weights of "prompt-mean-token-mean" (ScaleRL, arXiv 2510.13786), computed once
    on the full rollout batch so that any split into micro-batches sums to the full-batch loss.

    Args:
      token_counts: [B] counted response tokens per row (the loss mask's row sums).
      group_size: G (static); groups are G adjacent rows.
      row_weights: [B] 0/1, rows with 0 leave their prompt's mean (and the loss), or None.

    Returns:
      [B] float32 weights.
    """
    chex.assert_rank(token_counts, 1)
    b = token_counts.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} rows is not a whole number of groups of group_size={group_size}.")
    keep = jnp.ones((b,), jnp.float32) if row_weights is None else (row_weights > 0).astype(jnp.float32)
    counts = token_counts.astype(jnp.float32) * keep
    group = jnp.sum(counts.reshape(b // group_size, group_size), axis=1)
    per_row = jnp.repeat(group, group_size)
    return jnp.where(per_row > 0, keep / jnp.maximum(per_row, 1.0), 0.0)


class LossTerms(NamedTuple):
    """A loss as numerator / denominator; sum both over micro-batches/devices, divide once."""

    numerator: chex.Array
    denominator: chex.Array

    @property
    def value(self) -> chex.Array:
        """numerator / denominator, and 0 when nothing counts (denominator 0)."""
        return jnp.where(self.denominator > 0, self.numerator / jnp.maximum(self.denominator, 1e-30), 0.0)

    def __add__(self, other: "LossTerms") -> "LossTerms":  # type: ignore[override]
        return LossTerms(self.numerator + other.numerator, self.denominator + other.denominator)


def aggregate_loss(
    loss: chex.Array,
    mask: chex.Array,
    mode: AggregationMode,
    *,
    norm_length: float | None = None,
    row_weights: chex.Array | None = None,
    group_size: int | None = None,
    total_rows: int | None = None,
    rows: int | None = None,
) -> LossTerms:
    """Reduces per-token losses to LossTerms(numerator, denominator) for `mode` (see module doc).

    Args:
      loss: [B, T] per-token loss.
      mask: [B, T] 1 for counted tokens.
      mode: one of AGGREGATION_MODES (static).
      norm_length: the constant divisor of the "-norm" modes (Dr. GRPO uses the maximum
        response length; verl's `actor.loss_scale_factor`, default the padded response
        length); required for those modes only.
      row_weights: [B] 0/1; rows with weight 0 stay out of every denominator (e.g. groups
        whose rewards are all equal, which carry no advantage signal). Their numerator
        contribution is kept. For "prompt-mean-token-mean": the per-row prompt weights
        from `prompt_weights` (they scale numerator and denominator; weight 0 removes the row).
        "seq-sum-token-sum-norm" has no count to leave: its denominator ignores them.
      group_size: "prompt-mean-token-mean" without row_weights: computes prompt_weights from
        this call's mask (exact only when the call holds whole groups).
      total_rows: "seq-sum-token-sum-norm" only (static): the rows of the optimizer step this
        call is a part of (a micro-batch's step); the denominator is B / total_rows. Default
        B (denominator 1: the call is the whole step).
      rows: "seq-sum-token-sum-norm" only: the rows this call really holds when some of its B
        rows are empty slots (a packed micro-batch, train/packing.py; a traced count is fine);
        default B.

    Returns:
      LossTerms of float32 scalars; `.value` is the loss.
    """
    chex.assert_rank([loss, mask], 2)
    chex.assert_equal_shape([loss, mask])
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}.")
    m = mask.astype(jnp.float32)
    if mode in PROMPT_MODES:
        if row_weights is None:
            if group_size is None:
                raise ValueError(
                    f"mode {mode!r} needs row_weights=prompt_weights(...) computed on the full batch, or group_size."
                )
            row_weights = prompt_weights(jnp.sum(m, axis=1), group_size)
        w = row_weights.astype(jnp.float32)
        chex.assert_shape(w, loss.shape[:1])
        masked = jnp.where(m > 0, loss.astype(jnp.float32) * m, 0.0)
        return LossTerms(jnp.sum(jnp.sum(masked, axis=1) * w), jnp.sum(jnp.sum(m, axis=1) * w))
    weights = jnp.ones(loss.shape[:1], jnp.float32) if row_weights is None else row_weights.astype(jnp.float32)
    chex.assert_shape(weights, loss.shape[:1])
    masked = jnp.where(m > 0, loss.astype(jnp.float32) * m, 0.0)
    row_sum = jnp.sum(masked, axis=1)
    row_count = jnp.sum(m, axis=1)
    row_counts_in_den = jnp.where((row_count > 0) & (weights > 0), 1.0, 0.0)

    if mode == "token-mean":
        return LossTerms(jnp.sum(row_sum), jnp.sum(row_count * (weights > 0)))
    if mode in NORM_MODES and (norm_length is None or norm_length <= 0):
        raise ValueError(f"mode {mode!r} needs norm_length > 0, e.g. the max response length.")
    if mode in ROW_SUM_MODES:
        held = loss.shape[0] if rows is None else rows
        total = loss.shape[0] if total_rows is None else total_rows
        if rows is None and total < held:
            raise ValueError(f"total_rows={total_rows} is fewer than this call's {held} rows.")
        return LossTerms(jnp.sum(row_sum) / norm_length, jnp.asarray(held, jnp.float32) / total)
    if mode == "seq-mean-token-mean":
        per_row = jnp.where(row_count > 0, row_sum / jnp.maximum(row_count, 1.0), 0.0)
    elif mode == "seq-mean-token-sum":
        per_row = row_sum
    else:
        per_row = row_sum / norm_length
    return LossTerms(jnp.sum(per_row), jnp.sum(row_counts_in_den))
