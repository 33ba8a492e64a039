"""Canonical form of a math answer string (both the prediction and the gold).

``normalize_answer`` rewrites the LaTeX and plain-text spellings that mean the same thing into
one spelling, so that most equal answers are already equal as strings and the later rules
(numbers, structure, sympy) see clean input:

- math delimiters ``$``, ``\\(``, ``\\[`` and ``\\left``/``\\right`` sizing are dropped;
- ``\\dfrac``/``\\tfrac``/``\\cfrac`` become ``\\frac``, ``\\frac12`` becomes ``\\frac{1}{2}``, a
  mixed number ``1\\frac{4}{5}`` (integer, then a proper fraction) becomes ``\\frac{9}{5}``;
- ``\\text{..}``-style wrappers are unwrapped, trailing units (``125 miles``, ``15\\text{ cm}^2``)
  are dropped, "and"/"or" between answers become commas;
- degrees (``^\\circ``), dollars (``\\$``) and thousands separators (``1,000``, ``14{,}916``,
  ``11,\\!111``, ``1 000``) are removed, ``\\%``/"percent"/"pct" become a trailing ``%``;
- relation symbols get one spelling (``\\geq`` -> ``>=``, ``\\neq`` -> ``!=``), ``x \\approx 11``
  keeps the exact value, a multiple-choice ``(C)``/``\\text{(C)}`` becomes ``C``;
- trailing sentence punctuation is removed (a ``!`` after a digit or bracket is a factorial, kept);
- a trigonometric function of an angle in degrees (``\\sin 30^\\circ``) gets the angle in radians;
- named sets get one spelling: the reals (``\\mathbb{R}``, "all real numbers") become
  ``(-\\infty, \\infty)``, the empty set (``\\varnothing``, ``\\{\\}``, "no solution", "none")
  becomes ``\\emptyset``; ``\\imath`` becomes ``i``.

Everything here is plain string rewriting with linear-time regular expressions; nothing
parses or evaluates the answer.
"""

from __future__ import annotations

import functools
import re

# LaTeX command names that a response sometimes writes with a doubled backslash
# (``\\frac``), e.g. when the text went through one JSON escape too many.
_KNOWN_COMMANDS = (
    "boxed|fbox|frac|dfrac|tfrac|cfrac|sqrt|left|right|pi|text|textbf|mathrm|mathbf|le|ge|leq|"
    "geq|neq|ne|lt|gt|cdot|times|infty|circ|in|cup|cap|pm|mp|quad|qquad|sin|cos|tan|cot|sec|"
    "csc|log|ln|exp|theta|alpha|beta|gamma|delta|begin|end|dots|ldots|cdots|approx|mbox|"
    "textnormal|operatorname|overline|angle|sum|prod|binom|emptyset|varnothing|mathbb|displaystyle"
)
_DOUBLE_BACKSLASH_RE = re.compile(rf"(?<!\\)\\\\(?=(?:{_KNOWN_COMMANDS})(?![a-zA-Z]))")
_TEXT_WRAPPERS = r"text|textbf|textit|textrm|textsf|texttt|textnormal|mbox|mathrm|mathbf|mathit|mathsf|operatorname|rm|bf"
_TEXT_RE = re.compile(rf"\\(?:{_TEXT_WRAPPERS})\s*\{{([^{{}}]*)\}}")
_UNIT_WORDS = (
    "units?|square units?|sq units?|cm|centimeters?|centimetres?|mm|millimeters?|m|meters?|metres?|km|"
    "kilometers?|inch(?:es)?|in|ft|feet|foot|yards?|yd|miles?|mi|mph|kmh|seconds?|secs?|s|minutes?|"
    "mins?|hours?|hrs?|h|days?|weeks?|months?|years?|yrs?|grams?|g|kg|kilograms?|pounds?|lbs?|lb|"
    "ounces?|oz|liters?|litres?|l|ml|gallons?|dollars?|cents?|euros?|yuan|rupees?|degrees?|deg|"
    "radians?|rad|people|persons?|students?|apples?|ways?|points?|times|square|cubic|sq|cu"
)
_UNIT_RE = re.compile(rf"^((?:{_UNIT_WORDS})(?:\s+(?:{_UNIT_WORDS}))*)\.?$", re.IGNORECASE)
_TRAILING_POWER_RE = re.compile(r"\^\s*\{?\s*[23]\s*\}?\s*$")
_SPACING_RE = re.compile(r"(?<!\\)\\[,:;! ]|\\q?quad|\\hspace\*?\{[^{}]*\}|~")
_SIZING_RE = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![a-zA-Z])\s*\.?")
_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u2264": "<=", "\u2265": ">=", "\u2260": "!=", "\u00d7": r"\times ",
    "\u00b7": r"\cdot ", "\u03c0": r"\pi ", "\u221e": r"\infty ", "\u221a": r"\sqrt", "\u00b0": r"^\circ ",
    "\u00b2": "^2", "\u00b3": "^3", "\u2009": " ", "\u00a0": " ", "\u202f": " ", "\u20ac": "",
    "\u00a3": "", "\u2248": r"\approx ",
}
_NAME_SUBSCRIPT_RE = re.compile(r"_\{[^{}]*\}|_[A-Za-z0-9]")


