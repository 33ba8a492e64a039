"""train/scoring.py: a rollout's rewards and a weighted list's components, row by row."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import component_means
from jaxrl4llm.train.reward_fn import make_reward_fn
from jaxrl4llm.train.scoring import score_rows, score_rows_with_components

TEXTS = ["a", r"\boxed{a}", "b"]


def _rollout():
    """Three rows whose tokens decode (below) to TEXTS; row 1 has a padding token past its length."""
    return SimpleNamespace(response_tokens=np.array([[0, 9], [1, 9], [2, 9]]), lengths=np.array([1, 1, 1]), num_rows=3,
                           tool_mask=None)


POLICY = SimpleNamespace(decode_rows=lambda rows: [TEXTS[r[0]] for r in rows])


def test_score_rows_with_components_returns_the_total_and_each_entry_per_row():
    cfg = load_config(None, ["reward.sandbox=false", "reward.fns=[{fn: tests.train.user_rewards:raises_on_b, "
                             "name: exact}, {fn: jaxrl4llm.rewards:boxed_format_reward, weight: 0.5, name: format}]"])
    reward = make_reward_fn(cfg, log=lambda line: None)
    scored = score_rows_with_components(POLICY, _rollout(), ["a"] * 3, reward)
    assert scored.rewards.tolist() == [1.0, 0.5, 0.0]
    assert {k: v.tolist() for k, v in scored.components.items()} == {"exact": [1.0, 0.0, 0.0], "format": [0.0, 1.0, 0.0]}
    assert reward.drain("test") == 1  # row 2's KeyError, counted once
    np.testing.assert_array_equal(score_rows(POLICY, _rollout(), ["a"] * 3, reward), scored.rewards)
    means = component_means([scored.components, {"exact": np.ones(3, np.float32), "format": np.ones(3, np.float32)}])
    assert means == {"reward/exact": pytest.approx(4 / 6), "reward/format": pytest.approx(4 / 6)}  # over both draws
    assert component_means([{}]) == {}  # a single reward.fn logs no reward/<name>


def test_a_plain_callable_has_no_components():
    scored = score_rows_with_components(POLICY, _rollout(), ["a"] * 3, lambda texts, golds: [1.0] * len(texts))
    assert scored.rewards.tolist() == [1.0] * 3 and scored.components == {}


def test_the_reward_reads_the_model_s_tokens_only():
    """A boxed answer the tool printed earns nothing; the same answer written by the model earns it.
    Tokens: 0 'a ', 1 '\\boxed{7}', 2 '```output 7```' (the tool's text), 3 'so '; tool_mask 1 on the
    tool's spans."""
    from jaxrl4llm.rewards import extract_answer

    pieces = ["a ", "\\boxed{7}", "```output 7```", "so "]
    policy = SimpleNamespace(decode_rows=lambda rows: ["".join(pieces[t] for t in r) for r in rows])
    rollout = SimpleNamespace(
        response_tokens=np.array([[0, 1, 3, 3], [0, 2, 1, 3], [0, 1, 3, 3]]), lengths=np.array([3, 3, 3]), num_rows=3,
        tool_mask=np.array([[0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32))
    reward = lambda texts, golds: [float(extract_answer(t) == g) for t, g in zip(texts, golds)]
    # row 0: the box came from the tool; row 1: the tool printed, the model boxed; row 2: no tool
    assert score_rows(policy, rollout, ["7"] * 3, reward).tolist() == [0.0, 1.0, 1.0]
    rollout.tool_mask = None  # without tools the whole response is read
    assert score_rows(policy, rollout, ["7"] * 3, reward).tolist() == [1.0, 1.0, 1.0]
