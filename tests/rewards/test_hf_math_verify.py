"""rewards/hf_math_verify.py: Math-Verify as a reward (the `math-verify` extra), and the error
that names the extra when the package is missing."""

import importlib
import sys

import pytest

pytest.importorskip("math_verify")

from jaxrl4llm.rewards.hf_math_verify import math_verify_reward  # noqa: E402


@pytest.mark.parametrize("response, gold, expected", [
    (r"so the answer is $\boxed{0.5}$", "1/2", 1.0),                       # numbers, any spelling
    (r"$\boxed{\frac{\sqrt{3}}{2}}$", r"\frac{\sqrt 3}{2}", 1.0),
    (r"The final answer is $\boxed{3}$", "4", 0.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),                                # symbolic equality
    ("I do not know", "7", 0.0),
    (r"\boxed{5}", r"\boxed{5}", 1.0),                                      # a boxed gold is not boxed again
])
def test_math_verify_reward(response, gold, expected):
    assert math_verify_reward(response, gold) == expected


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    monkeypatch.delitem(sys.modules, "jaxrl4llm.rewards.hf_math_verify")
    with pytest.raises(ImportError, match=r"pip install 'jaxrl4llm\[math-verify\]'"):
        importlib.import_module("jaxrl4llm.rewards.hf_math_verify")
