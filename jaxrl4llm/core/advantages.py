"""Reward -> advantage: group / batch / mixed normalisation, RLOO, batch whitening.

Layout convention: a batch holds P prompts x G responses = B rows, the G responses of a
prompt adjacent (row b belongs to group b // G).

The study's normalisation ablation (Tricks or Traps, arXiv 2508.08221, Sec. 4.1) is the
choice of `mean` and `std` level in `normalize_advantages`:

    GRPO      mean="group", std="group"   (Shao et al. 2024, DeepSeekMath)
    Lite PPO  mean="group", std="batch"   (Tricks or Traps, the "robust" mix)
    Dr. GRPO  mean="group", std="none"    (Liu et al. 2025, Understanding R1-Zero)
    REINFORCE mean="none",  std="none"    (raw outcome reward)

`scale_rewards` is the study's reward-scale setting ({0, 1} vs {-1, 1}).
"""

from __future__ import annotations

from typing import Literal

import chex
import jax.numpy as jnp

Level = Literal["group", "batch", "none"]
_LEVELS = ("group", "batch", "none")


def check_group_layout(rewards: chex.Array, group_size: int) -> int:
    """Checks rewards is [B] with B a multiple of group_size; returns the number of groups P."""
    chex.assert_rank(rewards, 1)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
    batch = rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(
            f"rewards has {batch} rows, which is not a multiple of group_size={group_size}; "
            "a batch must hold whole groups (P prompts x G responses, adjacent)."
        )
    return batch // group_size


def _std(x: chex.Array, axis, ddof: int) -> chex.Array:
    """Std with `ddof`; a set of n <= ddof elements has std 0 (finite by definition)."""
    n = x.size if axis is None else x.shape[axis]
    if n <= ddof:
        return jnp.zeros_like(jnp.mean(x, axis=axis, keepdims=True))
    mean = jnp.mean(x, axis=axis, keepdims=True)
    var = jnp.sum(jnp.square(x - mean), axis=axis, keepdims=True) / (n - ddof)
    return jnp.sqrt(var)


def _masked_batch_stats(r: chex.Array, valid: chex.Array, ddof: int) -> tuple[chex.Array, chex.Array]:
    """(mean, std) of r [B] over the rows with valid > 0; std 0 over n <= ddof rows, mean 0 over none."""
    w = (valid > 0).astype(jnp.float32)
    n = jnp.sum(w)
    mu = jnp.sum(w * r) / jnp.maximum(n, 1.0)
    var = jnp.sum(w * jnp.square(r - mu)) / jnp.maximum(n - ddof, 1.0)
    return mu, jnp.where(n > ddof, jnp.sqrt(var), 0.0)


