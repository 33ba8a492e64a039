"""Find the final answer in a model response.

Order of the rules (the first that applies wins):

1. Only the text after the last ``</think>`` counts; text after a chat-template marker such as
   ``<|im_start|>`` or a new "\n\nQuestion:" turn (a model continuing the conversation on its
   own) is cut off.
2. The last ``\\boxed{...}`` / ``\\boxed ...`` / ``\\fbox{...}`` (nested braces allowed). Boxes that
   follow each other with only a few connecting words (``\\boxed{1} and \\boxed{2}``) form one
   answer list. A "Final Answer: ..." sentence written *after* the last box wins over the box.
3. The last "final answer is ...", "the answer is ...", "Answer: ..." or ``#### ...`` phrase.
4. A short response that is an answer by itself (``-5``, ``$x=11$``, ``28 percent``).
5. The last inline or display math (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``).
6. The last number in the text (``1,000.99``, ``2/3``, ``-4.5``).

Scanning is linear in the response length. Responses longer than ``limits.MAX_RESPONSE_CHARS``
or with brackets nested deeper than ``limits.MAX_NESTING_DEPTH`` have no answer (reward 0).
"""

from __future__ import annotations

import re

from jaxrl4llm.rewards.limits import MAX_NESTING_DEPTH, MAX_RESPONSE_CHARS, nesting_depth
from jaxrl4llm.rewards.normalization import collapse_double_backslashes

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_STOP_MARKERS = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
    # A base model that keeps going writes the next turn of its few-shot format.
    "\n\nQuestion:", "\n\nHuman:", "\n\nUser:",
)
_FINAL_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer\s+is|(?<![a-z])answer\s*:|####)\s*(?:is\s*)?(?:[:=]\s*)?",
    re.IGNORECASE
)
_EXCLAMATION_RE = re.compile(r"!+\s*$")
_HOPE_RE = re.compile(r"I\s+hope\s+it\s+is\s+correct.*$", re.IGNORECASE | re.DOTALL)
_NUMBER_RE = re.compile(
    r"(?<![A-Za-z0-9.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?%?(?![0-9])"
    r"|(?<![A-Za-z0-9])[-\u2212]?\.\d+(?![A-Za-z0-9])"
)
# Words allowed between consecutive boxes that together form one answer list.
_BOX_JOINER_RE = re.compile(
    r"^(?:[\s,;.$&]|\\[()\[\]]|\\q?quad|\\[,;! ]|\\text\{[^{}]*\}|and|or|for|part|\([a-z]\)|[a-z](?:_\{?\d+\}?)?\s*=|\\\\)*$"
)


def matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_index``; None if unbalanced or too deep."""
    depth = 0
    i = open_index
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                return None
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


_BARE_TOKEN_RE = re.compile(r"[^\s$]+")


BOX_OPEN = "\\boxed{"


def has_complete_box(text: str) -> bool:
    """True when `text` holds a `\\boxed{...}` whose brace closes: an answer is written."""
    start = text.find(BOX_OPEN)
    while start >= 0:
        if matching_brace(text, start + len(BOX_OPEN) - 1) is not None:
            return True
        start = text.find(BOX_OPEN, start + 1)
    return False


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """The outermost boxed answers as (start, end, content), in order of appearance.

    A box inside another box is part of the outer one's content (``\\boxed{\\boxed{5}}`` is one
    box), so the scan resumes after the end of each box it reads.
    """
    found = []
    pos = 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return found
        pos = m.end()
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            close = matching_brace(text, j)
            if close is not None:
                found.append((m.start(), close + 1, text[j + 1 : close]))
                pos = close + 1
        else:  # "\boxed 5": the token up to whitespace or a dollar sign
            tok = _BARE_TOKEN_RE.match(text, j)
            if tok and m.end() < j:
                found.append((m.start(), tok.end(), tok.group(0)))
                pos = tok.end()


def _unwrap_nested_box(content: str) -> str:
    r"""The answer inside a box that itself holds a box: the inner box wins.

    Models box twice or box a sentence that boxes the answer:
    ``\boxed{\boxed{5}}`` -> ``5``; ``\boxed{\text{The answer is } \boxed{5}}`` -> ``5``.
    The recursion is bounded by the brace depth (``limits.MAX_NESTING_DEPTH``).
    """
    if not _BOX_RE.search(content):
        return content
    inner = _last_box_group(content)
    return inner[1] if inner is not None else content


def _last_box_group(text: str) -> tuple[int, str, int] | None:
    """Start position, content and end position of the last box, merged with boxes joined to it by "and".

    A box nested in another box counts as its content (``_unwrap_nested_box``).
    """
    boxes = _boxes(text)
    if not boxes:
        return None
    group = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        between = text[prev[1] : group[0][0]]
        if len(between) > 60 or not _BOX_JOINER_RE.match(between):
            break
        group.insert(0, prev)
    content = ", ".join(_unwrap_nested_box(b[2]).strip() for b in group)
    return group[0][0], content, group[-1][1]


_DELIM_RE = re.compile(r"\$\$|\\\[|\\\]|\\\(|\\\)|\\\$|\$")
_CLOSER = {"$$": "$$", "\\[": "\\]", "\\(": "\\)", "$": "$"}


def _span_bounds(text: str) -> list[tuple[int, int, int, int]]:
    """(open_start, content_start, content_end, close_end) of math spans, in one linear pass.

    Delimiters: ``$$..$$``, ``$..$``, ``\\(..\\)``, ``\\[..\\]``; an escaped ``\\$`` is text.
    """
    spans, opener, start, content = [], None, 0, 0
    for m in _DELIM_RE.finditer(text):
        tok = m.group(0)
        if tok == "\\$":
            continue
        if opener is None:
            if tok in _CLOSER:
                opener, start, content = tok, m.start(), m.end()
        elif tok == _CLOSER[opener]:
            spans.append((start, content, m.start(), m.end()))
            opener = None
    return spans


def _math_spans(text: str) -> list[str]:
    """Contents of $$..$$, $..$, \\(..\\) and \\[..\\] spans, in order of appearance."""
    return [text[a:b] for _, a, b, _ in _span_bounds(text) if text[a:b].strip()]


def _last_span_end(text: str) -> int:
    spans = _span_bounds(text)
    return spans[-1][3] if spans else 0


def _last_number(text: str) -> str | None:
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace("\u2212", "-") if numbers else None


def _words(text: str) -> list[str]:
    """Natural-language words (3+ letters) outside LaTeX commands and math spans."""
    pieces, last = [], 0
    for start, _, _, end in _span_bounds(text):
        pieces.append(text[last:start])
        last = end
    pieces.append(text[last:])
    plain = " ".join(pieces)
    plain = re.sub(r"\\(?:begin|end)\{[a-zA-Z*]*\}|\\[a-zA-Z]+", " ", plain)
    return re.findall(r"[A-Za-z]{3,}", plain)


def _answer_from_phrase(tail: str) -> str | None:
    """The answer inside the text that follows "final answer", e.g. "The largest $n$ is 34."."""
    tail = _HOPE_RE.sub("", tail).lstrip("*_: \t")  # markdown "**Answer:** 7"
    tail = re.split(r"\n\s*\n", tail.strip(), maxsplit=1)[0]
    tail = re.sub(r"^\s*(?:the\s+final\s+answer\s+is|the\s+answer\s+is)\s*:?", "", tail, flags=re.IGNORECASE)
    masked = list(tail)  # look for " is " only outside math spans
    for start, _, _, end in _span_bounds(tail):
        masked[start:end] = "\x00" * (end - start)
    verbs = list(re.finditer(r"\s(?:is|are|equals)\s", "".join(masked)))
    if verbs and tail[verbs[-1].end() :].strip():
        tail = tail[verbs[-1].end() :]
    tail = tail.strip()
    if not tail:
        return None
    spans = _math_spans(tail)
    if spans and len(_words(tail)) <= 1:
        return ", ".join(s.strip() for s in spans)
    if len(_words(tail)) <= 1:
        return _EXCLAMATION_RE.sub("", tail)  # "the answer is 42!" is excited, not 42 factorial
    if spans:
        return spans[-1]
    return _last_number(tail)


def extract_answer(response: str) -> str | None:
    r"""The final answer written in ``response``, as a raw string, or None if there is none.

    >>> extract_answer(r"so $x = 2$. Thus the area is $\boxed{\frac{1}{2}}$.")
    '\\frac{1}{2}'
    >>> extract_answer("Final Answer: The final answer is 16386.16. I hope it is correct.")
    '16386.16.'
    """
    if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
        return None
    text = response
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    for marker in _STOP_MARKERS:
        cut = text.find(marker)
        if cut > 0:
            text = text[:cut]
    text = collapse_double_backslashes(text)
    if not text.strip() or nesting_depth(text) > MAX_NESTING_DEPTH:
        return None

    box = _last_box_group(text)
    phrases = list(_FINAL_RE.finditer(text))
    phrase = phrases[-1] if phrases else None
    # A "Final answer:" inside the last box (``\boxed{\text{Final answer: } \boxed{3}}``) is part of it.
    if box is not None and (phrase is None or phrase.start() < box[2] or "final" not in phrase.group(0).lower()):
        return box[1]
    if phrase is not None:
        found = _answer_from_phrase(text[phrase.end() :])
        if found:
            return found
    if box is not None:
        return box[1]
    stripped = text.strip()
    spans = _math_spans(text)
    words = _words(stripped)
    if len(stripped) <= 200 and (not words or (len(words) == 1 and not spans)):
        return stripped
    if spans:
        last_span_end = _last_span_end(text)
        trailing_number = _last_number(text[last_span_end:])
        return trailing_number if trailing_number is not None else spans[-1]
    return _last_number(text)


def gold_answer(gold) -> str:
    r"""The comparable text of a gold answer: ``27.0`` -> "27.0"; ``$\boxed{5}$`` -> "5".

    Gold answers are trusted dataset fields, but some are stored boxed or inside ``$...$``;
    an unclosed ``\boxed{`` keeps the rest of the string.
    """
    text = collapse_double_backslashes(str(gold))
    box = _last_box_group(text)
    if box is not None:
        return box[1]
    m = _BOX_RE.search(text)
    if m:
        return text[m.end() :].lstrip(" {")
    return text