def collapse_double_backslashes(text: str) -> str:
    r"""Turn ``\\frac`` into ``\frac`` for known command names (over-escaped responses)."""
    return _DOUBLE_BACKSLASH_RE.sub(r"\\", text)


def is_name(text: str) -> bool:
    r"""True when ``text`` names a quantity rather than computing one.

    Names are the left-hand sides that answers like ``x = 5``, ``f(x) = 1``, ``(p, q) = (3, 2)``,
    ``|AB| = 1``, ``\frac{NO}{BO} = ...``, ``V_1 : V_2 = 11:21`` or ``a_{37} = 19`` put before the
    value: they contain a letter, no digit outside subscripts and no arithmetic operator. So
    ``7 = 11a + c`` and ``a + 3z = 0`` are equations, not assignments.
    """
    s = text.strip()
    if not s or len(s) > 40:
        return False
    core = _NAME_SUBSCRIPT_RE.sub("", s)
    core = re.sub(r"\\[a-zA-Z]+", "", core)  # command names such as \frac, \angle, \overline
    if re.search(r"\d|[+\-*^=<>!]", core):
        return False
    return bool(re.search(r"[A-Za-z]", core))


def _unwrap_text(s: str) -> str:
    for _ in range(8):
        new = _TEXT_RE.sub(lambda m: " " + m.group(1) + " ", s)
        if new == s:
            break
        s = new
    return s


def _strip_units(s: str) -> str:
    """Drop trailing unit words after a numeric head: ``125 miles`` -> ``125``, ``15 m/s`` -> ``15``.

    Scans backwards over letters, spaces, dots and the ``/`` of a rate unit (no backtracking
    regex: the input is untrusted and a nested-quantifier pattern would take exponential time).
    A ``/`` right after the number (``3/s``) is a division, not a unit, and is kept.
    """
    body = _TRAILING_POWER_RE.sub("", s).rstrip()
    i = len(body)
    while i > 0 and (body[i - 1].isascii() and (body[i - 1].isalpha() or body[i - 1] in " ./" )):
        i -= 1
    while i < len(body) and not body[i].isalpha():
        i += 1  # the words start at a letter
    if i >= len(body) or (i > 0 and body[i - 1] == "\\"):
        return s
    head, words = body[:i].strip(), body[i:].strip()
    if not head or not re.search(r"\d", head) or len(words) > 60 or head.endswith("/"):
        return s
    value = head.rsplit("=", 1)[-1]  # "x = 5 cm": the units follow the value
    if not re.search(r"\d", value) or re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", value)):
        return s  # e.g. "2 x y": letters in the value are variables, not units
    if "/" in words:  # a rate: every word on both sides of the slash is a unit
        return head if all(_UNIT_RE.match(w.strip()) for w in words.split("/")) else s
    if _UNIT_RE.match(words) or all(len(w) >= 3 for w in words.replace(".", " ").split()):
        return head
    return s


