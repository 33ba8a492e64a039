"""Rollout -> TrainBatch: lay sampled responses out for teacher forcing.

    tokens    = concat(prompt_tokens, response_tokens)                 [N, P + R]
    mask      = concat(prompt_mask, response_mask)
    positions = max(cumsum(mask) - 1, 0)        (the positions the sampler used)
    inputs = tokens[:, :-1], targets = tokens[:, 1:]                   [N, L = P + R - 1]
    loss_mask[:, P - 1 + j] = response_mask[:, j] * (1 - tool_mask[:, j])   (tool_mask 0 without tools)
    routes    = concat(prompt_routes[n // G], routes[n])[:-1]   (a rollout with recorded routes)

On several processes every array here is a global array spread over all hosts: each stage is
one jitted program (`merge_groups`, `batch_program`), never a run of eager ops, so every process
launches the same collectives in the same order.

Tool-integrated rollouts (`Rollout.tool_mask`): the tool's forced tokens are context, not actions.
They stay in `mask` (attention and positions: the sampler fed them at those positions) and leave
the loss mask, so their gradient is exactly 0 and every figure that counts the loss mask's tokens
(the aggregation's token counts, entropy, KL, `sampler_trainer_logp_gap`, the old / reference
log-prob passes, packing's per-sequence view) counts the model's own tokens only (ToRL's
`response_mask & tool_output_masks`, TRL's `completion_mask * tool_mask`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import AdvantageBatch
from jaxrl4llm.sampling import Rollout
from jaxrl4llm.train.step import TrainBatch


def _shift_response(x, prompt_len: int):
    """[N, R] response-aligned values -> [N, P + R - 1] target-aligned (zeros over the prompt)."""
    return jnp.concatenate([jnp.zeros((x.shape[0], prompt_len - 1), x.dtype), x], axis=1)


def rollout_routes(rollout: Rollout):
    """The expert ids of every fed token, aligned with the TrainBatch's input_tokens: [N, P + R - 1,
    layers, k] (the prompt's, shared by its G rows, then the response's), or None when the rollout
    carries no routes. prompt_routes holds one entry per prompt ([N / G, ...]) or per row ([N, ...])."""
    if rollout.routes is None:
        return None
    n = rollout.routes.shape[0]
    prompt = jnp.repeat(rollout.prompt_routes, n // rollout.prompt_routes.shape[0], axis=0)
    return jnp.concatenate([prompt, rollout.routes.astype(prompt.dtype)], axis=1)[:, :-1]


def loss_tokens(rollout: Rollout):
    """[N, R] float32: 1 on the response tokens the loss counts, response_mask * (1 - tool_mask): the
    model's own tokens (a rollout without tools: response_mask)."""
    mask = rollout.response_mask.astype(jnp.float32)
    return mask if rollout.tool_mask is None else mask * (1.0 - rollout.tool_mask.astype(jnp.float32))


def rollout_to_batch(rollout: Rollout, adv: AdvantageBatch, *, sampler_logp=None) -> TrainBatch:
    """Builds the TrainBatch of a rollout; old_logp/ref_logp start as the sampler's untruncated
    log-probs (replace them with recomputed ones via `TrainBatch._replace`); routes: the rollout's
    (`rollout_routes`), None when it has none; loss_mask: the model's own tokens (`loss_tokens`).

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
        loss_mask=_shift_response(loss_tokens(rollout), p),
        old_logp=untruncated,
        ref_logp=untruncated,
        sampler_logp=slogp,
        advantages=adv.advantages,
        row_weights=adv.row_weights,
        denominator_weights=adv.denominator_weights,
        routes=rollout_routes(rollout),
    )


def _left_pad(rollout: Rollout, width: int, pad_id: int) -> Rollout:
    """Prompts [N, P] -> [N, width] (more padding on the left; the responses are unchanged); prompt
    routes, if any, one per row (0 on the padding)."""
    n = rollout.prompt_tokens.shape[0]
    if rollout.prompt_routes is not None:
        routes = jnp.repeat(rollout.prompt_routes, n // rollout.prompt_routes.shape[0], axis=0)
        pad = jnp.zeros((n, width - routes.shape[1]) + routes.shape[2:], routes.dtype)
        rollout = rollout._replace(prompt_routes=jnp.concatenate([pad, routes], 1))
    extra = width - rollout.prompt_tokens.shape[1]
    if extra == 0:
        return rollout
    return rollout._replace(
        prompt_tokens=jnp.concatenate([jnp.full((n, extra), pad_id, rollout.prompt_tokens.dtype), rollout.prompt_tokens], 1),
        prompt_mask=jnp.concatenate([jnp.zeros((n, extra), rollout.prompt_mask.dtype), rollout.prompt_mask], 1),
    )


@functools.partial(jax.jit, static_argnames=("pad_id",))
def _take_rows(rollouts: tuple, rows: jax.Array, *, pad_id: int) -> Rollout:
    width = max(r.prompt_tokens.shape[1] for r in rollouts)
    stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[_left_pad(r, width, pad_id) for r in rollouts])
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), stacked)


def merge_groups(picks: list[tuple[Rollout, int]], group_size: int, pad_id: int) -> Rollout:
    """The groups `picks` = [(rollout of a draw, group index), ...], in that order, as one
    Rollout [len(picks) * G rows]; prompts left-padded to the widest draw's bucket.

    One jitted program (a row gather over the picked draws' concatenation); the rollout itself
    when the picks are all of one draw's groups in order (no dynamic-sampling redraw: no copy)."""
    draws = list({id(r): r for r, _ in picks}.values())  # each draw once, in first-pick order
    if len(draws) == 1 and [g for _, g in picks] == list(range(draws[0].num_rows // group_size)):
        return draws[0]
    starts = dict(zip(map(id, draws), np.cumsum([0] + [r.num_rows for r in draws])))
    rows = np.concatenate([np.arange(group_size) + starts[id(r)] + g * group_size for r, g in picks]).astype(np.int32)
    return _take_rows(tuple(draws), rows, pad_id=pad_id)


def batch_program(advantages_fn, shardings: TrainBatch, sampled_logp: bool):
    """jit of (rollout, rewards [N], void) -> (TrainBatch on `shardings`, AdvantageBatch): advantages
    and the teacher-forcing layout in one program, its output placed on the training mesh.

    The program takes (rollout, rewards [N], void [N] bool or None): void, the rows the void-turn
    filter drops (`train.tool_turns.void_rows`), None without the filter (the program of a run
    without it).

    Args:
      advantages_fn: (rewards [N], truncated [N], lengths [N], void [N] or None) -> AdvantageBatch
        (traced inside).
      shardings: TrainBatch of the training mesh's shardings (`step.batch_shardings`).
      sampled_logp: the corrections compare with rollout.logprobs (Recipe.sampler_logp_kind
        "sampled") instead of rollout.logprobs_untruncated.
    """
    def build(rollout: Rollout, rewards, void=None):
        adv = advantages_fn(rewards, rollout.truncated, rollout.lengths, void)
        batch = rollout_to_batch(rollout, adv, sampler_logp=rollout.logprobs if sampled_logp else None)
        return batch, adv

    return jax.jit(build, out_shardings=(shardings, None))
