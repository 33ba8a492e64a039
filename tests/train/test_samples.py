"""train/samples.py: a tiny run (conftest.finished_run) writes trainer.log_samples (default 4)
rollouts a step to samples.jsonl: the first rows of the step's batch, i.e. the first prompt's
group of G = 4, with their rewards, advantages and the policy version that sampled them; with
reward.fns, each row's components."""

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


def test_a_reward_fns_run_logs_each_rows_components_that_sum_with_their_weights_to_its_reward(demo_assets, tmp_path):
    """reward.fns: each logged row carries its entries' own rewards, those of the groups the step
    kept (dapo's dynamic sampling, an asynchronous step whose rollout was sampled ahead), and
    reward = sum_i weight_i * components[name_i] row by row."""
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.loop import train

    from tests.train.conftest import tiny_overrides

    fns = ("[{fn: tests.train.custom_parts:contains_one_reward, name: one}, "
           "{fn: tests.train.custom_parts:always_correct_reward, weight: 0.5, name: always}]")
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(demo_assets, out, **{
        "reward.fn": "jaxrl4llm.rewards:batch_math_reward", "reward.batched": "auto", "reward.sandbox": False,
        "reward.fns": fns, "algorithm.preset": "dapo", "trainer.max_staleness": 1, "trainer.steps": 1,
        "trainer.log_samples": 8})),
        log=lambda line: None)
    rows = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert len(rows) == 8
    for r in rows:
        assert set(r["components"]) == {"one", "always"} and r["components"]["always"] == 1.0
        assert r["components"]["one"] == float("1" in r["response"])
        assert r["reward"] == r["components"]["one"] + 0.5 * r["components"]["always"]


def test_rollouts_in_flight_keep_their_components_through_a_checkpoints_host_copy():
    from jaxrl4llm.sampling.rollout import Rollout
    from jaxrl4llm.train.rollout_pipeline import PendingRollout, pending_from_host, pending_to_host

    rollout = Rollout(*(np.zeros(2, np.int32) for _ in Rollout._fields))
    pending = [PendingRollout(3, 2, rollout, np.array([1.5, 0.5], np.float32), {"sampling_draws": 1},
                              components={"one": np.array([1.0, 0.0], np.float32), "always": np.ones(2, np.float32)}),
               PendingRollout(4, 3, rollout, np.zeros(2, np.float32), {})]
    arrays, meta = pending_to_host(pending, np.asarray)
    back = pending_from_host(arrays, json.loads(json.dumps(meta)), np.asarray)
    assert list(back[0].components) == ["one", "always"] and back[1].components == {}
    for name in ("one", "always"):
        np.testing.assert_array_equal(back[0].components[name], pending[0].components[name])
    meta[0].pop("components")  # a checkpoint written before components were kept: none
    assert pending_from_host(arrays, meta, np.asarray)[0].components == {}


def test_a_tool_row_is_logged_turn_by_turn_with_the_answer_the_model_wrote():
    """samples.jsonl of a rollout with tools: each turn's model text and the tool output fed back after
    it; "extracted" reads the model's text (the reward's), not the \\boxed{} the code printed."""
    from types import SimpleNamespace

    from jaxrl4llm.sampling import Rollout
    from jaxrl4llm.train.samples import sample_rows

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 \n`{}\\()*="
    ids = lambda text: [chars.index(c) for c in text]
    decode = lambda row: "".join(chars[i] for i in row)
    pieces = [("```python\nprint(7)\n```\n```output", 0), ("\n\\boxed{7}\n```\n", 1), ("so 8", 0)]
    tokens = np.array([sum((ids(t) for t, _ in pieces), [])], np.int32)
    tool = np.array([[f for t, f in pieces for _ in t]], np.float32)
    n = tokens.shape[1]
    rollout = Rollout(np.ones((1, 2), np.int32), np.ones((1, 2), np.float32), tokens, np.ones((1, n), np.float32),
                      np.zeros((1, n), np.float32), np.zeros((1, n), np.float32), np.array([n]), np.array([False]),
                      tool_mask=tool)
    policy = SimpleNamespace(decode_rows=lambda rows: [decode(r) for r in rows], decode_ids=decode)
    adv = SimpleNamespace(advantages=np.zeros(1, np.float32), shaped_rewards=np.zeros(1, np.float32))
    row, = sample_rows(policy, rollout, np.zeros(1), adv, 0, n=1)
    assert row["turns"] == [{"model": pieces[0][0], "tool": pieces[1][0]}, {"model": "so 8", "tool": ""}]
    assert row["tool_calls"] == 1 and row["extracted"] == "8" and "\\boxed{7}" in row["response"]
