"""Logged rollouts: a few rows of each step's batch as text, for reading what the policy writes
while it trains (`trainer.log_samples`; the peers' completions table: TRL's log_completions,
verl's val generations, tunix's sample logging).

    rows = sample_rows(policy, rollout, rewards, adv, versions, n=4, components)   # -> MetricsWriter.write_samples

Which rows: the first n of the step's batch, in order (rows are the prompts' groups of G
samples, adjacent: n <= G shows n samples of the step's first prompt). A pure side output: it
reads the step's arrays and changes nothing the run computes.
"""

from __future__ import annotations

import numpy as np

from jaxrl4llm.rewards import extract_answer
from jaxrl4llm.sampling.rollout import model_tokens
from jaxrl4llm.train import hosts
from jaxrl4llm.train.tool_turns import row_turns, turn_records


def sample_rows(policy, rollout, rewards: np.ndarray, adv, versions, n: int,
                components: dict | None = None) -> list[dict]:
    """One dict per logged row, for the first min(n, N) rows of a step's rollout (every process
    calls it alike: global arrays are gathered).

    Args:
      policy: the run's Policy (its tokenizer decodes the rows).
      rollout: the step's Rollout (N rows: prompt_tokens [N, T] with prompt_mask, response_tokens
        [N, R], lengths [N], truncated [N]).
      rewards: [N] the reward function's scores (reward.fn).
      adv: the step's AdvantageBatch (advantages [N], shaped_rewards [N]).
      versions: the policy version (updates done) that sampled each row: an int or [N] ints
        (rollout.partial: the version that began the row).
      n: trainer.log_samples (0: no rows).
      components: a `reward.fns` list's own (unweighted) rewards {name: [N]} of the same rows
        (reward [N] = sum_i weight_i * components[name_i]); None or {}: a single reward.fn.

    Returns [{"row", "prompt" (as the model saw it, special tokens kept), "response", "reward",
    "shaped_reward" (after reward.scale / offset and the overlong penalty: what the advantage
    is computed from), "advantage", "extracted" (the math verifier's final answer, None when it
    finds none), "truncated", "response_length", "policy_version"}], plus "components" {name: value}
    with a `reward.fns` list, and with tools (`Rollout.tool_mask`) "turns" and "tool_calls" (`with_turns`).
    """
    n = min(n, rollout.num_rows)
    if n <= 0:
        return []
    first = lambda x: hosts.fetch(x[:n])
    prompts, prompt_mask, tokens = first(rollout.prompt_tokens), first(rollout.prompt_mask), first(rollout.response_tokens)
    lengths, truncated = first(rollout.lengths), first(rollout.truncated)
    advantages, shaped = first(adv.advantages), first(adv.shaped_rewards)
    responses = policy.decode_rows([t[:length].tolist() for t, length in zip(tokens, lengths)])
    versions = np.broadcast_to(np.asarray(versions), (rollout.num_rows,))
    rows = [{"row": i, "prompt": policy.decode_ids(prompts[i][np.asarray(prompt_mask[i], bool)].tolist()),
             "response": responses[i], "reward": float(rewards[i]), "shaped_reward": float(shaped[i]),
             "advantage": float(advantages[i]), "extracted": extract_answer(responses[i]),
             "truncated": bool(truncated[i]), "response_length": int(lengths[i]), "policy_version": int(versions[i])}
            for i in range(n)]
    for i, row in enumerate(rows):
        if components:
            row["components"] = {name: float(values[i]) for name, values in components.items()}
    if rollout.tool_mask is not None:
        with_turns(rows, policy, tokens, lengths, first(rollout.tool_mask))
    return rows


def with_turns(rows: list[dict], policy, tokens: np.ndarray, lengths: np.ndarray, tool_mask: np.ndarray) -> None:
    """Adds a tool-integrated row's turns to its logged dict: "turns" [{"model": text, "tool": the
    observation fed back after it}] (`tool_turns.turn_records`, special tokens kept), "tool_calls"
    (observations fed back), and "extracted" from the model's own text (`sampling.model_tokens`: what
    the reward reads)."""
    texts = policy.decode_rows([model_tokens(tokens[i], lengths[i], tool_mask[i]) for i in range(len(rows))])
    for i, row in enumerate(rows):
        turns = row_turns(tokens[i], lengths[i], tool_mask[i])
        row.update(turns=turn_records(turns, policy.decode_ids), tool_calls=sum(1 for t in turns if t.tool),
                   extracted=extract_answer(texts[i]))
