"""A user's own reward and recipe, plugged in by import path (no fork of jaxrl4llm).

Standard library at import: the rewards' sandbox workers import this module when they start
(train/reward_fn.py), and JAX is imported by the loss alone, when it is called."""

import re


def contains_one_reward(response: str, gold: str) -> float:
    """1.0 when the response contains the character '1': a dense, easy signal for smoke tests."""
    return float("1" in response)


def digit_share_reward(response: str, gold: str) -> float:
    """The share of the response's characters (stripped) that are digits, in [0, 1]: a dense signal a
    random policy climbs within a few steps (learning smoke tests)."""
    text = response.strip()
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def always_correct_reward(response: str, gold: str) -> float:
    """Every response is right (a pass rate of 1 for every prompt)."""
    return 1.0


def boxed_integer_reward(response: str, gold: str) -> float:
    r"""1.0 when the response boxes an integer (`\boxed{7}`), right or wrong: the demo's answer format,
    a signal a weak warm start can learn in a few steps (about a third of its responses have it)."""
    return float(re.search(r"\\boxed\{-?\d+\}", response) is not None)


def negated_policy_loss(recipe, **kwargs):
    """The core policy loss with its sign flipped (learning broken: the policy moves away from
    reward); a custom composition with the same signature, which marks its metrics."""
    from jaxrl4llm.core import policy_loss

    terms, metrics = policy_loss(recipe, **kwargs)
    metrics["custom_loss_used"] = terms.numerator * 0 + 1.0
    return terms._replace(numerator=-terms.numerator), metrics


def checks_problem_and_metadata(response: str, gold: str, problem: str, metadata: dict) -> float:
    """1.0 when the reward was given the row's own problem text and metadata (the demo task's
    fields), raising on a response that contains '1' (reward.on_error: counted, scored 0)."""
    if "1" in response:
        raise ValueError("a '1' in the response")
    return float(problem.endswith("How many?") and metadata["solution"].endswith("\\boxed{%s}" % gold)
                 and metadata["digits"] == 1)


def needs_no_gold_reward(response: str, gold: str = "") -> float:
    """1.0 when the response contains '1'; its gold parameter's default says it needs no gold answer
    (rows without one are kept, with gold "")."""
    return float("1" in response)
