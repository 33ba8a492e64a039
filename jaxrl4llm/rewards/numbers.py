"""Exact parsing of number literals into Fractions, with size guards.

Accepted forms (after normalisation): ``-12``, ``3.50``, ``.4``, ``1.5e3``, ``1.5\\times10^{3}``,
``\\frac{3}{4}``, ``-\\frac{3}{4}``, ``3/4``, ``12345`` with thousands separators already removed,
and repeating decimals ``0.\\overline{3}`` / ``0.1\\overline{6}`` (exact: 1/3, 1/6).
Anything else returns None, so the caller falls through to the structural or symbolic rules.
Exponents and digit counts are bounded (``limits``) so a hostile ``1e999999999`` cannot make
Python build a gigantic integer.
"""

from __future__ import annotations

import re
from fractions import Fraction

from jaxrl4llm.rewards.limits import MAX_EXPONENT, MAX_NUMBER_DIGITS, MAX_REPEATING_DIGITS

_DECIMAL = r"(?:\d+\.?\d*|\.\d+)"
_SCI_RE = re.compile(
    rf"^([+-]?)({_DECIMAL})(?:(?:[eE]([+-]?\d+))|(?:\s*(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*\{{?\s*([+-]?\d+)\s*\}}?))?$"
)
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{\s*([+-]?\d+)\s*\}\{\s*([+-]?\d+)\s*\}$")
_REPEATING_RE = re.compile(r"^([+-]?)(\d*)\.(\d*)\\overline\s*\{\s*(\d+)\s*\}$")
_SLASH_RE = re.compile(r"^([+-]?)\(?\s*([+-]?\d+)\s*\)?\s*/\s*\(?\s*([+-]?\d+)\s*\)?$")


def _decimal_to_fraction(sign: str, mantissa: str, exponent: str | None) -> Fraction | None:
    if len(mantissa) > MAX_NUMBER_DIGITS:
        return None
    value = Fraction(mantissa if not mantissa.endswith(".") else mantissa[:-1] or "0")
    if exponent is not None:
        exp = int(exponent)
        if abs(exp) > MAX_EXPONENT:
            return None
        value *= Fraction(10) ** exp
    return -value if sign == "-" else value


def parse_repeating_decimal(text: str) -> Fraction | None:
    r"""The exact value of a repeating decimal written with ``\overline``, or None.

    Rule: ``I.N\overline{R}`` = I + (N + R / (10^len(R) - 1)) / 10^len(N), so
    ``0.\overline{3}`` = 1/3, ``0.1\overline{6}`` = 1/6, ``2.\overline{12}`` = 70/33 and
    ``0.\overline{9}`` = 1. The repeating block is capped at ``limits.MAX_REPEATING_DIGITS``
    digits, the digits before it at ``limits.MAX_NUMBER_DIGITS``; longer ones are not read (None).

    >>> parse_repeating_decimal(r"0.1\overline{6}")
    Fraction(1, 6)
    """
    m = _REPEATING_RE.match(text.strip())
    if m is None:
        return None
    sign, whole, fixed, period = m.groups()
    if len(whole) + len(fixed) > MAX_NUMBER_DIGITS or len(period) > MAX_REPEATING_DIGITS:
        return None
    value = Fraction(int(whole or "0"))
    value += (Fraction(int(fixed or "0")) + Fraction(int(period), 10 ** len(period) - 1)) / 10 ** len(fixed)
    return -value if sign == "-" else value


def parse_number(text: str) -> Fraction | None:
    """Parse ``text`` as an exact rational number, or return None.

    >>> parse_number("-1.5e3")
    Fraction(-1500, 1)
    >>> parse_number("\\\\frac{10}{9}")
    Fraction(10, 9)
    """
    s = text.strip()
    if not s or len(s) > MAX_NUMBER_DIGITS + 40:
        return None
    m = _SCI_RE.match(s)
    if m:
        sign, mantissa, exp_e, exp_t = m.groups()
        return _decimal_to_fraction(sign, mantissa, exp_e if exp_e is not None else exp_t)
    for pattern in (_FRAC_RE, _SLASH_RE):
        m = pattern.match(s)
        if m:
            sign, num, den = m.groups()
            if len(num) > MAX_NUMBER_DIGITS or len(den) > MAX_NUMBER_DIGITS or int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign == "-" else value
    if "\\overline" in s:
        return parse_repeating_decimal(s)
    return None


def is_exact_literal(text: str) -> bool:
    """True for integers, integer fractions and repeating decimals (``0.\\overline{3}`` is 1/3 exactly)."""
    if _REPEATING_RE.match(text.strip()):
        return True
    return not re.search(r"[.eE]|\\times|\\cdot", text)


def close_numbers(a: Fraction | float, b: Fraction | float, rel_tol: float = 1e-9) -> bool:
    """True when a == b exactly, or |a - b| <= rel_tol * max(|a|, |b|).

    The tolerance is relative and tiny: it absorbs float round-off such as
    ``0.0833333333333333`` against ``1/12`` but keeps 25, 0.25 and 2500 apart, and keeps a
    rounded ``33.3`` apart from ``100/3``.
    """
    if a == b:
        return True
    scale = max(abs(a), abs(b))
    return abs(a - b) <= rel_tol * scale
