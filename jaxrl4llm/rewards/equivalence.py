r"""Equivalence of two answers: strings, then exact numbers, then structure, then sympy.

``answers_equal(pred, gold)`` is the full comparison. It is pure but may call sympy, which can
take unbounded time on hostile input, so the public entry points run it inside the sandbox
(``rewards.sandbox``); ``quick_verdict`` is the cheap part that the caller's process may run.

Rules, in order:

1. the normalised strings are equal (``\dfrac{1}{2}`` vs ``\frac12``);
2. both are numbers: exact rational equality, else relative difference <= 1e-9
   (``27.0`` == ``27``, ``0.0833333333333333`` == ``1/12``; ``25``, ``0.25``, ``2500`` differ);
   a ``%`` on one side only also accepts value/100 (``28\%`` == ``0.28``);
3. structure (``rewards.structure``): tuples and intervals element by element with the same
   brackets, lists and sets as sets, unions part by part or else as sets of reals (a union
   against an interval too: ``(-\infty, 1) \cup [1, \infty)`` is the reals), matrices cell by cell; an
   assignment ``x = 5`` or ``(p, q) = (3, 2)`` against a bare value compares the value;
   ``a <= x < b`` against an interval compares the interval;
4. words (``\text{odd}``), single letters (multiple choice) and base/time notations
   (``204_5``, ``12:00``) compare as strings only;
5. everything else compares symbolically (``rewards.symbolic``).
"""

from __future__ import annotations

import re

from jaxrl4llm.rewards.limits import within_answer_limits
from jaxrl4llm.rewards.normalization import compact, is_name, normalize_answer
from jaxrl4llm.rewards.numbers import close_numbers, is_exact_literal, parse_number
from jaxrl4llm.rewards.structure import (
    Atom,
    Matrix,
    MatrixExpr,
    Relation,
    Seq,
    Union,
    parse_answer,
    parse_item,
)

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}


def quick_verdict(pred: str, gold: str) -> bool | None:
    """True/False when cheap rules decide (normalised strings or two plain numbers), else None.

    Both arguments must already be normalised with ``normalize_answer``. No sympy is used, so
    this is safe to run in the caller's process.
    """
    if compact(pred) == compact(gold):
        return True
    if pred.endswith("%") or gold.endswith("%"):
        return None
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        return _numbers_equal(a, b, pred, gold)
    return None


def _numbers_equal(a, b, a_text: str, b_text: str) -> bool:
    """Exact for two exact literals (integers, integer fractions); else relative 1e-9."""
    if is_exact_literal(a_text) and is_exact_literal(b_text):
        return a == b
    return close_numbers(a, b)


