r"""Symbolic equality with sympy on parsed LaTeX (runs only inside sandbox workers).

Expressions are read with ``latex_parser.parse_simple`` (plain arithmetic, fast) or else with
``sympy.parsing.latex.parse_latex``; both build sympy objects from a parse tree and never
evaluate Python code. Two expressions are equal when

1. they are structurally identical, or
2. they have no free symbols and agree numerically to a relative 1e-9 (30-digit evaluation), or
3. they agree at several fixed pseudo-random points of their free symbols (and disagree
   nowhere), or
4. ``simplify(a - b) == 0``.

Two relations are equal when (lhs - rhs) of one is a constant multiple of the other's, the
constant being positive for inequalities (so ``-x > -1`` equals ``x < 1``, and
``2x + 4y - 3 = 0`` equals ``y = -x/2 + 3/4``).

Guards: answers with a power tower or an exponent above ``limits.MAX_EXPONENT``, or a factorial
of a number above ``limits.MAX_FACTORIAL`` (``100000!``, ``(20!)!``), are refused; a double
factorial of an integer (``5!!`` = 15) is replaced by its value before parsing, since ``parse_latex``
would read it as ``(5!)!``; any other ``!!`` is refused. Factorials of
integers are evaluated exactly (``\frac{10!}{8!}`` is exactly 90). The caller runs all of this
under the sandbox's wall-clock limit anyway.
"""

from __future__ import annotations

import functools
import math
import re

import mpmath
import sympy
from sympy.parsing.latex import parse_latex

from jaxrl4llm.rewards.latex_parser import Unsupported, parse_simple
from jaxrl4llm.rewards.limits import MAX_EXACT_DIGITS, MAX_EXPONENT, MAX_FACTORIAL, MAX_NUMBER_DIGITS

_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
    "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
    "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega",
}
_REFUSE_RE = re.compile(r"\\(?:text|in|cup|cap|begin|end|boxed|mathrm|emptyset|varnothing|angle|overline)(?![a-zA-Z])|[,=<>:;&]|!!")
_POINTS = (
    (1.3127, -0.7411, 2.1953, 0.4519, -1.6289, 0.8863),
    (-0.5813, 1.7719, 0.3361, -2.2447, 1.1173, -0.9551),
    (2.4401, 0.6257, -1.3969, 1.8733, -0.2837, 1.5521),
    (0.9277, -1.9133, 1.4459, 0.7781, 2.0117, -1.2203),
)
_INT_POINTS = ((3, 4, 5, 6, 7, 8), (5, 3, 7, 4, 6, 9), (4, 6, 3, 8, 5, 7))


class _Refused(Exception):
    """The expression is outside what the verifier agrees to evaluate."""


_DOUBLE_FACTORIAL_RE = re.compile(r"(?<![\d.^_{])(\d{1,6})\s*!!(?!!)")


def _expand_double_factorials(s: str) -> str:
    """Replace the double factorial of an integer by its value: ``5!!`` -> ``15``, ``6!!`` -> ``48``.

    Rule: n!! = n (n-2) (n-4) ... down to 1 or 2. ``parse_latex`` reads ``5!!`` as ``(5!)!``, so the
    value is written in before parsing; n above ``limits.MAX_FACTORIAL`` raises _Refused. An
    operand that is not a plain integer (``(2n)!!``) is left as is and refused by ``to_sympy``.
    """

    def value(m: re.Match) -> str:
        n = int(m.group(1))
        if n > MAX_FACTORIAL:
            raise _Refused("double factorial too large")
        return f"({sympy.factorial2(n)})"

    return _DOUBLE_FACTORIAL_RE.sub(value, s) if "!!" in s else s


def _prepare(text: str) -> str:
    s = text.strip()
    s = s.replace("**", "^")
    s = re.sub(r"\\(?:dfrac|tfrac|cfrac)", r"\\frac", s)
    s = re.sub(r"(\d)\s*\\%", r"\1", s)
    s = re.sub(r"\\operatorname\{([^{}]*)\}", r"\\\1", s)
    s = re.sub(r"\\mathrm\{([a-zA-Z])\}", r"\1", s)
    s = re.sub(r"\barc(sin|cos|tan)\b", r"\\arc\1", s)
    s = re.sub(r"(?<![\\a-zA-Z])(sin|cos|tan|cot|sec|csc|log|ln|exp|sqrt|pi)(?![a-zA-Z])", r"\\\1", s)
    return s


