"""The fast arithmetic LaTeX parser agrees with sympy's parse_latex and refuses the rest."""

import pytest
import sympy
from sympy.parsing.latex import parse_latex

from jaxrl4llm.rewards.latex_parser import Unsupported, parse_simple

SUPPORTED = [
    r"3\sqrt{13}", r"\frac{\pi}{2}", r"2x^2+1", r"x^23", r"\frac12", r"\sqrt[3]{x}^2", r"-\frac{3}{4}",
    r"2(x+1)", r"x y", r"1.5", r"\frac{1+\sqrt{5}}{2}", r"2^{10}-1", r"a^2 - b^2", r"\pi r^2",
    r"(a-b)(a+b)", r"\frac{9}{4}\pi", r"3/4/2", r"-x^2", r"2 \cdot 3", r"2 \times 3", r"\frac{x}{7}+\frac{2}{7}",
    r"10^{-3}", r"\sqrt{\sqrt{11}+\sqrt{194}}", r"{x+1}^2", r"2^10",
]


def _value(expr, x=sympy.Rational(13, 10), y=sympy.Rational(-7, 10)):
    expr = expr.xreplace({sympy.Symbol("pi"): sympy.pi})  # parse_latex reads \pi as a symbol
    subs = {s: (x if i % 2 == 0 else y) for i, s in enumerate(sorted(expr.free_symbols, key=str))}
    return complex(expr.evalf(30, subs=subs))


@pytest.mark.parametrize("text", SUPPORTED)
def test_agrees_with_parse_latex(text):
    ours, theirs = parse_simple(text), parse_latex(text)
    assert abs(_value(ours) - _value(theirs)) <= 1e-12 * max(1.0, abs(_value(theirs)))


@pytest.mark.parametrize("text", [r"\sin x", r"|x|", r"x_1", r"5!", r"2/3x", r"x^-1", r"\alpha", r"(1, 2)", r"[0, 1]",
                                  r"x = 1", r"a^b^c", r"\frac{1}", ""])
def test_refuses_what_it_does_not_read(text):
    with pytest.raises(Unsupported):
        parse_simple(text)


def test_builds_unevaluated_trees():
    tower = parse_simple(r"10^{10^{10^{10}}}")  # must not be computed
    assert isinstance(tower, sympy.Pow) and isinstance(tower.exp, sympy.Pow)
    assert parse_simple("1.25") == sympy.Float("1.25")  # decimals compare with the tolerance
