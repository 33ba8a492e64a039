"""train/samples.py: a tiny run (conftest.finished_run) writes trainer.log_samples (default 4)
rollouts a step to samples.jsonl: the first rows of the step's batch, i.e. the first prompt's
group of G = 4, with their rewards, advantages and the policy version that sampled them."""

import json

import numpy as np

from jaxrl4llm.train.metrics import SAMPLES_FILE


def test_a_tiny_run_writes_the_first_rows_of_each_step_to_samples_jsonl(finished_run):
    rows = [json.loads(line) for line in (finished_run["out"] / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["step"], r["row"]) for r in rows] == [(s, i) for s in (1, 2) for i in range(4)]
    assert set(rows[0]) == {"step", "row", "prompt", "response", "reward", "shaped_reward", "advantage", "extracted",
                            "truncated", "response_length", "policy_version"}
    for r in rows:
        assert r["policy_version"] == r["step"] - 1  # synchronous: sampled by the policy before the step's update
        assert 0 <= r["response_length"] <= 8 and r["truncated"] == (r["response_length"] == 8)
        assert r["shaped_reward"] == r["reward"]  # reward.scale 1, offset 0, no overlong penalty (lite_ppo)
        assert r["prompt"].strip() and isinstance(r["response"], str)
    for step in (1, 2):  # the four rows are one prompt's group: same prompt, group-centred advantages (lite_ppo)
        group = [r for r in rows if r["step"] == step]
        assert len({r["prompt"] for r in group}) == 1
        assert abs(sum(r["advantage"] for r in group)) < 1e-5
        rewards = np.array([r["reward"] for r in group])
        assert np.allclose(np.sign([r["advantage"] for r in group]), np.sign(rewards - rewards.mean()), atol=0)