def normalize_advantages(
    rewards: chex.Array,
    group_size: int,
    *,
    mean: Level = "group",
    std: Level = "group",
    eps: float = 1e-6,
    ddof: int = 1,
    valid: chex.Array | None = None,
) -> chex.Array:
    """A = (r - mean) / (std + eps), with mean and std taken at the group, batch or no level.

    Tricks or Traps (arXiv 2508.08221), Sec. 4.1; GRPO = group/group, Lite PPO = group/batch,
    Dr. GRPO = group/none.

    Args:
      rewards: [B] float rewards, B = P * group_size, groups adjacent.
      group_size: G, responses per prompt (static).
      mean: "group" (mean of the row's group), "batch" (mean of all B rewards) or "none" (0).
      std: "group" (std of the group's raw rewards), "batch" (std of all B raw rewards, as
        ROLL and TRL compute it for Lite PPO) or "none" (divide by 1, and `eps` is not added).
      eps: added to the std before dividing.
      ddof: delta degrees of freedom of the std (1 = unbiased, as torch.std).
      valid: [B] rows that take part in the batch-level mean and std (> 0), or None (all).
        Dynamic sampling passes its mask: filler groups that only keep the batch shape (zero
        weight in the loss) must not shrink the batch std of the rows that train.

    Returns:
      [B] float32 advantages.

    Degenerate cases (finite by construction):
      * a group whose rewards are all equal has group-centred values exactly 0, so GRPO and
        Lite PPO give A = 0 on its rows (even when float rounding of the mean would not);
      * a group of size 1 with mean="group" gives A = 0 (no baseline to contrast with);
      * a std over n <= ddof values (a group of size 1) is 0, so A = (r - m) / eps;
      * an all-equal batch gives A = 0 for mean "group" or "batch".
    """
    if mean not in _LEVELS or std not in _LEVELS:
        raise ValueError(f"mean and std must each be one of {_LEVELS}, got mean={mean!r}, std={std!r}.")
    num_groups = check_group_layout(rewards, group_size)
    r = rewards.astype(jnp.float32)
    grouped = r.reshape(num_groups, group_size)

    if mean == "group":
        constant = jnp.max(grouped, axis=1, keepdims=True) == jnp.min(grouped, axis=1, keepdims=True)
        centred = jnp.where(constant, 0.0, grouped - jnp.mean(grouped, axis=1, keepdims=True))
    elif mean == "batch":
        constant = jnp.max(r) == jnp.min(r)
        batch_mean = jnp.mean(r) if valid is None else _masked_batch_stats(r, valid, ddof)[0]
        centred = jnp.where(constant, 0.0, grouped - batch_mean)
    else:
        centred = grouped

    if std == "group":
        scale = _std(grouped, axis=1, ddof=ddof) + eps
    elif std == "batch":
        batch_std = _std(r, axis=None, ddof=ddof) if valid is None else _masked_batch_stats(r, valid, ddof)[1]
        scale = batch_std.reshape(1, 1) + eps
    else:
        scale = jnp.ones((1, 1), jnp.float32)
    return (centred / scale).reshape(-1)


def scale_rewards(rewards: chex.Array, scale: float = 1.0, offset: float = 0.0) -> chex.Array:
    """r' = scale * r + offset, elementwise on [B] rewards (float32).

    The study's reward-scale setting (Tricks or Traps, arXiv 2508.08221, Sec. 4.1): a 0/1
    verifier reward becomes {-1, 1} with scale=2, offset=-1. For scale > 0, advantages with a
    std level ("group" / "batch") are unchanged up to `eps`, whereas std="none" (Dr. GRPO) scales
    by `scale`; an offset cancels wherever a mean level is taken.
    """
    return scale * jnp.asarray(rewards, jnp.float32) + offset


def rloo_advantages(rewards: chex.Array, group_size: int) -> chex.Array:
    """A_i = r_i - mean_{j != i} r_j (leave-one-out baseline) = G/(G-1) (r_i - mean_group).

    Kool et al. 2019 "Buy 4 REINFORCE samples"; Ahmadian et al. 2024 (RLOO for LLMs).

    Args:
      rewards: [B] rewards, B = P * group_size, groups adjacent.
      group_size: G (static). Groups of size 1 have no other sample: A = 0.

    Returns:
      [B] float32 advantages.
    """
    num_groups = check_group_layout(rewards, group_size)
    if group_size == 1:
        return jnp.zeros(rewards.shape, jnp.float32)
    grouped = rewards.astype(jnp.float32).reshape(num_groups, group_size)
    total = jnp.sum(grouped, axis=1, keepdims=True)
    baseline = (total - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


def batch_whiten(values: chex.Array, mask: chex.Array | None = None, *, eps: float = 1e-6) -> chex.Array:
    """x' = (x - masked_mean(x)) / (masked_std(x) + eps), masked entries set to 0.

    REINFORCE++ (Hu 2025, arXiv 2501.03262) whitens advantages over the whole batch.
    The std is the population std (ddof 0) over the counted entries.

    Args:
      values: [B] or [B, T] values.
      mask: same shape (1 = counted); None counts everything.

    Returns:
      float32 array of the shape of `values`; 0 where mask == 0 or when nothing counts.
    """
    x = values.astype(jnp.float32)
    m = jnp.ones_like(x) if mask is None else mask.astype(jnp.float32)
    chex.assert_equal_shape([x, m])
    count = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(x * m) / count
    var = jnp.sum(jnp.square(x - mean) * m) / count
    return jnp.where(m > 0, (x - mean) / (jnp.sqrt(var) + eps), 0.0)
