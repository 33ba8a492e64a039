"""Rewards of a rollout's rows on the host: each process scores the rows its chips hold.

    rewards [N] = gather(reward_fn(decode(rows held here), golds of those rows))

The verifier (sympy, `jaxrl4llm.rewards`) is the loop's host-side cost: on a pod each host
scores its share of the rows instead of every host scoring all of them, and the gathered
vector is the same on every process (`hosts.gather_rows`).
"""

from __future__ import annotations

import numpy as np

from jaxrl4llm.train import hosts


def score_rows(policy, rollout, golds: list[str], reward_fn) -> np.ndarray:
    """Rewards [N] of a rollout's rows, the same vector on every process: each process decodes
    and scores only the rows its chips hold (`hosts.local_rows`), then they are gathered."""
    rows, tokens = hosts.local_rows(rollout.response_tokens)
    _, lengths = hosts.local_rows(rollout.lengths)
    texts = policy.decode_rows([t[:n].tolist() for t, n in zip(tokens, lengths)])
    local = np.asarray(reward_fn(texts, [golds[i] for i in rows]), np.float32)
    return hosts.gather_rows(rows, local, rollout.num_rows)