def _factorial_magnitude(node: sympy.Basic) -> float:
    """Rough upper bound of |n!| (or Gamma(n)); raises _Refused when n > ``limits.MAX_FACTORIAL``.

    Rule: n! is evaluated only for n <= MAX_FACTORIAL, and the bound is n! itself (inf once it
    leaves the float range), so ``(20!)!`` is refused: its argument is about 2.4e18.
    """
    n = _magnitude(node.args[0])
    if n > MAX_FACTORIAL:
        raise _Refused("factorial too large")
    try:
        return math.exp(math.lgamma(n + 1.0))
    except OverflowError:
        return math.inf


def _magnitude(node: sympy.Basic) -> float:
    """Rough upper bound of |node| (symbols count as 10); raises _Refused on astronomical powers."""
    if node.is_Number:
        try:
            return abs(float(node))
        except (OverflowError, TypeError):
            return math.inf
    if isinstance(node, sympy.Symbol) or node.is_NumberSymbol or node is sympy.I:
        return 10.0
    if isinstance(node, (sympy.Pow, sympy.exp)):
        base, exp = (node.base, node.exp) if isinstance(node, sympy.Pow) else (sympy.E, node.args[0])
        b, e = _magnitude(base), _magnitude(exp)
        if e > MAX_EXPONENT and b not in (0.0, 1.0):
            raise _Refused("exponent too large")
        try:
            return max(b, 1.0) ** e
        except OverflowError:
            return math.inf
    if isinstance(node, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma)):
        return _factorial_magnitude(node)
    args = [_magnitude(a) for a in node.args]
    if not args:
        return 10.0
    if node.is_Mul:
        return math.prod(max(a, 1.0) for a in args)
    return sum(args) + 10.0


def _check_size(expr: sympy.Basic) -> None:
    if sympy.count_ops(expr, visual=False) > 400:
        raise _Refused("expression too large")
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Integer) and abs(int(node)).bit_length() > 4 * MAX_NUMBER_DIGITS:
            raise _Refused("number too long")
        if isinstance(node, sympy.Symbol):
            name = node.name
            if len(name) > 1 and "_" not in name and name not in _GREEK:
                raise _Refused(f"unknown symbol {name}")
    _magnitude(expr)


def _fix_constants(expr: sympy.Basic) -> sympy.Basic:
    subs = {}
    for sym in expr.free_symbols:
        if sym.name == "e":
            subs[sym] = sympy.E
        elif sym.name == "pi":
            subs[sym] = sympy.pi
        elif sym.name == "i":
            subs[sym] = sympy.I
    return expr.xreplace(subs) if subs else expr


@functools.lru_cache(maxsize=4096)
def to_sympy(text: str) -> sympy.Expr | None:
    """Parse one LaTeX expression (no relations, no lists) or return None."""
    try:
        s = _expand_double_factorials(_prepare(text))
    except _Refused:
        return None
    if not s or _REFUSE_RE.search(re.sub(r"_\{[^{}]*\}", "_", s)):
        return None
    try:
        try:
            expr = parse_simple(s)
        except (Unsupported, RecursionError):
            expr = parse_latex(s)
        expr = _fix_constants(expr)
        _check_size(expr)
    except (_Refused, Exception):  # noqa: BLE001 - any parse failure means "not comparable"
        return None
    if isinstance(expr, sympy.core.relational.Relational):
        return None
    return expr


def _numeric(expr: sympy.Expr, subs: dict | None = None) -> mpmath.mpc | None:
    """30-digit value as an mpmath complex (any exponent range), or None if not a finite number."""
    try:
        if expr.has(sympy.Sum, sympy.Product):
            expr = (expr.xreplace(subs) if subs else expr).doit()
            subs = None
        value = expr.evalf(30, subs=subs) if subs else expr.evalf(30)
        re_part, im_part = value.as_real_imag()
        re_part, im_part = sympy.Float(re_part, 30), sympy.Float(im_part, 30)
        value = mpmath.mpc(mpmath.mpf(re_part._mpf_), mpmath.mpf(im_part._mpf_))
    except Exception:  # noqa: BLE001 - symbols left, undefined values...: not a number
        return None
    if mpmath.isnan(value) or mpmath.isinf(value):
        return None
    return value


def _close(a, b, rel_tol: float = 1e-9) -> bool:
    if a == b:
        return True
    return abs(a - b) <= rel_tol * max(abs(a), abs(b)) or abs(a - b) < 1e-20  # cancellation at 30 digits


