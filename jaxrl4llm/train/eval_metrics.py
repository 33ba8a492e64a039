"""Evaluation estimators over n samples per problem: mean@n, unbiased pass@k, maj@k (pure functions).

    correct [P, n] bool   (sample j of problem p is correct: reward > CORRECT_REWARD_THRESHOLD)
    keys    [P][n]        (the answer each sample votes for, None = no answer: an abstention)

    mean@n = mean over p, j of correct[p, j]                          (avg@n: accuracy over all samples)
    pass@k = mean over p of 1 - C(n - c_p, k) / C(n, k)               (Chen et al. 2021, "Codex", eq. 1)
    maj@k  = mean over p of correct[p, vote(keys[p][:k])]             (self-consistency, Wang et al. 2022)

pass@k is the unbiased estimator of "at least one of k samples is correct" from n >= k samples
(c_p of them correct), computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms a
binomial coefficient (no overflow at n = 1024). pass@1 is mean@n, and pass@k grows with k.

maj@k takes the first k samples of a problem (the order they were drawn), groups their answers by
key equality and picks the largest group; a tie goes to the group whose first member came first
(`majority_vote`). The problem counts as solved when that first member is correct; a problem
whose k samples all abstain counts as wrong. maj@k is one draw of the first k samples, not an
average over subsets: its variance falls only with the number of problems.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Codex), for k <= n,
    as 1 - prod_{i = n - c + 1}^{n} (1 - k / i) (stable: no binomial coefficient is formed)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}.")
    if num_samples - num_correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def pass_ks(num_samples: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... (powers of two below n) and n itself."""
    ks, k = [], 1
    while k < num_samples:
        ks.append(k)
        k *= 2
    return ks + [num_samples]


def majority_vote(keys: Sequence[Hashable | None]) -> int | None:
    """Index of the sample whose answer wins the vote among `keys` [k], or None when all abstain.

    The winner is the largest group of equal keys (None abstains); on a tie, the group whose
    first member comes first; the index returned is that group's first member.
    >>> majority_vote(["2", "3", "3", "2"]), majority_vote([None, "5"]), majority_vote([None])
    (0, 1, None)
    """
    counts: dict = {}
    first: dict = {}
    for i, key in enumerate(keys):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[key] for key, count in counts.items() if count == best)


def maj_at_k(keys: Sequence[Sequence[Hashable | None]], correct: np.ndarray, k: int) -> float:
    """maj@k over problems: keys [P][n], correct [P, n]; the share of problems whose vote among
    their first k samples (`majority_vote`) is a correct sample."""
    correct = np.asarray(correct, bool)
    if not 1 <= k <= correct.shape[1]:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={correct.shape[1]}.")
    wins = []
    for row_keys, row_correct in zip(keys, correct):
        winner = majority_vote(list(row_keys)[:k])
        wins.append(winner is not None and bool(row_correct[winner]))
    return float(np.mean(wins)) if wins else 0.0


def sample_metrics(correct: np.ndarray, keys: Sequence[Sequence[Hashable | None]]) -> dict[str, float]:
    """One benchmark's metrics from correct [P, n] and the samples' answer keys [P][n]:
    {"mean@n", "pass@k" and "maj@k" for k in pass_ks(n)}."""
    correct = np.asarray(correct, bool)
    n = correct.shape[1]
    out = {f"mean@{n}": float(correct.mean())}
    for k in pass_ks(n):
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c.sum()), k) for c in correct]))
    for k in pass_ks(n):
        out[f"maj@{k}"] = maj_at_k(keys, correct, k)
    return out
