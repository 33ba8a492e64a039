"""Held-out evaluation: accuracy (mean reward), pass@k and mean response length per eval file."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl4llm.train import hosts
from jaxrl4llm.train.config import RunConfig
from jaxrl4llm.train.scoring import score_rows


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Codex)."""
    if num_samples - num_correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def evaluate(policy, eval_sets, cfg: RunConfig, reward_fn, rng) -> dict:
    """Samples `trainer.eval_samples` responses per problem at `trainer.eval_temperature`
    (0 = greedy, one sample) in batches of rollout.prompts_per_step prompts.

    Returns {"<set>/accuracy", "<set>/pass@k", "<set>/response_length", ...} plus the
    unweighted means over sets as "accuracy" etc.
    """
    greedy = cfg.trainer.eval_temperature <= 0
    k = 1 if greedy else max(cfg.trainer.eval_samples, 1)
    chunk = cfg.rollout.prompts_per_step
    out: dict[str, float] = {}
    for s_idx, ps in enumerate(eval_sets):
        correct = np.zeros((len(ps), k))
        lengths = []
        for start in range(0, len(ps), chunk):
            ids = list(range(start, min(start + chunk, len(ps))))
            prompts = [ps.token_ids[i] for i in ids]
            # Pad the last chunk with repeats so every call has the same shape (one compile).
            prompts += [prompts[-1]] * (chunk - len(prompts))
            rollout = policy.generate(
                prompts, num_samples=k, max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.trainer.eval_temperature, top_p=cfg.rollout.top_p if not greedy else 1.0,
                top_k=cfg.rollout.top_k if not greedy else 0,
                rng=jax.random.fold_in(rng, s_idx * 100003 + start), greedy=greedy,
            )
            golds = [ps.answers[i] for i in ids for _ in range(k)]
            golds += [golds[-1]] * (rollout.num_rows - len(golds))  # the repeats' rows, scored and dropped
            rewards = score_rows(policy, rollout, golds, reward_fn)[: len(ids) * k].reshape(len(ids), k)
            correct[ids] = rewards > 0.5
            lengths.extend(hosts.fetch(rollout.lengths)[: len(ids) * k].tolist())
        n = ps.name
        out[f"{n}/accuracy"] = float(correct.mean())
        out[f"{n}/pass@{k}"] = float(np.mean([pass_at_k(k, int(c.sum()), k) for c in correct]))
        out[f"{n}/response_length"] = float(np.mean(lengths))
    for metric in ("accuracy", "response_length"):
        vals = [v for key, v in out.items() if key.endswith("/" + metric)]
        out[metric] = float(np.mean(vals))
    return out