def _simplify_is_affordable(expr: sympy.Expr) -> bool:
    """False for inputs on which ``simplify`` would expand huge powers (``(x+1)^{5000}``)."""
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number and not node.base.is_number:
            try:
                if abs(float(node.exp)) > 64:
                    return False
            except (TypeError, ValueError, OverflowError):
                return False
    return sympy.count_ops(expr) <= 200


def _points(symbols: list, integer: bool):
    table = _INT_POINTS if integer else _POINTS
    for row in table:
        if integer:
            yield {s: sympy.Integer(row[k % len(row)] + k // len(row)) for k, s in enumerate(symbols)}
        else:
            yield {s: row[k % len(row)] + (k // len(row)) * 0.37 for k, s in enumerate(symbols)}


def _needs_integers(expr: sympy.Basic) -> bool:
    return expr.has(sympy.Sum, sympy.Product, sympy.factorial, sympy.binomial)


def _digits_bound(node: sympy.Basic) -> float:
    """Rough upper bound of the decimal digits of an exact value built from integers, n! and powers.

    Rule: digits(a b) <= digits(a) + digits(b), digits(a + b) <= max + 1, digits(a^k) <= |k| digits(a),
    digits(n!) = log10(n!); anything else counts as 1. ``(1000!)^{10000}`` has about 25.7 million.
    """
    if node.is_Integer:
        return max(1.0, abs(int(node)).bit_length() * 0.302 + 1)
    if isinstance(node, sympy.factorial) and node.args[0].is_Integer:
        return math.lgamma(float(node.args[0]) + 1.0) / math.log(10) + 1
    if isinstance(node, sympy.Pow) and node.exp.is_Integer:
        return abs(int(node.exp)) * _digits_bound(node.base)
    if node.is_Mul:
        return sum(_digits_bound(a) for a in node.args)
    if node.is_Add:
        return max(_digits_bound(a) for a in node.args) + 1
    return max((_digits_bound(a) for a in node.args), default=1.0)


def _exact_rational(expr: sympy.Expr) -> sympy.Rational | None:
    """The exact value of an expression built from integers with + - * /, integer powers and n!.

    Factorials are exact too (``25!`` differs from ``25! + 1``); their size was bounded by
    ``_check_size``; a value of more than ``limits.MAX_EXACT_DIGITS`` digits raises _Refused
    (``(1000!)^{10000}`` is not multiplied out).
    """
    functions = expr.atoms(sympy.Function)
    if expr.atoms(sympy.Float) or expr.atoms(sympy.NumberSymbol) or any(
        not isinstance(f, sympy.factorial) for f in functions
    ):
        return None
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.is_Integer:
            return None
    if _digits_bound(expr) > MAX_EXACT_DIGITS:
        raise _Refused("exact value too long")
    try:
        value = expr.doit()
    except Exception:  # noqa: BLE001
        return None
    return value if value.is_Rational else None


def exprs_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Equality of two parsed expressions (rules 1-4 of the module docstring)."""
    if a == b:
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=lambda s: s.name)
    if not symbols:
        try:
            ra, rb = _exact_rational(a), _exact_rational(b)
        except _Refused:  # (1000!)^{10000}: not multiplied out, and not comparable
            return False
        if ra is not None and rb is not None:
            return ra == rb  # 10^{400} != 10^{400} + 1: exact arithmetic needs no tolerance
        va, vb = _numeric(a), _numeric(b)
        if va is not None and vb is not None:
            return _close(va, vb)
    else:
        agree = disagree = 0
        integer = _needs_integers(a) or _needs_integers(b)
        for subs in _points(symbols, integer):
            va, vb = _numeric(a, subs), _numeric(b, subs)
            if va is None or vb is None:
                continue
            if _close(va, vb):
                agree += 1
            else:
                disagree += 1
        if disagree:
            return False
        if agree >= 2:
            return True
    if not (_simplify_is_affordable(a) and _simplify_is_affordable(b)):
        return False
    try:
        return sympy.simplify(a - b) == 0
    except Exception:  # noqa: BLE001
        return False


def expressions_equal(a_text: str, b_text: str) -> bool:
    """Parse both LaTeX strings and compare them with ``exprs_equal``."""
    a, b = to_sympy(a_text), to_sympy(b_text)
    if a is None or b is None:
        return False
    return exprs_equal(a, b)


def relations_equal(lhs_a: str, rhs_a: str, lhs_b: str, rhs_b: str, op: str) -> bool:
    """Same solution set for ``lhs_a op rhs_a`` and ``lhs_b op rhs_b`` (op already aligned).

    True when (lhs_a - rhs_a) = c * (lhs_b - rhs_b) for a constant c != 0 (c > 0 when op is
    an inequality).
    """
    parts = [to_sympy(t) for t in (lhs_a, rhs_a, lhs_b, rhs_b)]
    if any(p is None for p in parts):
        return False
    da, db = parts[0] - parts[1], parts[2] - parts[3]
    if da == db:
        return True
    symbols = sorted(da.free_symbols | db.free_symbols, key=lambda s: s.name)
    ratios = []
    for subs in _points(symbols, _needs_integers(da) or _needs_integers(db)):
        va, vb = _numeric(da, subs), _numeric(db, subs)
        if va is None or vb is None or abs(vb) < 1e-12:
            continue
        ratios.append(va / vb)
    if len(ratios) < 2 or not all(_close(r, ratios[0]) for r in ratios):
        return False
    c = ratios[0]
    if abs(c) < 1e-12:
        return False
    if op in ("=", "!="):
        return True
    return abs(c.imag) < 1e-12 and c.real > 0


def matrix_value(rows: tuple, terms_ops=None) -> sympy.Matrix | None:
    """A sympy Matrix from rows of LaTeX cell strings, or None if a cell does not parse."""
    cells = []
    for row in rows:
        parsed = [to_sympy(c) for c in row]
        if any(p is None for p in parsed):
            return None
        cells.append(parsed)
    if not cells or any(len(r) != len(cells[0]) for r in cells):
        return None
    return sympy.Matrix(cells)


def warm_up() -> None:
    """Load the LaTeX parser and the evaluators once (the first call costs seconds)."""
    exprs_equal(to_sympy(r"\frac{\sqrt{2}}{2} + x"), to_sympy(r"x + \sin(\frac{\pi}{4})"))
    relations_equal("2x + 4y", "3", "y", r"-\frac{x}{2} + \frac{3}{4}", "=")
    exprs_equal(to_sympy(r"\sum_{k=1}^{n} k"), to_sympy(r"\frac{n(n+1)}{2}"))
    relation_solution_set(("1", "|x|", "2"), ("<=", "<="))  # imports the inequality solvers


_REL_FUNCS = {
    "<": sympy.StrictLessThan, "<=": sympy.LessThan, ">": sympy.StrictGreaterThan, ">=": sympy.GreaterThan,
}


def relation_solution_set(parts: tuple, ops: tuple) -> sympy.Set | None:
    """Real solution set of an inequality chain in one variable (``1 <= |z| <= 3/2``), or None."""
    if any(op not in _REL_FUNCS for op in ops):
        return None
    exprs = [to_sympy(p) for p in parts]
    if any(e is None for e in exprs):
        return None
    symbols = set().union(*(e.free_symbols for e in exprs))
    if len(symbols) != 1:
        return None
    (var,) = symbols
    real = sympy.Symbol(var.name, real=True)
    exprs = [e.xreplace({var: real}).doit() for e in exprs]
    result = sympy.S.Reals
    for (a, b), op in zip(zip(exprs, exprs[1:]), ops):
        try:
            piece = sympy.solve_univariate_inequality(_REL_FUNCS[op](a, b), real, relational=False)
        except Exception:  # noqa: BLE001 - sympy cannot solve it: not comparable
            return None
        result = sympy.Intersection(result, piece)
    return result


def interval_set(lo: str, hi: str, left_open: bool, right_open: bool) -> sympy.Set | None:
    """The real interval with LaTeX endpoints ``lo`` and ``hi``, or None."""
    a, b = to_sympy(lo), to_sympy(hi)
    if a is None or b is None or a.free_symbols or b.free_symbols:
        return None
    try:
        return sympy.Interval(a.doit(), b.doit(), left_open, right_open)
    except Exception:  # noqa: BLE001
        return None


def sets_equal(a: sympy.Set, b: sympy.Set) -> bool:
    """Equality of two real sets (both differences empty)."""
    try:
        return sympy.Complement(a, b) == sympy.S.EmptySet and sympy.Complement(b, a) == sympy.S.EmptySet
    except Exception:  # noqa: BLE001
        return False
