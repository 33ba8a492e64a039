r"""Split a normalised answer into its mathematical structure.

An answer is one of:

- ``Atom``: a single expression (``\frac{1}{3}``, ``2\sin b\cos a``, ``\text{odd}``);
- ``Seq``: a bare list ``1, 2`` (kind "list"), a set ``\{1, 2\}`` ("set") or a bracketed tuple or
  interval ``(1, 2]`` ("tuple", with its opening and closing bracket);
- ``Union``: intervals or sets joined by ``\cup``;
- ``Relation``: a chain ``a op b op c`` with op in ``= != < <= > >=``;
- ``Matrix``: a ``pmatrix``/``bmatrix``/``array`` literal; ``MatrixExpr``: literals joined by
  ``+``, ``-`` or products.

``x \pm y`` becomes the list ``x + y, x - y``; ``x \in S`` becomes ``S``; ``;`` separates
solutions (``p=5,q=2;p=7,q=2`` is a list of two tuples); ``x = 5 + 5 + 1 = 11`` keeps its first
and last member. This module only splits strings; it never evaluates anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxrl4llm.rewards.limits import MAX_ELEMENTS
from jaxrl4llm.rewards.normalization import is_name

_OPEN = "([{"
_CLOSE = ")]}"
_REL_RE = re.compile(r"<=|>=|!=|=|<|>")
_MATRIX_RE = re.compile(
    r"\\begin\{(?:pmatrix|bmatrix|Bmatrix|vmatrix|matrix|smallmatrix|array)\}(?:\{[^{}]*\})?(.*?)\\end\{(?:pmatrix|bmatrix|Bmatrix|vmatrix|matrix|smallmatrix|array)\}",
    re.DOTALL,
)


@dataclass(frozen=True)
class Atom:
    text: str


@dataclass(frozen=True)
class Seq:
    kind: str  # "list" | "set" | "tuple"
    items: tuple
    open: str = ""
    close: str = ""


@dataclass(frozen=True)
class Union:
    parts: tuple


@dataclass(frozen=True)
class Relation:
    parts: tuple  # strings
    ops: tuple  # strings, len(parts) - 1


@dataclass(frozen=True)
class Matrix:
    rows: tuple  # tuple of tuples of strings


@dataclass(frozen=True)
class MatrixExpr:
    terms: tuple  # Matrix objects
    ops: tuple  # "+", "-" or "*" between consecutive terms


Answer = Atom | Seq | Union | Relation | Matrix | MatrixExpr


def split_top(text: str, separators: str | tuple[str, ...]) -> list[str]:
    """Split ``text`` at separators that are outside all brackets."""
    seps = (separators,) if isinstance(separators, str) else separators
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif depth == 0:
            for sep in seps:
                if text.startswith(sep, i) and not (sep[0].isalpha() and i > 0 and text[i - 1] == "\\"):
                    if sep.startswith("\\") and text[i + len(sep) : i + len(sep) + 1].isalpha():
                        continue
                    parts.append(text[start:i])
                    start = i + len(sep)
                    i = start - 1
                    break
        i += 1
    parts.append(text[start:])
    return parts


def _wrapped(text: str, open_tok: str, close_tok: str) -> str | None:
    """Inside of ``text`` when one bracket pair opened at the start closes at the very end."""
    if not (text.startswith(open_tok) and text.endswith(close_tok)) or len(text) < len(open_tok) + len(close_tok):
        return None
    inner = text[len(open_tok) : len(text) - len(close_tok)]
    depth = 0
    for ch in inner:
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                return None
    return inner if depth == 0 else None


def _bracketed(text: str) -> tuple[str, str, str] | None:
    """(open, inner, close) when ``text`` is one (..), [..], (..] or [..) group."""
    if len(text) < 2 or text[0] not in "([" or text[-1] not in ")]":
        return None
    depth = 0
    for i, ch in enumerate(text):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0 and i != len(text) - 1:
                return None
    return text[0], text[1:-1], text[-1]


def _parse_matrix(body: str) -> Matrix:
    rows = [r for r in re.split(r"\\\\", body)]
    cells = [tuple(c.strip() for c in r.split("&")) for r in rows]
    while cells and all(not c for c in cells[-1]):
        cells.pop()
    return Matrix(tuple(cells))


def _parse_matrices(text: str) -> Answer | None:
    matches = list(_MATRIX_RE.finditer(text))
    if not matches:
        return None
    terms, ops, pos = [], [], 0
    for k, m in enumerate(matches):
        gap = text[pos : m.start()].strip()
        if k == 0:
            if gap not in ("", "(", "["):
                return None
        else:
            gap = gap.replace(r"\cdot", "*").replace(r"\times", "*").strip()
            if gap in ("", "*"):
                ops.append("*")
            elif gap in ("+", "-"):
                ops.append(gap)
            else:
                return None
        terms.append(_parse_matrix(m.group(1)))
        pos = m.end()
    if text[pos:].strip() not in ("", ")", "]"):
        return None
    return terms[0] if len(terms) == 1 else MatrixExpr(tuple(terms), tuple(ops))


def _expand_pm(text: str) -> list[str]:
    count = len(re.findall(r"\\(?:pm|mp)(?![a-zA-Z])", text))
    if count != 1:
        return [text]
    plus = re.sub(r"\\(?:pm|mp)(?![a-zA-Z])", "+", text)
    minus = re.sub(r"\\(?:pm|mp)(?![a-zA-Z])", "-", text)
    return [plus.strip().lstrip("+").strip(), minus.strip()]


def _relation(text: str) -> Relation | None:
    pieces, ops, depth, start, i = [], [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif depth == 0:
            m = _REL_RE.match(text, i)
            if m:
                pieces.append(text[start:i].strip())
                ops.append(m.group(0))
                i = start = m.end()
                continue
        i += 1
    if not ops:
        return None
    pieces.append(text[start:].strip())
    if any(not p for p in pieces):
        return None
    if len(ops) > 1 and all(op == "=" for op in ops):
        pieces, ops = [pieces[0], pieces[-1]], ["="]
    return Relation(tuple(pieces), tuple(ops))


def parse_item(text: str) -> Answer:
    """Structure of one list element (no top-level commas)."""
    s = text.strip()
    variants = _expand_pm(s)
    if len(variants) > 1:
        return Seq("list", tuple(parse_item(v) for v in variants))
    m = re.match(r"^(.*?)\\in(?![a-zA-Z])(.*)$", s, flags=re.DOTALL)
    if m and is_name(m.group(1)) and m.group(2).strip():
        return parse_answer(m.group(2))
    inner = _wrapped(s, r"\{", r"\}")
    if inner is not None:
        return Seq("set", tuple(parse_item(p) for p in split_top(inner, (",", ";")) if p.strip()))
    inner = _wrapped(s, "{", "}")
    if inner is not None:
        return parse_answer(inner)
    matrices = _parse_matrices(s)
    if matrices is not None:
        return matrices
    union = split_top(s, r"\cup")
    if len(union) > 1:
        return Union(tuple(parse_item(p) for p in union))
    rel = _relation(s)
    if rel is not None:
        return rel
    group = _bracketed(s)
    if group is not None:
        open_, inner, close = group
        items = split_top(inner, ",")
        if len(items) > 1:
            return Seq("tuple", tuple(parse_item(p) for p in items[:MAX_ELEMENTS]), open_, close)
        if open_ == "(" and close == ")":
            return parse_item(inner)
    return Atom(s)


def parse_answer(text: str) -> Answer:
    """Structure of a normalised answer string (see the module docstring)."""
    s = text.strip()
    if ";" in s:
        # ";" inside brackets separates coordinates; at top level it separates solutions.
        out, depth = [], 0
        for ch in s:
            if ch in _OPEN:
                depth += 1
            elif ch in _CLOSE:
                depth = max(depth - 1, 0)
            out.append("," if ch == ";" and depth > 0 else ch)
        s = "".join(out)
        solutions = [p.strip() for p in split_top(s, ";") if p.strip()]
        if len(solutions) > 1:
            s = ", ".join(f"({p})" if len(split_top(p, ",")) > 1 else p for p in solutions)
    items = [p for p in split_top(s, ",") if p.strip()]
    if len(items) > 1:
        parsed = []
        for p in items[:MAX_ELEMENTS]:
            item = parse_item(p)
            parsed.extend(item.items if isinstance(item, Seq) and item.kind == "list" else [item])
        return Seq("list", tuple(parsed))
    return parse_item(s)
