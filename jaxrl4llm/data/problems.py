"""Problems from dataset files (JSONL, JSON or parquet; local or gs://) in the layouts the community uses.

``load_problems`` reads a file (or a folder holding ``<split>.jsonl``/``.json``/``.parquet``) with
Hugging Face ``datasets`` and maps its fields automatically:

- problem text: ``problem``, ``question``, ``prompt``, ``query`` or ``input``;
- gold answer: ``answer`` (GSM8K's ``"... #### 72"`` keeps what follows ``####``; numbers such
  as AMC's ``27.0`` become ``"27"``), ``final_answer`` (OlympiadBench stores a list of LaTeX
  strings such as ``["$\\frac{1}{2}$"]``: its elements, ``$`` delimiters removed, joined with
  ``", "``; see ``format_gold``), ``gt_answer``, ``ground_truth``, ``target``; when there is none, the last
  ``\\boxed{}`` of ``solution`` (MATH, Minerva Math), read by the verifier's ``gold_answer``;
- context: a non-empty ``context`` field (OlympiadBench) goes before the problem text, separated
  by a blank line;
- id: ``id``, ``unique_id``, ``idx`` or ``<file stem>-<row>``; every other field goes to metadata.

Nothing is downloaded from the Hub: a missing file is an error that names the path. A gs:// file
(or folder) is copied once into a local cache and read there (``jaxrl4llm.storage.local_copy``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PROBLEM_KEYS = ("problem", "question", "prompt", "query", "input")
ANSWER_KEYS = ("answer", "final_answer", "gt_answer", "ground_truth", "target", "label")
SOLUTION_KEYS = ("solution", "reference_solution")
ID_KEYS = ("id", "unique_id", "idx", "uid", "problem_id")
CONTEXT_KEYS = ("context",)
_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Problem:
    """One math problem: its text, its gold answer as a string, an id and any other fields."""

    problem: str
    answer: str
    id: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


_MATH_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_SPAN_JOIN_RE = re.compile(r"(?<!\\)\$\s*,\s*\$")  # "$69$,$84$": one answer per math span


def _strip_math_dollars(text: str) -> str:
    return _MATH_DOLLAR_RE.sub("", _SPAN_JOIN_RE.sub(", ", text)).strip()


def format_gold(value: Any) -> str:
    """A gold answer as a string: ``27.0`` -> "27", ``0.5`` -> "0.5", ``"#### 72"`` -> "72".

    A list or tuple (OlympiadBench's ``final_answer``) gives its elements with their ``$`` math
    delimiters removed (an escaped ``\\$`` stays), joined with ``", "``: ``["$2^{1009}$"]`` ->
    "2^{1009}", ``["$69$,$84$"]`` -> "69, 84", ``["3", "5"]`` -> "3, 5"; the verifier compares
    comma-separated answers element by element. An empty list gives "".
    """
    if isinstance(value, (list, tuple)):
        parts = [_strip_math_dollars(format_gold(v)) for v in value]
        return ", ".join(p for p in parts if p)
    if isinstance(value, bool) or value is None:
        raise ValueError(f"gold answer must be a string or a number, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"gold answer must be finite, got {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text


def _resolve(path: Path, split: str | None) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        names = [split] if split else ["test", "train", "validation"]
        for name in names:
            for suffix in _SUFFIXES:
                candidate = path / f"{name}{suffix}"
                if candidate.is_file():
                    return candidate
        found = sorted(p.name for p in path.iterdir() if p.suffix in _SUFFIXES)
        raise FileNotFoundError(
            f"no {'/'.join(names)} split in {path} (looked for <split>.jsonl/.json/.parquet); "
            f"files there: {found or 'none'}. Pass split=... or the file path itself."
        )
    raise FileNotFoundError(
        f"dataset file {path} does not exist; pass the path of a local .jsonl, .json or .parquet file "
        "(nothing is downloaded)"
    )


class MissingFieldError(KeyError):
    """A field ``load_problems`` needs is not in the file. ``kwarg`` is the argument that picks
    it (``problem_key`` or ``answer_key``), ``explicit`` its value (None: automatic), ``tried``
    the names looked for, ``columns`` the file's fields: a caller can say which setting to fix."""

    def __init__(self, message: str, *, kwarg: str, explicit: str | None, tried: list[str], columns: list[str]):
        super().__init__(message)
        self.message, self.kwarg, self.explicit, self.tried, self.columns = message, kwarg, explicit, tried, columns

    def __str__(self) -> str:
        return self.message


class BadRowError(ValueError):
    """A row has an empty problem or no usable answer; ``kwarg`` names the argument that picks
    the field (``problem_key`` or ``answer_key``), ``row`` the row's index in the file."""

    def __init__(self, message: str, *, kwarg: str, row: int):
        super().__init__(message)
        self.kwarg, self.row = kwarg, row


def _head(file: Path, size: int = 1 << 16) -> bytes:
    with open(file, "rb") as f:
        return f.read(size)


def _pick(columns: list[str], explicit: str | None, candidates: tuple[str, ...], what: str, kwarg: str) -> str | None:
    if explicit is not None:
        if explicit not in columns:
            raise MissingFieldError(f"{what} field {explicit!r} not found; available fields: {columns}. Fix {kwarg}=...",
                                    kwarg=kwarg, explicit=explicit, tried=[explicit], columns=columns)
        return explicit
    return next((c for c in candidates if c in columns), None)


def load_problems(
    path: str | Path,
    *,
    problem_key: str | None = None,
    answer_key: str | None = None,
    split: str | None = None,
) -> list[Problem]:
    """Load problems with gold answers from a JSONL, JSON or parquet file, local or gs://.

    Args:
      path: a file, or a folder containing ``<split>.jsonl`` (or .json/.parquet); gs:// is
        copied once into a local cache (``jaxrl4llm.storage.local_copy``).
      problem_key: field holding the problem text (default: auto, see module docstring).
      answer_key: field holding the gold answer (default: auto; a MATH-style ``solution``
        field is used through its last ``\\boxed{}`` when there is no answer field).
      split: which split to read when ``path`` is a folder (default: test, then train).

    Returns:
      A list of ``Problem`` in file order.

    Raises:
      FileNotFoundError: the file (or split) does not exist.
      MissingFieldError (a KeyError): a needed field is missing; the message lists the available fields.
      BadRowError (a ValueError): a row has an empty problem or no usable answer.
      ValueError: the file is empty or cannot be parsed.
    """
    import datasets

    from jaxrl4llm.storage import is_remote, local_copy

    if is_remote(path):
        copy = local_copy(path)
        if not copy.exists():
            raise FileNotFoundError(f"dataset file {path} does not exist (no object at or below it); pass the gs:// "
                                    f"path of a .jsonl, .json or .parquet file")
        file = _resolve(copy, split)
    else:
        file = _resolve(Path(path).expanduser(), split)
    builder = _SUFFIXES.get(file.suffix)
    if builder is None:
        raise ValueError(f"unsupported file type {file.suffix!r} for {file}; use .jsonl, .json or .parquet")
    if builder == "json" and not _head(file).strip():
        raise ValueError(f"{file} is empty: it holds no problems (one JSON object a line, each with a problem and an "
                         f"answer field)")
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(file), split="train")
    except Exception as err:  # noqa: BLE001 - datasets wraps the parse error; name the file instead
        cause = err.__cause__ or err.__context__ or err
        hint = "every line must be one JSON object" if file.suffix == ".jsonl" else f"it must be valid {builder}"
        raise ValueError(f"could not read {file}: {type(cause).__name__}: {str(cause)[:300]} ({hint})") from err
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    columns = list(ds.column_names)
    pkey = _pick(columns, problem_key, PROBLEM_KEYS, "problem", "problem_key")
    if pkey is None:
        raise MissingFieldError(f"{file}: no problem field (tried {list(PROBLEM_KEYS)}); available fields: {columns}. "
                                "Pass problem_key=...", kwarg="problem_key", explicit=None, tried=list(PROBLEM_KEYS),
                                columns=columns)
    akey = _pick(columns, answer_key, ANSWER_KEYS, "answer", "answer_key")
    skey = None if akey is not None else next((c for c in SOLUTION_KEYS if c in columns), None)
    if akey is None and skey is None:
        raise MissingFieldError(f"{file}: no answer field (tried {list(ANSWER_KEYS + SOLUTION_KEYS)}); available "
                                f"fields: {columns}. Pass answer_key=...", kwarg="answer_key", explicit=None,
                                tried=list(ANSWER_KEYS + SOLUTION_KEYS), columns=columns)
    ikey = next((c for c in ID_KEYS if c in columns), None)
    ckey = next((c for c in CONTEXT_KEYS if c in columns and c not in (pkey, akey)), None)

    problems = []
    for row_index, row in enumerate(ds):
        text = row[pkey]
        if not isinstance(text, str) or not text.strip():
            raise BadRowError(f"{file}: row {row_index} has an empty {pkey!r} field", kwarg="problem_key", row=row_index)
        context = row[ckey] if ckey is not None else None
        if isinstance(context, str) and context.strip():
            text = context.strip() + "\n\n" + text
        if akey is not None:
            answer = format_gold(row[akey]) if row[akey] is not None else ""
        else:
            from jaxrl4llm.rewards.extraction import gold_answer

            solution = row[skey] or ""
            answer = gold_answer(solution).strip() if "\\boxed" in solution or "\\fbox" in solution else ""
        if not answer:
            raise BadRowError(f"{file}: row {row_index} has no usable answer in {akey or skey!r}; fix the row or "
                              "pass answer_key=...", kwarg="answer_key", row=row_index)
        pid = str(row[ikey]) if ikey is not None and row[ikey] is not None else f"{file.stem}-{row_index}"
        metadata = {k: v for k, v in row.items() if k not in (pkey, akey)}
        problems.append(Problem(problem=text, answer=answer, id=pid, metadata=metadata))
    return problems


def problem_to_record(problem: Problem, **extra: Any) -> dict:
    """The JSONL record of a problem (``problem``/``answer``/``id`` + metadata + ``extra``)."""
    record = {k: v for k, v in problem.metadata.items() if k not in ("problem", "answer", "id")}
    record.update(problem=problem.problem, answer=problem.answer, id=problem.id)
    record.update(extra)
    return record
