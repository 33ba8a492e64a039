r"""A small recursive-descent parser for the common subset of LaTeX answers.

``parse_latex`` (ANTLR) costs 10-100 ms per call; most answers are plain arithmetic
(``3\sqrt{13}``, ``\frac{\pi}{2}``, ``2x^2 + 1``). This parser reads that subset in well under
a millisecond and builds the same kind of unevaluated sympy objects:

    expr   := term (("+" | "-") term)*
    term   := signed (("*" | \cdot | \times | "/") signed | power)*      (implicit products)
    signed := ("-" | "+") signed | power
    power  := atom ("^" (group | number | letter | \pi))?
    atom   := number | letter | \pi | \infty | "(" expr ")" | "{" expr "}"
            | \frac group group | \sqrt ("[" expr "]")? group

Anything else (functions, subscripts, factorials, absolute values, Greek letters...) raises
``Unsupported`` and the caller falls back to ``parse_latex``. Objects are built with
``evaluate=False``, so nothing is computed here (a power tower stays a tree for the size
checks of ``symbolic``).
"""

from __future__ import annotations

import re

import sympy

_TOKEN_RE = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\\[a-zA-Z]+)|([a-zA-Z])|(\S))")
_ATOM_START = {"\\frac", "\\sqrt", "\\pi", "\\infty", "(", "{"}
_TIMES = {"*", "\\cdot", "\\times"}


class Unsupported(Exception):
    """The text is outside the subset this parser reads."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            break
        number, command, letter, other = m.groups()
        if number is not None:
            out.append(("num", number))
        elif command is not None:
            out.append(("cmd", command))
        elif letter is not None:
            out.append(("var", letter))
        elif other is not None:
            out.append(("sym", other))
        pos = m.end()
    if text[pos:].strip():
        raise Unsupported(text[pos:])
    return out


def _mul(a, b):
    return sympy.Mul(a, b, evaluate=False)


def _div(a, b):
    return sympy.Mul(a, sympy.Pow(b, -1, evaluate=False), evaluate=False)


class _Parser:
    def __init__(self, tokens):
        self.toks = tokens
        self.i = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value=None):
        tok = self.peek()
        if tok[0] == "end" or (value is not None and tok[1] != value):
            raise Unsupported(f"expected {value!r}")
        self.i += 1
        return tok

    def expr(self):
        value = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            rhs = self.term()
            value = sympy.Add(value, rhs if op == "+" else _mul(sympy.Integer(-1), rhs), evaluate=False)
        return value

    def term(self):
        value = self.signed()
        while True:
            kind, tok = self.peek()
            if tok in _TIMES:
                self.take()
                value = _mul(value, self.signed())
            elif tok == "/":
                self.take()
                value = _div(value, self.signed())
                nxt_kind, nxt = self.peek()
                if nxt_kind in ("num", "var") or nxt in _ATOM_START:
                    raise Unsupported("implicit product after '/' (2/3x) is ambiguous")
            elif kind in ("num", "var") or tok in _ATOM_START:
                value = _mul(value, self.power())
            else:
                return value

    def signed(self):
        tok = self.peek()[1]
        if tok == "-":
            self.take()
            return _mul(sympy.Integer(-1), self.signed())
        if tok == "+":
            self.take()
            return self.signed()
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek()[1] != "^":
            return base
        self.take()
        kind, tok = self.peek()
        if tok == "{":
            exponent = self.group()
        elif kind == "num":
            self.take()
            if not tok.isdigit():
                raise Unsupported("decimal exponent without braces")
            # Like parse_latex (and plain-text writers of 2^10): all digits form the exponent.
            exponent = sympy.Integer(tok)
        elif kind == "var":
            self.take()
            exponent = sympy.Symbol(tok)
        elif tok == "\\pi":
            self.take()
            exponent = sympy.pi
        else:
            raise Unsupported("exponent")
        if self.peek()[1] == "^":
            raise Unsupported("ambiguous double exponent")
        return sympy.Pow(base, exponent, evaluate=False)

    def group(self):
        kind, tok = self.peek()
        if tok == "{":
            self.take()
            value = self.expr()
            self.take("}")
            return value
        if kind == "num" and tok.isdigit():  # \frac12 style: one digit
            self.take()
            if len(tok) > 1:
                self.toks.insert(self.i, ("num", tok[1:]))
            return sympy.Integer(tok[0])
        if kind == "var":
            self.take()
            return sympy.Symbol(tok)
        raise Unsupported("group")

    def atom(self):
        kind, tok = self.peek()
        if kind == "num":
            self.take()
            if tok.isdigit():
                return sympy.Integer(tok)
            # Decimals stay Floats (enough digits to hold the literal), as in parse_latex: a
            # decimal answer is compared with the 1e-9 tolerance, not as an exact rational.
            return sympy.Float(tok.rstrip(".") or "0", max(15, len(tok) + 2))
        if kind == "var":
            self.take()
            return sympy.Symbol(tok)
        if tok == "\\pi":
            self.take()
            return sympy.pi
        if tok == "\\infty":
            self.take()
            return sympy.oo
        if tok in ("(", "{"):
            self.take()
            value = self.expr()
            self.take(")" if tok == "(" else "}")
            return value
        if tok == "\\frac":
            self.take()
            num = self.group()
            return _div(num, self.group())
        if tok == "\\sqrt":
            self.take()
            index = None
            if self.peek()[1] == "[":
                self.take()
                index = self.expr()
                self.take("]")
            radicand = self.group()
            root = sympy.Rational(1, 2) if index is None else sympy.Pow(index, -1, evaluate=False)
            return sympy.Pow(radicand, root, evaluate=False)
        raise Unsupported(f"token {tok!r}")


def parse_simple(text: str) -> sympy.Expr:
    """Parse ``text`` if it is in the supported subset; raise ``Unsupported`` otherwise."""
    tokens = _tokens(text)
    if not tokens:
        raise Unsupported("empty")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.i != len(parser.toks):
        raise Unsupported(f"trailing {parser.peek()[1]!r}")
    return value
