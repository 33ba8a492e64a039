"""Row filters and reward shaping on response level: overlong filtering, DAPO's soft overlong
penalty, DAPO's dynamic-sampling group mask, and SimpleTIR's void-turn filter.

Overlong filtering removes truncated rows from the *loss* only; advantage statistics still see
them (Tricks or Traps, arXiv 2508.08221, Sec. 4.4).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

from jaxrl4llm.core.advantages import check_group_layout


def overlong_filter_mask(truncated: chex.Array) -> chex.Array:
    """keep = 1 - truncated: 0 for responses cut at the length limit (no EOS), 1 otherwise.

    Args:
      truncated: [B] bool or 0/1.

    Returns:
      [B] float32 loss-row mask factor.
    """
    chex.assert_rank(truncated, 1)
    return 1.0 - truncated.astype(jnp.float32)


def void_turn_filter_mask(void: chex.Array) -> chex.Array:
    """keep = 1 - void: 0 for tool-integrated responses whose last turn wrote neither code nor an
    answer (a "void turn"), 1 otherwise (SimpleTIR, arXiv 2509.02479, `--mask_void_turns`: such
    trajectories are dropped from the update; with overlong filtering's rule, from the loss only,
    the advantage statistics still see them). The flags come from the text on the host
    (`tools.protocol.is_void_turn`).

    Args:
      void: [B] bool or 0/1.

    Returns:
      [B] float32 loss-row mask factor.
    """
    chex.assert_rank(void, 1)
    return 1.0 - void.astype(jnp.float32)


def overlong_soft_penalty(
    lengths: chex.Array,
    *,
    max_length: int,
    buffer_length: int,
    penalty: float = 1.0,
) -> chex.Array:
    """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13), added to the rewards.

        R(L) = 0                                   if L <= Lmax - Lbuf
             = ((Lmax - Lbuf) - L) / Lbuf * p      if Lmax - Lbuf < L <= Lmax
             = -p                                  if L > Lmax

    Args:
      lengths: [B] response lengths in tokens.
      max_length: Lmax, the expected maximum length.
      buffer_length: Lbuf > 0, the punishment interval before Lmax.
      penalty: p, the penalty at (and beyond) Lmax.

    Returns:
      [B] float32 penalties in [-p, 0].
    """
    chex.assert_rank(lengths, 1)
    if buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length, got buffer_length={buffer_length}, max_length={max_length}.")
    length = lengths.astype(jnp.float32)
    start = float(max_length - buffer_length)
    ramp = (start - length) / float(buffer_length) * penalty
    return jnp.where(length <= start, 0.0, jnp.where(length <= max_length, ramp, -penalty))


def dynamic_sampling_mask(rewards: chex.Array, group_size: int) -> chex.Array:
    """keep_b = 1 if the rewards of row b's group are not all equal, else 0 (DAPO dynamic sampling).

    A group where every response got the same reward has zero group-centred advantage and
    contributes no policy gradient; DAPO over-samples and drops such groups.

    Args:
      rewards: [B] rewards, groups of `group_size` adjacent rows.
      group_size: G (static).

    Returns:
      [B] float32 0/1 mask, constant within each group.
    """
    num_groups = check_group_layout(rewards, group_size)
    grouped = rewards.reshape(num_groups, group_size)
    varied = jnp.max(grouped, axis=1) != jnp.min(grouped, axis=1)
    return jnp.repeat(varied.astype(jnp.float32), group_size)
