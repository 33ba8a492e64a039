"""A user's own reward and recipe, plugged in by import path (no fork of jaxrl4llm)."""

from jaxrl4llm.core import policy_loss


def contains_one_reward(response: str, gold: str) -> float:
    """1.0 when the response contains the character '1': a dense, easy signal for smoke tests."""
    return float("1" in response)


def half_policy_loss(recipe, **kwargs):
    """The core policy loss at half the numerator: a custom composition with the same signature."""
    terms, metrics = policy_loss(recipe, **kwargs)
    metrics["custom_loss_used"] = terms.numerator * 0 + 1.0
    return terms._replace(numerator=terms.numerator * 0.5), metrics


def always_correct_reward(response: str, gold: str) -> float:
    """Every response is right (a pass rate of 1 for every prompt)."""
    return 1.0