_MIXED_NUMBER_RE = re.compile(r"(?<![\w^{}.)\\])(\d{1,9})\s*\\frac\{(\d{1,9})\}\{(\d{1,9})\}")


def _mixed_number(m: re.Match) -> str:
    whole, num, den = (int(g) for g in m.groups())
    if not 0 < num < den:
        return m.group(0)  # not a proper fraction: an ordinary product
    return rf"\frac{{{whole * den + num}}}{{{den}}}"


def _split_approx(s: str) -> str:
    r"""``x \approx 11`` -> ``x = 11``; ``x = 1/3 \approx 0.33`` -> ``x = 1/3``."""
    left, _, right = s.partition(r"\approx")
    left = left.strip()
    if not left or is_name(left):
        return (left + " = " if left else "") + right.strip()
    return left


_DEGREE_MARK = r"(?:\^\s*\{?\s*\\circ\s*\}?|\\degree(?![a-zA-Z]))"
_ANGLE = r"([+-]?\d{1,6}(?:\.\d{1,6})?)"
_TRIG_DEGREES_RE = re.compile(
    rf"\\(sin|cos|tan|cot|sec|csc)\s*(?:\(\s*{_ANGLE}\s*{_DEGREE_MARK}\s*\)|\{{\s*{_ANGLE}\s*{_DEGREE_MARK}\s*\}}"
    rf"|{_ANGLE}\s*{_DEGREE_MARK})"
)


def _trig_degrees(s: str) -> str:
    r"""An angle in degrees inside a trigonometric function becomes radians.

    Rule: ``\sin 30^\circ``, ``\cos(60^\circ)``, ``\tan{45^{\circ}}`` -> ``\sin(\frac{30\pi}{180})``
    etc., so that the later removal of degree marks (``90^\circ`` -> ``90``, right for a bare
    angle) cannot turn ``\sin 30^\circ`` into ``\sin 30`` (sine of 30 radians). Only a plain
    number of degrees is read; ``\sin 30`` without the mark stays in radians.
    """

    def radians(m: re.Match) -> str:
        angle = next(g for g in m.groups()[1:] if g is not None)
        return rf"\{m.group(1)}(\frac{{{angle}\pi}}{{180}})"

    return _TRIG_DEGREES_RE.sub(radians, s)


_REALS_SYMBOL_RE = re.compile(r"\\mathbb\s*(?:\{\s*R\s*\}|R(?![a-zA-Z]))(?!\s*[\^_])|\\R(?![a-zA-Z])(?!\s*[\^_])")
_REALS_WORDS_RE = re.compile(
    r"(?:the\s+)?(?:set\s+of\s+)?(?:all\s+)?real\s+numbers|all\s+reals|(?:all|any|every)\s+real\s+(?:numbers?|values?|x)"
    r"|(?:the\s+)?reals",
    re.IGNORECASE,
)
_EMPTY_SET_SYMBOL_RE = re.compile(r"\\(?:varnothing|emptyset)(?![a-zA-Z])|\\\{\s*\\\}")
_EMPTY_SET_WORDS_RE = re.compile(
    r"(?:there\s+(?:is|are)\s+)?no\s+(?:real\s+)?(?:solutions?|roots?|values?)|none|(?:the\s+)?empty\s+set",
    re.IGNORECASE,
)
REALS = r"(-\infty, \infty)"
EMPTY_SET = r"\emptyset"


def _named_set_symbols(s: str) -> str:
    r"""Named-set symbols get one spelling, wherever they stand.

    Rule: ``\mathbb{R}``, ``\mathbb R``, ``\R`` -> ``(-\infty, \infty)`` (not ``\mathbb{R}^2`` or
    ``\mathbb{R}_{>0}``); ``\varnothing``, ``\emptyset``, ``\{\}`` -> ``\emptyset``. So
    ``x \in \mathbb{R}`` reads as ``x \in (-\infty, \infty)``.
    """
    s = _REALS_SYMBOL_RE.sub(lambda _: " " + REALS + " ", s)
    return _EMPTY_SET_SYMBOL_RE.sub(lambda _: " " + EMPTY_SET + " ", s)


