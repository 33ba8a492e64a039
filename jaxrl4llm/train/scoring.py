"""Rewards of a rollout's rows on the host: each process scores the rows its chips hold.

    rewards [N] = gather(reward_fn(decode(rows held here), golds of those rows))

The verifier (sympy, `jaxrl4llm.rewards`) is the loop's host-side cost: on a pod each host
scores its share of the rows instead of every host scoring all of them, and the gathered
vector is the same on every process (`hosts.gather_rows`). A `train.reward_fn.RewardFn` also
gets each row's problem text and metadata, and its failures are gathered and counted.
"""

from __future__ import annotations

import numpy as np

from jaxrl4llm.train import hosts
from jaxrl4llm.train.reward_fn import RewardFn


def score_rows(policy, rollout, golds: list[str], reward_fn, problems: list[str] | None = None,
               metadata: list[dict] | None = None, counted: int | None = None) -> np.ndarray:
    """Rewards [N] of a rollout's rows, the same vector on every process: each process decodes
    and scores only the rows its chips hold (`hosts.local_rows`), then they are gathered.

    golds, problems, metadata: one per row [N]. A plain reward_fn(responses, golds) -> floats
    gets the golds only; a RewardFn gets all three and counts its failures over all processes,
    in the first `counted` rows (default all; evaluation's padding repeats are not counted)."""
    rows, tokens = hosts.local_rows(rollout.response_tokens)
    _, lengths = hosts.local_rows(rollout.lengths)
    texts = policy.decode_rows([t[:n].tolist() for t, n in zip(tokens, lengths)])
    local_golds = [golds[i] for i in rows]
    if not isinstance(reward_fn, RewardFn):
        local = np.asarray(reward_fn(texts, local_golds), np.float32)
        return hosts.gather_rows(rows, local, rollout.num_rows)
    pick = lambda values: None if values is None else [values[i] for i in rows]
    scores = reward_fn(texts, local_golds, pick(problems), pick(metadata))
    failed = np.asarray([e is not None for e in scores.errors], np.float32)
    counted = rollout.num_rows if counted is None else counted
    failed_rows = hosts.gather_rows(rows, failed, rollout.num_rows)[:counted]
    first = next((e for i, e in zip(rows, scores.errors) if e and i < counted), None)
    reward_fn.count(int(failed_rows.sum()), counted, first)
    return hosts.gather_rows(rows, np.asarray(scores.rewards, np.float32), rollout.num_rows)
