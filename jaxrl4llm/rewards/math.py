r"""Binary math reward: is the final answer of a response equal to the gold answer?

Public entry points of ``jaxrl4llm.rewards``::

    extract_answer(response) -> str | None
    math_equal(pred, gold, *, timeout=3.0) -> bool
    math_reward(response, gold, *, timeout=3.0) -> float          # 0.0 or 1.0
    batch_math_reward(responses, golds, *, num_workers=None, timeout=3.0) -> list[float]
    strict_box_reward(responses, golds, *, num_workers=None, timeout=3.0) -> list[float]

Pipeline: ``extraction`` finds the answer, ``normalization`` gives both sides one spelling,
``equivalence`` compares (strings, exact numbers, structure, then ``symbolic``/sympy). The
cheap rules run in the caller's process; anything that needs sympy runs in a ``sandbox``
worker process under a hard wall-clock limit, so a hostile answer costs at most ``timeout``
seconds and yields 0. Batches use one worker per core and return results in input order.
"""

from __future__ import annotations

from typing import Sequence

from jaxrl4llm.rewards.equivalence import answers_equal, quick_verdict
from jaxrl4llm.rewards.extraction import extract_answer, gold_answer
from jaxrl4llm.rewards.limits import DEFAULT_TIMEOUT, MAX_ANSWER_CHARS, within_answer_limits
from jaxrl4llm.rewards.normalization import normalize_answer
from jaxrl4llm.rewards.sandbox import shared_pool


def warm_up() -> None:
    """Per-worker warm-up: import sympy and the LaTeX parser before the first timed call."""
    from jaxrl4llm.rewards import symbolic

    symbolic.warm_up()


def _prepare_pair(pred: str | None, gold) -> tuple[str, str] | bool:
    """Normalised (pred, gold) that still need the sandbox, or the final verdict."""
    if pred is None or gold is None:
        return False
    pred, gold = str(pred), gold_answer(gold)
    if len(pred) > 2 * MAX_ANSWER_CHARS or len(gold) > 2 * MAX_ANSWER_CHARS:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g or not within_answer_limits(p) or not within_answer_limits(g):
        return False
    verdict = quick_verdict(p, g)
    if verdict is not None:
        return verdict
    return pred, gold


def _check_timeout(timeout: float) -> None:
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def math_equal(pred: str, gold, *, timeout: float = DEFAULT_TIMEOUT) -> bool:
    r"""True when the answer ``pred`` equals ``gold`` (both answers, not full responses).

    Strings, exact rationals, numbers within a relative 1e-9, tuples/intervals/sets element
    by element, then sympy on parsed LaTeX under a hard ``timeout`` (seconds) in a worker
    process. A gold given as a number (``27.0``) is compared as its string.

    >>> math_equal(r"\dfrac{1}{2}", "0.5")
    True
    """
    _check_timeout(timeout)
    prepared = _prepare_pair(pred, gold)
    if isinstance(prepared, bool):
        return prepared
    return bool(shared_pool(warmup=warm_up).run(answers_equal, [prepared], timeout=timeout, default=False)[0])


def math_reward(response: str, gold, *, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 when the final answer of ``response`` equals ``gold``, else 0.0 (also on any failure)."""
    _check_timeout(timeout)
    return 1.0 if math_equal(extract_answer(response), gold, timeout=timeout) else 0.0


def batch_math_reward(
    responses: Sequence[str],
    golds: Sequence,
    *,
    num_workers: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[float]:
    """``math_reward`` for many (response, gold) pairs, in order, using ``num_workers`` processes.

    Args:
      responses: model outputs (untrusted).
      golds: gold answers, one per response (strings or numbers).
      num_workers: worker processes (default: all CPU cores).
      timeout: hard limit in seconds for each comparison that needs sympy.

    Returns:
      A list of 0.0/1.0 floats, ``result[i]`` for ``responses[i]``.
    """
    _check_timeout(timeout)
    if len(responses) != len(golds):
        raise ValueError(
            f"batch_math_reward got {len(responses)} responses but {len(golds)} golds; "
            "pass one gold answer per response (repeat a prompt's gold for each of its samples)"
        )
    rewards = [0.0] * len(responses)
    todo, calls = [], []
    for i, (response, gold) in enumerate(zip(responses, golds)):
        prepared = _prepare_pair(extract_answer(response), gold)
        if isinstance(prepared, bool):
            rewards[i] = 1.0 if prepared else 0.0
        else:
            todo.append(i)
            calls.append(prepared)
    if calls:
        pool = shared_pool(num_workers, warmup=warm_up)
        for i, ok in zip(todo, pool.run(answers_equal, calls, timeout=timeout, default=False)):
            rewards[i] = 1.0 if ok else 0.0
    return rewards


__all__ = [
    "batch_math_reward",
    "extract_answer",
    "math_equal",
    "math_reward",
    "normalize_answer",
]


def strict_box_reward(
    responses: Sequence[str],
    golds: Sequence,
    *,
    num_workers: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[float]:
    r"""``batch_math_reward``, except that a response without ``\boxed{`` scores 0.

    The verifier alone credits an unboxed final number (``7+5=12 12-3=9`` for gold 9); this reward
    asks for the box, as the chain task's runs do (data/chain_task.py, configs/miniature/).
    ``reward.fn: jaxrl4llm.rewards:strict_box_reward``.
    """
    scores = batch_math_reward(responses, golds, num_workers=num_workers, timeout=timeout)
    return [score if isinstance(r, str) and "\\boxed{" in r else 0.0 for r, score in zip(responses, scores)]