def _named_set_words(s: str) -> str:
    r"""A whole answer that names a set in words gets the set's symbol.

    Rule: "all real numbers", "all reals", "the reals" -> ``(-\infty, \infty)``; "no solution",
    "no real solutions", "none", "the empty set" -> ``\emptyset``. Only the whole answer is
    matched, so "none" inside a sentence is left alone.
    """
    if _REALS_WORDS_RE.fullmatch(s):
        return REALS
    if _EMPTY_SET_WORDS_RE.fullmatch(s):
        return EMPTY_SET
    return s


_IMAGINARY_UNIT_RE = re.compile(r"\\imath(?![a-zA-Z])")


def _is_factorial_operand_end(s: str) -> bool:
    """True when ``s`` ends with what a factorial ``!`` applies to: a digit, ``)``, ``}`` or a lone letter."""
    if not s:
        return False
    last = s[-1]
    if last.isdigit() or last in ")}":
        return True
    return last.isalpha() and (len(s) == 1 or not (s[-2].isalpha() or s[-2] == "\\"))


def _strip_trailing_punctuation(s: str) -> str:
    """Remove sentence punctuation at the end, but keep a factorial ``!`` (``5!``, ``(n+1)!``, ``n!``).

    Rule: trailing ``. , ; :`` always go; a trailing ``!`` goes unless it follows a digit, a
    ``)``, a ``}`` or a lone letter (``\\boxed{5!}`` is 120, "Evelyn!" is "Evelyn"; a sentence
    "so it is 42!" is cut to "42" by the extraction).
    """
    while True:
        s = s.rstrip(" .,;:")
        bare = s.rstrip("!")
        if bare != s and not _is_factorial_operand_end(bare):
            s = bare
            continue
        return s


# Patterns of normalize_answer, compiled once (it runs on every answer).
_THOUSANDS_BRACE_RE = re.compile(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d{3})")
_THOUSANDS_BANG_RE = re.compile(r"(?<=\d),\\!\s*(?=\d{3})")
_MATH_DELIM_RE = re.compile(r"\\[()\[\]]")
_STYLE_RE = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits)(?![a-zA-Z])")
_FRAC_VARIANT_RE = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_FRAC_TWO_DIGITS_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_DIGIT_BRACE_RE = re.compile(r"\\frac\s*(\d)\s*\{")
_FRAC_BRACE_DIGIT_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d|[a-zA-Z](?![a-zA-Z]))")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|\^\s*\{\s*\\text\{\s*o\s*\}\s*\}")
_PERCENT_RE = re.compile(r"\\?%|\\text\{\s*%\s*\}")
_PERCENT_WORD_RE = re.compile(r"(?<=[\d}])\s*(?:percentage|percent|pct)\b\.?", re.IGNORECASE)
_FONT_RE = re.compile(r"\\(?:mathbb|mathcal|boldsymbol|vec|hat)\s*\{([^{}]*)\}")
_GEQ_RE = re.compile(r"\\geq?(?:slant)?(?![a-zA-Z])|=>|\u2265")
_LEQ_RE = re.compile(r"\\leq?(?:slant)?(?![a-zA-Z])|=<")
_NEQ_RE = re.compile(r"\\neq?(?![a-zA-Z])")
_LT_RE = re.compile(r"\\lt(?![a-zA-Z])")
_GT_RE = re.compile(r"\\gt(?![a-zA-Z])")
_DOTS_RE = re.compile(r"\\(?:dots|ldots|cdots)(?![a-zA-Z])")
_AND_OR_RE = re.compile(r"(?<![a-zA-Z\\])(?:and|or)(?![a-z])")
_WHITESPACE_RE = re.compile(r"\s+")
_INF_WORD_RE = re.compile(r"(?<![a-zA-Z\\])(?:infinity|inf)(?![a-zA-Z])")
_PLUS_INF_RE = re.compile(r"\+\s*\\infty")
_REPEATED_COMMA_RE = re.compile(r",(?:\s*,)+")
_SPACE_PERCENT_RE = re.compile(r"\s*%$")


