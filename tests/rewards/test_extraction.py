"""extract_answer on realistic responses and on each extraction rule."""

import pytest

from jaxrl4llm.rewards import extract_answer, gold_answer

QWEN_STYLE = r"""<think>
Okay, let's see. The perimeter is 2(l + w) = 2(5 + 7) = 24. Hmm, wait, the question asks
for the area, so 5 * 7 = 35. Let me double check... yes \boxed{35} is right.
</think>

The rectangle has sides 5 and 7, so its area is $5 \cdot 7 = 35$.

\[
\boxed{35}
\]"""

MATH_STYLE = r"""We have that $r = \sqrt{0^2 + 3^2} = 3.$  Also, the angle is $\frac{\pi}{2}.$
Therefore, the polar coordinates are $\boxed{\left( 3, \frac{\pi}{2} \right)}.$"""

MINERVA_STYLE = r"""The sum of the roots is $-b/a = 7$.
Final Answer: The final answer is $7$. I hope it is correct."""

GSM8K_STYLE = """Janet's ducks lay 16 eggs per day. She eats three and bakes with four, so 16 - 3 - 4 = 9 eggs.
She sells them for $2 each, so 9 * 2 = $18.
#### 18"""

TRUNCATED = r"""Let me compute the value step by step. First the product is $12 \times 3 = 36$, and then"""


@pytest.mark.parametrize(
    "response, expected",
    [
        (QWEN_STYLE, "35"),
        (MATH_STYLE, r"\left( 3, \frac{\pi}{2} \right)"),
        (MINERVA_STYLE, "7"),
        (GSM8K_STYLE, "18"),
        (TRUNCATED, r"12 \times 3 = 36"),
        (r"so \boxed{\frac{a}{b^{2}}} done", r"\frac{a}{b^{2}}"),
        (r"\boxed 5", "5"),
        (r"\fbox{9}", "9"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"$\boxed{1}$ and $\boxed{2}$", "1, 2"),
        ("The answer is 12.", "12."),
        ("Answer: $x^2$", "x^2"),
        ("The result is 3/4", "3/4"),
        ("-5", "-5"),
        ("answer $\\frac{1}{2}$ here <|im_start|>user\nnext question \\boxed{9}", "\\frac{1}{2}"),
        ("<think>\\boxed{1}</think>", None),
        ("", None),
        ("no numbers here at all, sorry friend", None),
        (r"so $\boxed{\boxed{5}}$", "5"),
        (r"$\boxed{\text{The answer is } \boxed{\frac{1}{2}}}$", r"\frac{1}{2}"),
        (r"$\boxed{\text{Final answer: } \boxed{3}}$", "3"),
        (r"$\boxed{\boxed{1}}$ and $\boxed{2}$", "1, 2"),
        ("So the answer is 42!", "42"),
        (r"So the answer is $\boxed{5!}$.", "5!"),
    ],
)
def test_extract_answer(response, expected):
    got = extract_answer(response)
    if expected is None:
        assert got is None or got == ""
    else:
        assert got is not None and got.strip().rstrip(".") == expected.rstrip(".")


def test_final_answer_after_box_wins():
    response = "We get \\boxed{255} for the second CD.\nFinal Answer: The final answer is $10,455$. I hope it is correct."
    assert extract_answer(response) == "10,455"


def test_box_after_final_answer_phrase_wins():
    assert extract_answer(r"Final Answer: the smallest value of $N$ is $\boxed{14{,}916}$.") == "14{,}916"


def test_non_strings_and_oversized_inputs_have_no_answer():
    assert extract_answer(None) is None
    assert extract_answer(12) is None
    assert extract_answer("1" * 300_000) is None


def test_gold_answer_unwraps_boxes_and_numbers():
    assert gold_answer(27.0) == "27.0"
    assert gold_answer(r"$\boxed{5}$") == "5"
    assert gold_answer(r"\\boxed{W(n) = 1") == "W(n) = 1"
    assert gold_answer("12") == "12"
