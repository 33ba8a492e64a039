"""Held-out evaluation: accuracy (mean reward), pass@k and mean response length per eval file."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl4llm.train import hosts
from jaxrl4llm.train.config import RunConfig
from jaxrl4llm.train.reward_fn import CORRECT_REWARD_THRESHOLD
from jaxrl4llm.train.scoring import score_rows


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Codex)."""
    if num_samples - num_correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def evaluate(policy, eval_sets, cfg: RunConfig, reward_fn, rng, records: list | None = None) -> dict:
    """Samples `trainer.eval_samples` responses per problem at `trainer.eval_temperature`
    (0 = greedy, one sample): with the continuous sampler, every problem of a set in one call on
    the slots `rollout.slots` gives (without a memory budget: rollout.prompts_per_step * samples
    slots), a finished row's slot taken by the next problem; with the static one, in batches of
    rollout.prompts_per_step prompts.

    Returns {"<set>/accuracy", "<set>/pass@k", "<set>/response_length", ...} plus the
    unweighted means over sets as "accuracy" etc. With a `records` list, appends one dict per
    (problem, sample): set, problem, sample, prompt, response, extracted (the math verifier's
    final answer, None when there is none), gold and reward (`jaxrl4llm eval --output`).
    """
    greedy = cfg.trainer.eval_temperature <= 0
    k = 1 if greedy else max(cfg.trainer.eval_samples, 1)
    continuous = getattr(policy, "engine", "continuous") == "continuous"
    out: dict[str, float] = {}
    for s_idx, ps in enumerate(eval_sets):
        chunk = len(ps) if continuous else cfg.rollout.prompts_per_step
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
                slots=cfg.rollout.prompts_per_step * k if continuous else None,
            )
            golds = [ps.answers[i] for i in ids for _ in range(k)]
            golds += [golds[-1]] * (rollout.num_rows - len(golds))  # the repeats' rows, scored and dropped
            rows = [i for i in ids for _ in range(k)]
            rows += [rows[-1]] * (rollout.num_rows - len(rows))
            rewards = score_rows(policy, rollout, golds, reward_fn, [ps.problems[i] for i in rows] if ps.problems else None,
                                 [ps.metadata[i] for i in rows] if ps.metadata else None,
                                 counted=len(ids) * k)[: len(ids) * k].reshape(len(ids), k)
            if records is not None:
                _record(records, policy, rollout, ps, ids, k, rewards)
            correct[ids] = rewards > CORRECT_REWARD_THRESHOLD
            lengths.extend(hosts.fetch(rollout.lengths)[: len(ids) * k].tolist())
        n = ps.name
        out[f"{n}/accuracy"] = float(correct.mean())
        out[f"{n}/pass@{k}"] = float(np.mean([pass_at_k(k, int(c.sum()), k) for c in correct]))
        out[f"{n}/response_length"] = float(np.mean(lengths))
    for metric in ("accuracy", "response_length"):
        vals = [v for key, v in out.items() if key.endswith("/" + metric)]
        out[metric] = float(np.mean(vals))
    if hasattr(reward_fn, "drain"):  # a RewardFn: responses whose reward failed (scored 0), warned once
        out["reward_errors"] = reward_fn.drain("evaluation")
    return out


def _record(records: list, policy, rollout, ps, ids: list[int], k: int, rewards: np.ndarray) -> None:
    """One dict per (problem, sample) of a chunk's real rows (the padding repeats left out)."""
    from jaxrl4llm.rewards import extract_answer

    tokens = hosts.fetch(rollout.response_tokens)[: len(ids) * k]
    lengths = hosts.fetch(rollout.lengths)[: len(ids) * k]
    texts = policy.decode_rows([t[:n].tolist() for t, n in zip(tokens, lengths)])
    for row, text in enumerate(texts):
        i, sample = ids[row // k], row % k
        records.append({"set": ps.name, "problem": i, "sample": sample, "prompt": ps.texts[i], "response": text,
                        "extracted": extract_answer(text), "gold": ps.answers[i], "reward": float(rewards[row // k, sample])})
