"""Static safety checks of the reward package: nothing that can run model output as code."""

import re
from pathlib import Path

import jaxrl4llm.rewards

PACKAGE = Path(jaxrl4llm.rewards.__file__).parent
FORBIDDEN = [r"\beval\(", r"\bexec\(", r"sympify\(", r"parse_expr", r"__import__", r"pickle\.loads"]


def test_no_code_evaluation_in_the_reward_package():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        for pattern in FORBIDDEN:
            assert not re.search(pattern, text), f"{path.name} contains {pattern}"


def test_size_limits_are_enforced():
    from jaxrl4llm.rewards import extract_answer
    from jaxrl4llm.rewards.limits import MAX_RESPONSE_CHARS

    assert extract_answer("x" * (MAX_RESPONSE_CHARS + 1) + r"\boxed{5}") is None
    assert extract_answer(r"\boxed{" + "{" * 100 + "5" + "}" * 100 + "}") != "5"
