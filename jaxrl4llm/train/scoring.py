"""Rewards of a rollout's rows on the host: each process scores the rows its chips hold.

    rewards [N] = gather(reward_fn(decode(rows held here), golds of those rows))

The verifier (sympy, `jaxrl4llm.rewards`) is the loop's host-side cost: on a pod each host
scores its share of the rows instead of every host scoring all of them, and the gathered
vector is the same on every process (`hosts.gather_rows`). A `train.reward_fn.RewardFn` (or a
WeightedRewardFn, `reward.fns`) also gets each row's problem text and metadata, and its failures
are gathered and counted; `score_rows_with_components` also returns a weighted list's entries'
own rewards, gathered the same way:

    scored = score_rows_with_components(policy, rollout, golds, reward_fn, problems, metadata)
    scored.rewards [N], scored.components {name: [N]}   ({} for a single reward.fn)

With tools (`Rollout.tool_mask`) the reward reads the model's own tokens only (`sampling.model_tokens`:
the tool's output spans removed), so a ``\\boxed{}`` that the code printed earns nothing unless the
model writes the answer itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxrl4llm.sampling.rollout import model_tokens
from jaxrl4llm.train import hosts
from jaxrl4llm.train.reward_fn import CountedReward


class RowScores(NamedTuple):
    """A rollout's rewards [N] and each `reward.fns` entry's own (unweighted) rewards {name: [N]}."""

    rewards: np.ndarray
    components: dict


def score_rows(policy, rollout, golds: list[str], reward_fn, problems: list[str] | None = None,
               metadata: list[dict] | None = None, counted: int | None = None) -> np.ndarray:
    """Rewards [N] of a rollout's rows (`score_rows_with_components` without the components)."""
    return score_rows_with_components(policy, rollout, golds, reward_fn, problems, metadata, counted).rewards


def score_rows_with_components(policy, rollout, golds: list[str], reward_fn, problems: list[str] | None = None,
               metadata: list[dict] | None = None, counted: int | None = None) -> RowScores:
    """Rewards [N] of a rollout's rows (and a weighted list's components {name: [N]}, else {}), the
    same on every process: each process decodes (the model's tokens: `model_tokens`)
    and scores only the rows its chips hold (`hosts.local_rows`), then they are gathered.

    golds, problems, metadata: one per row [N]. A plain reward_fn(responses, golds) -> floats
    gets the golds only; a RewardFn (or WeightedRewardFn) gets all three and counts its failures over all processes,
    in the first `counted` rows (default all; evaluation's padding repeats are not counted)."""
    rows, tokens = hosts.local_rows(rollout.response_tokens)
    _, lengths = hosts.local_rows(rollout.lengths)
    tool = [None] * len(rows) if rollout.tool_mask is None else hosts.local_rows(rollout.tool_mask)[1]
    texts = policy.decode_rows([model_tokens(t, n, m) for t, n, m in zip(tokens, lengths, tool)])
    local_golds = [golds[i] for i in rows]
    if not isinstance(reward_fn, CountedReward):
        local = np.asarray(reward_fn(texts, local_golds), np.float32)
        return RowScores(hosts.gather_rows(rows, local, rollout.num_rows), {})
    pick = lambda values: None if values is None else [values[i] for i in rows]
    scores = reward_fn(texts, local_golds, pick(problems), pick(metadata))
    failed = np.asarray([e is not None for e in scores.errors], np.float32)
    counted = rollout.num_rows if counted is None else counted
    failed_rows = hosts.gather_rows(rows, failed, rollout.num_rows)[:counted]
    first = next((e for i, e in zip(rows, scores.errors) if e and i < counted), None)
    reward_fn.count(int(failed_rows.sum()), counted, first)
    components = {name: hosts.gather_rows(rows, np.asarray(values, np.float32), rollout.num_rows)
                  for name, values in scores.components.items()}
    return RowScores(hosts.gather_rows(rows, np.asarray(scores.rewards, np.float32), rollout.num_rows), components)
