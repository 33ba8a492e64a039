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


# Inputs built to trigger super-linear regular expressions (nested quantifiers, unclosed
# delimiters scanned from every start). Extraction and normalisation run in the caller's
# process, so they must stay fast on them.
REGEX_BOMBS = {
    "unclosed display math": "\\[ 1 \\) " * 20_000,
    "unclosed inline math": "\\( 1 \\] " * 20_000,
    "many dollars": "$a$ word " * 20_000,
    "letters then digit": "a" * 3_900 + "1",
    "words then digit": "a " * 1_900 + "!1",
    "spaces between commas": "," + " " * 3_900 + "x",
    "punctuation run": ".,;" * 1_300 + "x",
    "percent spaces": "5" + " " * 3_900 + "x",
    "many unclosed boxes": "\\boxed{a}}" * 15_000,
    "final answer spam": "final answer is " * 10_000,
    "digit soup": "1," * 50_000 + "5",
}


def test_extraction_and_normalisation_stay_fast_on_regex_bombs():
    import time

    from jaxrl4llm.rewards import extract_answer, normalize_answer

    for name, text in REGEX_BOMBS.items():
        start = time.monotonic()
        extract_answer(text)
        normalize_answer(text[:4_000])
        assert time.monotonic() - start < 2.0, name
