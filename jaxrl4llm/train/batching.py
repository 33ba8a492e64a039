"""Rollout -> TrainBatch: lay sampled responses out for teacher forcing.

    tokens    = concat(prompt_tokens, response_tokens)                 [N, P + R]
    mask      = concat(prompt_mask, response_mask)
    positions = max(cumsum(mask) - 1, 0)        (the positions the sampler used)
    inputs = tokens[:, :-1], targets = tokens[:, 1:]                   [N, L = P + R - 1]
    loss_mask[:, P - 1 + j] = response_mask[:, j]
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl4llm.core import AdvantageBatch
from jaxrl4llm.sampling import Rollout
from jaxrl4llm.train.step import TrainBatch


def _shift_response(x, prompt_len: int):
    """[N, R] response-aligned values -> [N, P + R - 1] target-aligned (zeros over the prompt)."""
    return jnp.concatenate([jnp.zeros((x.shape[0], prompt_len - 1), x.dtype), x], axis=1)


def rollout_to_batch(rollout: Rollout, adv: AdvantageBatch, *, sampler_logp=None) -> TrainBatch:
    """Builds the TrainBatch of a rollout; old_logp/ref_logp start as the sampler's untruncated
    log-probs (replace them with recomputed ones via `TrainBatch._replace`).

    Args:
      rollout: the sampler's Rollout (N rows).
      adv: core.compute_advantages output for the same N rows.
      sampler_logp: [N, R] sampler log-probs the mismatch corrections compare with (default
        rollout.logprobs_untruncated, the temperature-only distribution the trainer recomputes;
        rollout.logprobs for the distribution sampled from: Recipe.sampler_logp_kind="sampled").
    """
    p = rollout.prompt_tokens.shape[1]
    tokens = jnp.concatenate([rollout.prompt_tokens, rollout.response_tokens], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([rollout.prompt_mask, rollout.response_mask], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    untruncated = _shift_response(rollout.logprobs_untruncated.astype(jnp.float32), p)
    slogp = untruncated if sampler_logp is None else _shift_response(sampler_logp.astype(jnp.float32), p)
    return TrainBatch(
        input_tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        positions=positions[:, :-1],
        attention_mask=mask[:, :-1].astype(jnp.int32),
        loss_mask=_shift_response(rollout.response_mask.astype(jnp.float32), p),
        old_logp=untruncated,
        ref_logp=untruncated,
        sampler_logp=slogp,
        advantages=adv.advantages,
        row_weights=adv.row_weights,
        denominator_weights=adv.denominator_weights,
    )