def answers_equal(pred: str, gold: str) -> bool:
    """Full comparison of a predicted answer and a gold answer (raw strings, not normalised)."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g or not within_answer_limits(p) or not within_answer_limits(g):
        return False
    verdict = quick_verdict(p, g)
    if verdict is not None:
        return verdict
    return _equal(parse_answer(p), parse_answer(g))


# ----------------------------------------------------------------------------- atoms

def _is_text(s: str) -> bool:
    plain = re.sub(r"\\[a-zA-Z]+", " ", s)
    return bool(re.search(r"[A-Za-z]{3,}", plain))


def _is_opaque(s: str) -> bool:
    """Notations that sympy would misread: bases (204_5), times/ratios (12:00), letters only.

    The lone letter ``i`` is the imaginary unit, not a choice letter: ``\\sqrt{-1}`` equals ``i``.
    """
    return bool(
        re.fullmatch(r"[0-9A-Fa-f]+_\{?\d+\}?", s)
        or ":" in s
        or (re.fullmatch(r"[A-Za-z]", s) and s != "i")
    )


def _numbers_with_percent(x: str, y: str) -> bool | None:
    px, py = x.endswith("%"), y.endswith("%")
    xs, ys = x.rstrip("%").strip(), y.rstrip("%").strip()
    if px == py:
        return atoms_equal(xs, ys)
    nx, ny = parse_number(xs), parse_number(ys)
    if nx is None or ny is None:
        return atoms_equal(xs, ys)
    if close_numbers(nx, ny):
        return True
    return close_numbers(nx / 100, ny) if px else close_numbers(nx, ny / 100)


def atoms_equal(x: str, y: str) -> bool:
    """Equality of two single expressions (rules 1, 2, 4 and 5 of the module docstring)."""
    x, y = x.strip(), y.strip()
    if compact(x) == compact(y):
        return True
    if x.endswith("%") or y.endswith("%"):
        return bool(_numbers_with_percent(x, y))
    nx, ny = parse_number(x), parse_number(y)
    if nx is not None and ny is not None:
        return _numbers_equal(nx, ny, x, y)
    mc = re.match(r"^\(([A-E])\)\s+[^\s+\-*/^=<>]", x)  # "(C) 12" is choice C; "(C) + 1" is not
    if mc and re.fullmatch(r"[A-E]", y):
        return mc.group(1) == y
    if _is_text(x) or _is_text(y):
        return compact(x).lower() == compact(y).lower()
    if _is_opaque(x) or _is_opaque(y):
        return False
    from jaxrl4llm.rewards import symbolic  # sympy is imported only where it is needed

    if nx is not None or ny is not None:
        number, number_text = (nx, x) if nx is not None else (ny, y)
        other = symbolic.to_sympy(y if nx is not None else x)
        if other is None:
            return False
        if is_exact_literal(number_text):
            value = symbolic.sympy.Rational(number.numerator, number.denominator)
        else:  # a decimal: compared with the relative tolerance, never exactly
            value = symbolic.sympy.Float(symbolic.sympy.Rational(number.numerator, number.denominator), 40)
        return symbolic.exprs_equal(value, other)
    return symbolic.expressions_equal(x, y)


# ----------------------------------------------------------------------------- relations

def _orient(rel: Relation) -> Relation:
    """Write a chain with < / <= (reversing it when it uses > / >=)."""
    if rel.ops and all(op in (">", ">=") for op in rel.ops):
        return Relation(tuple(reversed(rel.parts)), tuple(_FLIP[op] for op in reversed(rel.ops)))
    return rel


def _is_assignment(a) -> bool:
    return isinstance(a, Relation) and a.ops == ("=",) and is_name(a.parts[0])


def _value(rel: Relation, *, lenient: bool):
    """The value of ``name = value`` (or, leniently, of ``<numeric work> = value``)."""
    if rel.ops != ("=",):
        return None
    lhs, rhs = rel.parts
    if is_name(lhs) or (lenient and not re.search(r"[A-Za-z]", re.sub(r"\\[a-zA-Z]+", "", lhs))):
        return parse_item(rhs)
    return None


def _as_interval(rel: Relation):
    r"""``a < x <= b`` -> ``(a, b]``; ``x >= a`` -> ``[a, \infty)``; else None."""
    rel = _orient(rel)
    if any(op not in ("<", "<=") for op in rel.ops):
        if len(rel.ops) == 1 and rel.ops[0] in (">", ">="):
            lhs, rhs = rel.parts
            rel = Relation((rhs, lhs), (_FLIP[rel.ops[0]],))
        else:
            return None
    br_open = {"<": "(", "<=": "["}
    br_close = {"<": ")", "<=": "]"}
    if len(rel.parts) == 3 and is_name(rel.parts[1]) and "|" not in rel.parts[1]:
        return Seq("tuple", (Atom(rel.parts[0]), Atom(rel.parts[2])), br_open[rel.ops[0]], br_close[rel.ops[1]])
    if len(rel.parts) == 2:
        lhs, rhs = rel.parts
        if is_name(lhs) and "|" not in lhs:
            return Seq("tuple", (Atom(r"-\infty"), Atom(rhs)), "(", br_close[rel.ops[0]])
        if is_name(rhs) and "|" not in rhs:
            return Seq("tuple", (Atom(lhs), Atom(r"\infty")), br_open[rel.ops[0]], ")")
    return None


def _relations_equal(p: Relation, g: Relation) -> bool:
    if _is_assignment(p) and _is_assignment(g) and compact(p.parts[0]) == compact(g.parts[0]):
        return _equal(parse_item(p.parts[1]), parse_item(g.parts[1]))
    p, g = _orient(p), _orient(g)
    if len(p.parts) == 2 and len(g.parts) == 2 and p.ops[0] in (">", ">=", "<", "<="):
        if g.ops[0] == _FLIP[p.ops[0]] and g.ops[0] != p.ops[0]:
            g = Relation(tuple(reversed(g.parts)), (p.ops[0],))
    if p.ops != g.ops:
        return False
    if len(p.parts) > 2:
        return all(atoms_equal(a, b) for a, b in zip(p.parts, g.parts))
    if compact(p.parts[0]) == compact(g.parts[0]) and _equal(parse_item(p.parts[1]), parse_item(g.parts[1])):
        return True
    from jaxrl4llm.rewards import symbolic

    return symbolic.relations_equal(p.parts[0], p.parts[1], g.parts[0], g.parts[1], p.ops[0])


# ----------------------------------------------------------------------------- sequences

def _same_elements(a_items, b_items) -> bool:
    def covered(xs, ys):
        return all(any(_equal(x, y) for y in ys) for x in xs)

    return covered(a_items, b_items) and covered(b_items, a_items)


def _assignment_map(items):
    if not items or not all(_is_assignment(i) for i in items):
        return None
    names = [compact(i.parts[0]) for i in items]
    if len(set(names)) != len(names):
        return None
    return {n: parse_item(i.parts[1]) for n, i in zip(names, items)}


def _strip_names(items):
    out = []
    for item in items:
        if _is_assignment(item):
            value = _value(item, lenient=False)
            if isinstance(value, Seq) and value.kind == "list":
                out.extend(value.items)
            else:
                out.append(value)
        else:
            out.append(item)
    return tuple(out)


def _seqs_equal(p: Seq, g: Seq) -> bool:
    pm, gm = _assignment_map(p.items), _assignment_map(g.items)
    if pm is not None and gm is not None and set(pm) == set(gm):
        return all(_equal(pm[k], gm[k]) for k in pm)
    pi, gi = _strip_names(p.items), _strip_names(g.items)
    if p.kind == "set" or g.kind == "set" or (p.kind == "list" and g.kind == "list"):
        return _same_elements(pi, gi)
    if p.kind == "tuple" and g.kind == "tuple" and (p.open, p.close) != (g.open, g.close):
        return False
    brackets = (p.open, p.close) if p.kind == "tuple" else (g.open, g.close)
    if (p.kind == "list" or g.kind == "list") and brackets != ("(", ")"):
        return False
    return len(pi) == len(gi) and all(_equal(a, b) for a, b in zip(pi, gi))


# ----------------------------------------------------------------------------- matrices

def _matrix_value(m):
    from jaxrl4llm.rewards import symbolic

    if isinstance(m, Matrix):
        return symbolic.matrix_value(m.rows)
    value = _matrix_value(m.terms[0])
    for op, term in zip(m.ops, m.terms[1:]):
        other = _matrix_value(term)
        if value is None or other is None:
            return None
        try:
            value = value + other if op == "+" else value - other if op == "-" else value * other
        except Exception:  # noqa: BLE001 - shape mismatch
            return None
    return value


def _matrices_equal(p, g) -> bool:
    if isinstance(p, Matrix) and isinstance(g, Matrix):
        if len(p.rows) != len(g.rows) or any(len(a) != len(b) for a, b in zip(p.rows, g.rows)):
            return False
        return all(atoms_equal(a, b) for ra, rb in zip(p.rows, g.rows) for a, b in zip(ra, rb))
    from jaxrl4llm.rewards import symbolic

    a, b = _matrix_value(p), _matrix_value(g)
    if a is None or b is None or a.shape != b.shape:
        return False
    return all(symbolic.exprs_equal(x, y) for x, y in zip(a, b))


def _as_real_set(answer):
    """A sympy set for an interval, a union of intervals or an explicit set; else None."""
    from jaxrl4llm.rewards import symbolic

    if isinstance(answer, Seq) and answer.kind == "tuple" and len(answer.items) == 2:
        lo, hi = answer.items
        if not (isinstance(lo, Atom) and isinstance(hi, Atom)):
            return None
        return symbolic.interval_set(lo.text, hi.text, answer.open == "(", answer.close == ")")
    if isinstance(answer, Seq) and answer.kind == "set":
        values = [symbolic.to_sympy(i.text) if isinstance(i, Atom) else None for i in answer.items]
        values = [v.doit() if v is not None else None for v in values]
        return None if any(v is None for v in values) else symbolic.sympy.FiniteSet(*values)
    if isinstance(answer, Union):
        parts = [_as_real_set(p) for p in answer.parts]
        return None if any(p is None for p in parts) else symbolic.sympy.Union(*parts)
    return None


def _real_sets_equal(p, g) -> bool:
    r"""Intervals, unions of intervals and finite sets compared as sets of reals.

    Rule: a union and an interval (or two unions) are equal when they cover the same reals,
    e.g. ``(-\infty, 1) \cup [1, \infty)`` equals ``(-\infty, \infty)`` (the spelling of
    ``\mathbb{R}``), while ``(-\infty, 1) \cup (1, \infty)`` does not.
    """
    a, b = _as_real_set(p), _as_real_set(g)
    if a is None or b is None:
        return False
    from jaxrl4llm.rewards import symbolic

    return symbolic.sets_equal(a, b)


def _relation_matches_set(rel: Relation, other) -> bool:
    r"""``1 <= |z| <= 3/2`` against ``[-3/2, -1] \cup [1, 3/2]``: same real solution set."""
    from jaxrl4llm.rewards import symbolic

    target = _as_real_set(other)
    if target is None:
        return False
    solution = symbolic.relation_solution_set(rel.parts, rel.ops)
    return solution is not None and symbolic.sets_equal(solution, target)


# ----------------------------------------------------------------------------- dispatch

def _equal(p, g) -> bool:
    if p is None or g is None:
        return False
    if isinstance(p, Relation) and isinstance(g, Relation):
        return _relations_equal(p, g)
    if isinstance(p, Relation) or isinstance(g, Relation):
        rel, other = (p, g) if isinstance(p, Relation) else (g, p)
        if isinstance(other, (Seq, Union)) and not _is_assignment(rel):
            interval = _as_interval(rel)
            if interval is not None:
                return _equal(interval, other)
            return _relation_matches_set(rel, other)
        value = _value(rel, lenient=rel is p)
        if value is None:
            return False
        return _equal(value, g) if rel is p else _equal(p, value)
    if isinstance(p, Union) != isinstance(g, Union) and isinstance(p, (Seq, Union)) and isinstance(g, (Seq, Union)):
        return _real_sets_equal(p, g)
    if isinstance(p, Seq) and isinstance(g, Seq):
        return _seqs_equal(p, g)
    if isinstance(p, Seq) and len(p.items) == 1 and p.kind != "tuple":
        return _equal(p.items[0], g)
    if isinstance(g, Seq) and len(g.items) == 1 and g.kind != "tuple":
        return _equal(p, g.items[0])
    if isinstance(p, Union) and isinstance(g, Union):
        if len(p.parts) == len(g.parts) and _same_elements(p.parts, g.parts):
            return True
        return _real_sets_equal(p, g)
    if isinstance(p, (Matrix, MatrixExpr)) and isinstance(g, (Matrix, MatrixExpr)):
        return _matrices_equal(p, g)
    if isinstance(p, Atom) and isinstance(g, Atom):
        return atoms_equal(p.text, g.text)
    return False


__all__ = ["answers_equal", "atoms_equal", "quick_verdict"]
