"""rewards/format.py: the boxed-format reward's definition, case by case."""

import pytest

from jaxrl4llm.rewards import boxed_format_reward
from jaxrl4llm.rewards.format import ends_with_one_box


@pytest.mark.parametrize("response, expected", [
    (r"so the answer is $\boxed{5}$.", True),       # a math closer and a period may follow
    (r"\[\boxed{x^{2}}\]", True),
    (r"\boxed {\frac{1}{2}}  ", True),               # spaces before the brace and after the box
    (r"\boxed{\{1, 2\}}", True),                     # escaped braces are characters
    (r"\boxed{5} so the answer is 5", False),        # text after the box
    (r"\boxed{5}..", False),                         # one period at most
    (r"\boxed{1} then \boxed{2}", False),            # exactly one box
    (r"\boxed{\boxed{2}}", False),
    (r"\boxed{1", False),                            # unbalanced
    (r"\boxed 5", False),                            # a box needs its braces
    ("the answer is 5", False),
])
def test_ends_with_one_box(response, expected):
    assert ends_with_one_box(response) is expected


def test_boxed_format_reward_scores_the_shape_not_the_answer():
    assert boxed_format_reward([r"\boxed{3}", r"\boxed{4} or \boxed{3}", "3"], ["4", "4", "3"]) == [1.0, 0.0, 0.0]


def test_strict_box_reward_gives_no_credit_without_a_box():
    from jaxrl4llm.rewards import batch_math_reward, strict_box_reward

    responses = ["7+5=12 12-3=9", r"7+5=12 12-3=9 \boxed{9}", r"\boxed{8}", ""]
    assert batch_math_reward(responses, ["9"] * 4, num_workers=1)[0] == 1.0  # the verifier alone credits it
    assert strict_box_reward(responses, ["9"] * 4, num_workers=1) == [0.0, 1.0, 0.0, 0.0]
