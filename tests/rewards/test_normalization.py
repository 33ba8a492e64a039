"""normalize_answer, number parsing and answer structure."""

from fractions import Fraction

import pytest

from jaxrl4llm.rewards import normalize_answer
from jaxrl4llm.rewards.normalization import is_name
from jaxrl4llm.rewards.numbers import close_numbers, parse_number
from jaxrl4llm.rewards.structure import Atom, Relation, Seq, Union, parse_answer


@pytest.mark.parametrize(
    "raw, canonical",
    [
        (r"\left( 1, 2 \right)", "( 1, 2 )"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\frac3{4}", r"\frac{3}{4}"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\text{Evelyn}", "Evelyn"),
        (r"12\text{ cm}^2", "12"),
        (r"125 miles", "125"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"25\%", "25%"),
        ("25 percent", "25%"),
        ("7,425,000", "7425000"),
        (r"14{,}916", "14916"),
        (r"11,\!111", "11111"),
        ("1 000", "1000"),
        ("5.", "5"),
        ("5,", "5"),
        (r"\$5", "5"),
        (r"\text{(C)}", "C"),
        ("(c)", "C"),
        (r"x \geq 5", "x >= 5"),
        (r"x \le 5", "x <= 5"),
        (r"x \neq 5", "x != 5"),
        (r"x \approx 11", "x = 11"),
        (r"x = \frac13 \approx 0.33", r"x = \frac{1}{3}"),
        (r"1 \text{ and } 2", "1 , 2"),
        (r"(2, +\infty)", r"(2, \infty)"),
        (r"\\frac{1}{2}", r"\frac{1}{2}"),
        (r"5\,\text{cm}", "5"),
        (r"15\,\text{m/s}", "15"),
        ("3/s", "3/s"),
        (r"\sin 30^\circ", r"\sin(\frac{30\pi}{180})"),
        (r"\cos(60^{\circ})", r"\cos(\frac{60\pi}{180})"),
        ("\\tan 45\u00b0", r"\tan(\frac{45\pi}{180})"),
        (r"\sin 30", r"\sin 30"),
        (r"\mathbb{R}", r"(-\infty, \infty)"),
        (r"\mathbb R", r"(-\infty, \infty)"),
        (r"\mathbb{R}^2", "R^2"),
        (r"\text{all real numbers}", r"(-\infty, \infty)"),
        (r"\varnothing", r"\emptyset"),
        (r"\{\}", r"\emptyset"),
        (r"\text{No solution.}", r"\emptyset"),
        (r"\text{none}", r"\emptyset"),
        (r"1 + \imath", "1 + i"),
        ("5!", "5!"),
        ("(n+1)!", "(n+1)!"),
        ("n!", "n!"),
        ("Evelyn!", "Evelyn"),
    ],
)
def test_normalize_answer(raw, canonical):
    assert normalize_answer(raw).replace(" ", "") == canonical.replace(" ", "")


@pytest.mark.parametrize(
    "text, value",
    [("27", Fraction(27)), ("27.0", Fraction(27)), ("-.5", Fraction(-1, 2)), ("1.5e3", Fraction(1500)),
     (r"1.5\times10^{3}", Fraction(1500)), (r"\frac{3}{4}", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)),
     ("6/8", Fraction(3, 4)), ("x", None), ("1e999999999", None), ("1/0", None), ("1" * 1000, None),
     (r"0.\overline{3}", Fraction(1, 3)), (r"0.1\overline{6}", Fraction(1, 6)), (r"-2.\overline{12}", Fraction(-70, 33)),
     (r".\overline{142857}", Fraction(1, 7)), (r"0.\overline{9}", Fraction(1)), (r"\overline{3}", None),
     (r"0.\overline{x}", None), ("0.\\overline{" + "3" * 100 + "}", None)],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_relative_tolerance_is_tiny():
    assert close_numbers(Fraction(1, 12), 0.0833333333333333)
    assert not close_numbers(Fraction(25), Fraction(1, 4))
    assert not close_numbers(Fraction(25), Fraction(2500))
    assert not close_numbers(Fraction(100, 3), Fraction(333, 10))
    assert not close_numbers(Fraction(10001), Fraction(10000))


@pytest.mark.parametrize("lhs", ["x", "f(x)", "(p, q)", "|AB|", r"\frac{NO}{BO}", "a_{37}", "V_1:V_2", r"\angle ABC"])
def test_names(lhs):
    assert is_name(lhs)


@pytest.mark.parametrize("lhs", ["7", "a + 3z", "2x + z", "a^2 + b", "f(2)", ""])
def test_not_names(lhs):
    assert not is_name(lhs)


def test_structure():
    assert parse_answer("1, 2") == Seq("list", (Atom("1"), Atom("2")))
    assert parse_answer(r"\{1, 2\}").kind == "set"
    t = parse_answer("[0, 1)")
    assert (t.kind, t.open, t.close) == ("tuple", "[", ")")
    assert isinstance(parse_answer(r"(0,1) \cup (2,3)"), Union)
    assert parse_answer("x = 5 + 5 + 1 = 11") == Relation(("x", "11"), ("=",))
    assert parse_answer(r"1 \pm \sqrt{2}") == Seq("list", (Atom(r"1 + \sqrt{2}"), Atom(r"1 - \sqrt{2}")))
    assert parse_answer(r"x \in [1, 2]").kind == "tuple"
    solutions = parse_answer("p=5,q=2;p=7,q=2")
    assert solutions.kind == "list" and all(s.kind == "tuple" for s in solutions.items)