@functools.lru_cache(maxsize=16384)
def normalize_answer(text: str) -> str:
    """Canonical spelling of an answer string (see the module docstring for the rules)."""
    s = str(text)
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = collapse_double_backslashes(s)
    # Thousands separators written the LaTeX way: 14{,}916, 11,\!111, 14 {, }916.
    s = _THOUSANDS_BRACE_RE.sub("", s)
    s = _THOUSANDS_BANG_RE.sub("", s)
    s = s.replace(r"\$", " ").replace("$", " ")
    s = _MATH_DELIM_RE.sub(" ", s)
    s = _STYLE_RE.sub(" ", s)
    s = _SIZING_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _FRAC_VARIANT_RE.sub(r"\\frac", s)
    s = _FRAC_TWO_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_DIGIT_BRACE_RE.sub(r"\\frac{\1}{", s)
    s = _FRAC_BRACE_DIGIT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    s = _MIXED_NUMBER_RE.sub(_mixed_number, s)  # MATH writes 33\frac{1}{3} for 100/3
    s = _trig_degrees(s)  # before the degree marks go: \sin 30^\circ is not \sin 30
    # Degrees and percent.
    s = _DEGREE_RE.sub("", s)
    s = _PERCENT_RE.sub("%", s)
    s = _PERCENT_WORD_RE.sub("%", s)
    s = _unwrap_text(s)
    s = _named_set_symbols(s)  # before \mathbb{R} loses its font
    s = _IMAGINARY_UNIT_RE.sub(" i ", s)
    s = _FONT_RE.sub(r"\1", s)
    # Relation spellings.
    s = _GEQ_RE.sub(">=", s)
    s = _LEQ_RE.sub("<=", s)
    s = _NEQ_RE.sub("!=", s)
    s = _LT_RE.sub("<", s)
    s = _GT_RE.sub(">", s)
    s = _DOTS_RE.sub("", s)
    # "and" / "or" between answers are separators.
    s = _AND_OR_RE.sub(",", s)
    s = _WHITESPACE_RE.sub(" ", s).strip()
    if r"\approx" in s:
        s = _split_approx(s)
    # Infinity spellings.
    s = _INF_WORD_RE.sub(r"\\infty", s)
    s = _PLUS_INF_RE.sub(r"\\infty", s)
    # Commas left behind by "and" lists: "19, 46, , 82", leading/trailing separators.
    s = _REPEATED_COMMA_RE.sub(",", s)
    s = s.strip(" ,;")
    s = _strip_trailing_punctuation(s)
    s = s.strip()
    s = _named_set_words(s)
    s = _strip_units(s)
    s = _SPACE_PERCENT_RE.sub("%", s)
    # Multiple-choice letters: (C), C), (C.
    m = re.fullmatch(r"\(?\s*([A-Ea-e])\s*\)?", s)
    if m:
        s = m.group(1).upper() if s != m.group(1) else s
    # Plain thousands separators on a lone number: 7,425,000 / 1 000 / 1,000.99.
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", s):
        s = s.replace(",", "")
    elif re.fullmatch(r"[+-]?\d{1,3}(?: \d{3})+(?:\.\d+)?%?", s):
        s = s.replace(" ", "")
    if s.startswith("+") and not s.startswith("+-"):
        s = s[1:].lstrip()
    return s


def compact(text: str) -> str:
    """Remove whitespace that does not separate two letters (for string comparison)."""
    s = re.sub(r"\s+", " ", text.strip())
    s = re.sub(r"(?<=[^a-zA-Z]) | (?=[^a-zA-Z])", "", s)
    s = s.replace("{", "").replace("}", "") if not re.search(r"\\[a-zA-Z]", s) else s
    return s
