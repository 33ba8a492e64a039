r"""Hugging Face Math-Verify as a reward, so scores compare with TRL and verl runs that use it.

    math_verify_reward(response, gold) -> 1.0 when Math-Verify finds the response's answer equal
                                          to gold, else 0.0

As verl's `utils/reward_score/math_verify.py` scores: the gold wrapped in `\boxed{}` (unless it
holds one) and parsed with LatexExtractionConfig; the response parsed with ExprExtractionConfig and
LatexExtractionConfig; `verify(gold, answer)`; any failure scores 0. Needs the optional extra:
`pip install 'jaxrl4llm[math-verify]'` (math-verify 0.9.0; it runs on the antlr 4.11 runtime that
jaxrl4llm pins). In a run (`reward.fns` or `reward.fn: jaxrl4llm.rewards.hf_math_verify:math_verify_reward`)
it is a per-sample function without a `timeout` parameter, so it runs in the reward worker
processes, each call stopped at `reward.timeout` (train/reward_fn.py).
"""

from __future__ import annotations

import threading

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as e:  # an optional extra: say which
    raise ImportError(f"jaxrl4llm.rewards.hf_math_verify needs the math-verify package ({e}): "
                      f"pip install 'jaxrl4llm[math-verify]' (math-verify==0.9.0).") from None


def math_verify_reward(response: str, gold: str) -> float:
    """1.0 when Math-Verify judges the response's final answer equal to `gold`, else 0.0."""
    # Math-Verify's own time limits use signals, which work in a main thread only (the reward
    # workers call from theirs; 5 s, its default); elsewhere the caller's limit (reward.timeout) has to do.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = str(gold)
    boxed_gold = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    try:
        gold_parsed = parse(boxed_gold, extraction_config=[LatexExtractionConfig()], parsing_timeout=limit)
        answer = parse(response, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                       parsing_timeout=limit)
        return float(bool(gold_parsed) and bool(answer) and verify(gold_parsed, answer, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - Math-Verify on untrusted text: any failure is a wrong answer
        return 0.0
