"""The trainer's batch: a rollout laid out for teacher forcing, one row per response
(`train.batching.rollout_to_batch` builds it; `train.packing` packs it; `train.step` trains on it)."""

from __future__ import annotations

from typing import NamedTuple

import chex


class TrainBatch(NamedTuple):
    """A rollout batch laid out for teacher forcing; rows are responses, L = prompt + response - 1.

    input_tokens [B, L] int32: tokens fed to the model (prompt + response, minus the last).
    targets [B, L] int32: the next token at every position.
    positions [B, L] int32: position ids (0 at each row's first real token).
    attention_mask [B, L]: 1 on real (non-padding) tokens.
    loss_mask [B, L] float32: 1 where the target is a counted response token.
    old_logp, ref_logp, sampler_logp [B, L] float32: behaviour, reference, sampler log-probs.
    advantages, row_weights, denominator_weights [B] float32: from core.compute_advantages.
    routes [B, L, layers, k] (router replay, `trainer.router_replay: rollout`; else None): the
        expert ids the sampler ran for the token fed at each position (input_tokens[:, i]'s),
        replayed by the log-prob and update passes (`models.score_tokens(routes=)`).
    teacher_logp [B, L] float32 (on-policy distillation, a `teacher.model`; else None): the
        teacher's log-probs of the targets (0 off the loss mask), from its own log-prob pass
        (train/teacher.py); the update turns them into the distillation advantage (train/step.py).
    """

    input_tokens: chex.Array
    targets: chex.Array
    positions: chex.Array
    attention_mask: chex.Array
    loss_mask: chex.Array
    old_logp: chex.Array
    ref_logp: chex.Array
    sampler_logp: chex.Array
    advantages: chex.Array
    row_weights: chex.Array
    denominator_weights: chex.Array
    routes: chex.Array | None = None
    teacher_logp: chex.Array | None = None
