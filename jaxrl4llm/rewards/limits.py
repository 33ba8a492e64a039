"""Size and depth limits applied to untrusted model output before any parsing.

Model output is untrusted: a response can be megabytes long, nest ten thousand braces or
write a power tower whose value does not fit in memory. Every stage of the verifier checks
its input against these limits first and gives the reward 0 when one is exceeded.
"""

import re

#: Longest response (characters) that is searched for an answer; longer ones score 0.
MAX_RESPONSE_CHARS = 200_000
#: Longest extracted answer (characters) that is compared; longer ones score 0.
MAX_ANSWER_CHARS = 2_000
#: Deepest nesting of (), [], {} accepted in an answer.
MAX_NESTING_DEPTH = 40
#: Most digits accepted in one number literal.
MAX_NUMBER_DIGITS = 400
#: Most digits in the repeating block of a repeating decimal (``0.\overline{142857}``).
MAX_REPEATING_DIGITS = 60
#: Largest n whose factorial n! is evaluated; a larger factorial is refused (not comparable).
MAX_FACTORIAL = 1000
#: Most digits of an exact value (integer powers, factorials) that is multiplied out.
MAX_EXACT_DIGITS = 20_000
#: Largest |exponent| accepted in scientific notation or an integer power of a number.
MAX_EXPONENT = 10_000
#: Most elements in a tuple, list, set or matrix.
MAX_ELEMENTS = 256
#: Default hard wall-clock limit (seconds) of one symbolic comparison.
DEFAULT_TIMEOUT = 3.0


_NOT_BRACKET_RE = re.compile(r"[^()\[\]{}]+")


def nesting_depth(text: str) -> int:
    """Maximum bracket nesting depth of ``text`` counting (, [ and { alike."""
    depth = best = 0
    for ch in _NOT_BRACKET_RE.sub("", text):
        if ch in "([{":
            depth += 1
            if depth > best:
                best = depth
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return best


def within_answer_limits(text: str) -> bool:
    """True when an extracted answer is short enough and shallow enough to compare."""
    return len(text) <= MAX_ANSWER_CHARS and nesting_depth(text) <= MAX_NESTING_DEPTH
