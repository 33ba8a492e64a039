"""Problems from dataset files (JSONL, JSON or parquet; local or gs://) or Hugging Face Hub datasets
(``hf://org/name[:config][@split]``), in the layouts the community uses (ours, TRL's, verl's).

``load_problems`` reads a file (or a folder holding ``<split>.jsonl``/``.json``/``.parquet``, or a
Hub dataset) and maps its fields automatically:

- problem text: ``problem``, ``question``, ``prompt``, ``query`` or ``input``. A field holding a
  list of chat messages (``[{"role": "user", "content": ...}, ...]``, TRL's and verl's ``prompt``)
  is kept as ``Problem.messages`` and rendered with the tokenizer's chat template
  (``data/templates.py``); ``Problem.problem`` is then its last user message;
- gold answer: ``answer`` (GSM8K's ``"... #### 72"`` keeps what follows ``####``; numbers such
  as AMC's ``27.0`` become ``"27"``), ``final_answer`` (OlympiadBench stores a list of LaTeX
  strings such as ``["$\\frac{1}{2}$"]``: its elements, ``$`` delimiters removed, joined with
  ``", "``; see ``format_gold``), ``gt_answer``, ``ground_truth``, ``target``, ``label``,
  ``reward_model.ground_truth`` (verl); when there is none, the last ``\\boxed{}`` of ``solution``
  (MATH, Minerva Math), read by the verifier's ``gold_answer``, or a one-line ``solution`` with no
  ``\\boxed{}`` as it is (TRL's math sets store the final answer there). A dotted key
  (``answer_key="reward_model.ground_truth"``) reads a field inside a nested record;
- context: a non-empty ``context`` field (OlympiadBench) goes before the problem text, separated
  by a blank line;
- id: ``id``, ``unique_id``, ``idx`` or ``<file stem>-<row>``; every other field goes to metadata.

``require_answer=False`` (a reward that needs no gold answer, ``train/reward_fn.py``) accepts rows
without one: their answer is ``""``.

JSONL and JSON files are read with the json module; parquet files and Hub datasets with Hugging
Face ``datasets`` (imported only then). A Hub dataset's files come through huggingface_hub's cache
(``jaxrl4llm.models.hub``; HF_HOME, HF_TOKEN and HF_HUB_OFFLINE honoured), a gs:// file (or
folder) is copied once into a local cache and read there (``jaxrl4llm.storage.local_copy``); a
missing local file is an error that names the path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from jaxrl4llm.rewards.extraction import gold_answer
from jaxrl4llm.storage import is_remote, local_copy

PROBLEM_KEYS = ("problem", "question", "prompt", "query", "input")
ANSWER_KEYS = ("answer", "final_answer", "gt_answer", "ground_truth", "target", "label", "reward_model.ground_truth")
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
    # the row's prompt as chat messages ({"role", "content"} dicts, TRL's and verl's `prompt`), rendered
    # with the tokenizer's chat template; None: `problem` is plain text, wrapped by a prompt template
    messages: tuple[Mapping[str, Any], ...] | None = field(default=None, compare=False, hash=False)


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


HF_PREFIX = "hf://"


def is_hub_dataset(path: str | Path) -> bool:
    """Whether `path` names a Hugging Face Hub dataset (``hf://org/name[:config][@split]``)."""
    return str(path).startswith(HF_PREFIX)


def parse_hub_dataset(path: str) -> tuple[str, str | None, str | None]:
    """``hf://org/name[:config][@split]`` -> ("org/name", config or None, split or None)."""
    from jaxrl4llm.models.hub import parse_hub_id

    rest = str(path)[len(HF_PREFIX):]
    rest, _, split = rest.partition("@")
    repo, _, config = rest.partition(":")
    if parse_hub_id(repo) is None or (_ and not config) or ("@" in str(path) and not split):
        raise ValueError(f"{path!r} is not a Hub dataset name; write hf://org/name, hf://org/name@split or "
                         f"hf://org/name:config@split (e.g. hf://openai/gsm8k:main@train)")
    return repo, config or None, split or None


def source_name(path: str | Path) -> str:
    """A short name of a data source: a file's stem (``data/gsm8k_test.jsonl`` -> "gsm8k_test"), or a
    Hub dataset's name and split (``hf://openai/gsm8k:main@test`` -> "gsm8k-test"); eval metrics
    and row ids are named by it."""
    if is_hub_dataset(path):
        repo, _, split = parse_hub_dataset(str(path))
        return repo.split("/")[1] + (f"-{split}" if split else "")
    return Path(str(path)).stem


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
        f"dataset file {path} does not exist; pass the path of a local .jsonl, .json or .parquet file, or a Hub "
        "dataset as hf://org/name[:config][@split]"
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


_MISSING = object()


def field_value(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``, a dotted key reading inside nested records (``"reward_model.ground_truth"`` ->
    ``row["reward_model"]["ground_truth"]``); a KeyError naming the part that is missing."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _has(row: Mapping[str, Any] | None, key: str) -> bool:
    if row is None:
        return False
    try:
        field_value(row, key)
    except KeyError:
        return False
    return True


def _pick(columns: list[str], first: Mapping[str, Any] | None, explicit: str | None, candidates: tuple[str, ...],
          what: str, kwarg: str) -> str | None:
    """The field that holds `what`: `explicit` (an error when the file lacks it), else the first of
    `candidates` the file has (a dotted one is looked for in the first row)."""
    def present(key: str) -> bool:
        return key in columns or ("." in key and key.split(".")[0] in columns and _has(first, key))

    if explicit is not None:
        if not present(explicit) and not (first is None and explicit.split(".")[0] in columns):
            raise MissingFieldError(f"{what} field {explicit!r} not found; available fields: {columns}. "
                                    f"Fix {kwarg}=...", kwarg=kwarg, explicit=explicit, tried=[explicit],
                                    columns=columns)
        return explicit
    return next((c for c in candidates if present(c)), None)


def _json_rows(file: Path) -> tuple[list[str], list[dict]]:
    """(field names in order of first appearance, rows) of a JSONL file (one object a line) or a JSON
    file (a list of objects, or JSON lines); a field a row lacks is None there, as `datasets` reads it."""
    text = file.read_text()
    rows: Any = None
    if file.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None  # JSON lines in a .json file
        if rows is not None and not isinstance(rows, list):
            rows = [rows] if isinstance(rows, dict) else None
    if rows is None:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"could not read {file}: line {number}: {e} (every line must be one JSON object)") \
                    from None
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"could not read {file}: row {bad} is a {type(rows[bad]).__name__}, not a JSON object "
                         "(every line must be one JSON object)")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return columns, [{k: r.get(k) for k in columns} for r in rows]


def _datasets_rows(load) -> Any:
    """`load(datasets)` with datasets' progress bars off (imported here: only parquet files and Hub
    datasets need it)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return load(datasets)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _hub_rows(path: str, split: str | None) -> tuple[list[str], Iterable[dict], str]:
    """(fields, rows, name) of Hub dataset `path` (hf://org/name[:config][@split]): the repository's
    files through huggingface_hub's cache (`models.hub.resolve_dataset_repo`), read by `datasets`."""
    from jaxrl4llm.models.hub import resolve_dataset_repo

    repo, config, named_split = parse_hub_dataset(path)
    folder = resolve_dataset_repo(repo)
    try:
        splits = _datasets_rows(lambda datasets: datasets.load_dataset(str(folder), name=config))
    except Exception as err:  # noqa: BLE001 - datasets' own error, with the source named
        raise ValueError(f"could not read Hub dataset {path} ({folder}): {type(err).__name__}: {str(err)[:300]}") \
            from err
    want = named_split or split
    if want is None:
        if len(splits) != 1:
            raise ValueError(f"{path} has the splits {sorted(splits)}: name one, e.g. {path}@{sorted(splits)[0]}")
        want = next(iter(splits))
    if want not in splits:
        raise ValueError(f"{path} has no split {want!r}; its splits are {sorted(splits)} (hf://{repo}"
                         f"{':' + config if config else ''}@SPLIT)")
    ds = splits[want]
    return list(ds.column_names), ds, source_name(f"hf://{repo}@{want}")


def _file_rows(path: str | Path, split: str | None) -> tuple[list[str], Iterable[dict], str, Path]:
    """(fields, rows, name, file) of a local or gs:// file (or a folder's split)."""
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
    if builder == "json":
        if not _head(file).strip():
            raise ValueError(f"{file} is empty: it holds no problems (one JSON object a line, each with a problem and "
                             f"an answer field)")
        columns, rows = _json_rows(file)
        return columns, rows, file.stem, file
    try:
        ds = _datasets_rows(lambda datasets: datasets.load_dataset(builder, data_files=str(file), split="train"))
    except Exception as err:  # noqa: BLE001 - datasets wraps the parse error; name the file instead
        cause = err.__cause__ or err.__context__ or err
        raise ValueError(f"could not read {file}: {type(cause).__name__}: {str(cause)[:300]} (it must be valid "
                         f"{builder})") from err
    return list(ds.column_names), ds, file.stem, file


def chat_messages(value: Any) -> tuple[dict, ...] | None:
    """A prompt field's chat messages (a list of {"role": str, "content": str} records; fields
    that are None, as `datasets` fills them, dropped), or None when `value` is not a list; a
    ValueError saying what is wrong with a list that is no chat."""
    if not isinstance(value, (list, tuple)):
        return None
    if not value:
        raise ValueError("is an empty list of chat messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            raise ValueError(f"is a list whose item {i} ({str(message)[:80]!r}) is not a chat message "
                             '{"role": ..., "content": "..."} with a string content')
        messages.append({k: v for k, v in message.items() if v is not None})
    return tuple(messages)


def _solution_answer(solution: str) -> str:
    """The gold answer a solution field holds: its last \\boxed{} (MATH), else a one-line solution
    as it is (TRL's math sets store the final answer there), else ""."""
    if "\\boxed" in solution or "\\fbox" in solution:
        return gold_answer(solution).strip()
    return solution.strip() if "\n" not in solution.strip() else ""


def load_problems(
    path: str | Path,
    *,
    problem_key: str | None = None,
    answer_key: str | None = None,
    split: str | None = None,
    require_answer: bool = True,
) -> list[Problem]:
    """Load problems with gold answers from a JSONL, JSON or parquet file (local or gs://) or a Hub dataset.

    Args:
      path: a file, or a folder containing ``<split>.jsonl`` (or .json/.parquet); gs:// is
        copied once into a local cache (``jaxrl4llm.storage.local_copy``); ``hf://org/name``,
        ``hf://org/name@split`` or ``hf://org/name:config@split``: a Hugging Face Hub dataset
        (through huggingface_hub's cache, ``jaxrl4llm.models.hub``).
      problem_key: field holding the problem text or its chat messages (default: auto, see the module
        docstring); a dotted key reads inside a nested record.
      answer_key: field holding the gold answer (default: auto; a MATH-style ``solution``
        field is used through its last ``\\boxed{}`` when there is no answer field); a dotted key
        (``"reward_model.ground_truth"``, verl's layout) reads inside a nested record.
      split: which split to read when ``path`` is a folder (default: test, then train) or a Hub
        dataset without ``@split`` (default: its only split).
      require_answer: False: rows without a gold answer are kept with answer ``""`` (a reward that
        needs none); True (default): such a row is an error.

    Returns:
      A list of ``Problem`` in file order.

    Raises:
      FileNotFoundError: the file (or split) does not exist; a Hub dataset that cannot be fetched
        (``jaxrl4llm.models.hub.HubFilesMissing``, naming the command that fetches it).
      MissingFieldError (a KeyError): a needed field is missing; the message lists the available fields.
      BadRowError (a ValueError): a row has an empty problem or no usable answer.
      ValueError: the file is empty or cannot be parsed.
    """
    if is_hub_dataset(path):
        columns, rows, stem = _hub_rows(str(path), split)
        label = str(path)
    else:
        columns, rows, stem, file = _file_rows(path, split)
        label = str(file)
    first = next(iter(rows), None) if len(rows) else None
    pkey = _pick(columns, first, problem_key, PROBLEM_KEYS, "problem", "problem_key")
    if pkey is None:
        raise MissingFieldError(f"{label}: no problem field (tried {list(PROBLEM_KEYS)}); available fields: {columns}. "
                                "Pass problem_key=...", kwarg="problem_key", explicit=None, tried=list(PROBLEM_KEYS),
                                columns=columns)
    akey = _pick(columns, first, answer_key, ANSWER_KEYS, "answer", "answer_key")
    skey = None if akey is not None else next((c for c in SOLUTION_KEYS if c in columns), None)
    if akey is None and skey is None and require_answer:
        raise MissingFieldError(f"{label}: no answer field (tried {list(ANSWER_KEYS + SOLUTION_KEYS)}); available "
                                f"fields: {columns}. Pass answer_key=...", kwarg="answer_key", explicit=None,
                                tried=list(ANSWER_KEYS + SOLUTION_KEYS), columns=columns)
    ikey = next((c for c in ID_KEYS if c in columns), None)
    ckey = next((c for c in CONTEXT_KEYS if c in columns and c not in (pkey, akey)), None)

    problems = []
    for row_index, row in enumerate(rows):
        try:
            value = field_value(row, pkey)
        except KeyError as e:
            raise BadRowError(f"{label}: row {row_index} has no {pkey!r} field (its record lacks {e.args[0]!r})",
                              kwarg="problem_key", row=row_index) from None
        try:
            messages = chat_messages(value)
        except ValueError as e:
            raise BadRowError(f"{label}: row {row_index}'s {pkey!r} field {e}; a prompt is a string or a list of "
                              'chat messages [{"role": "user", "content": "..."}, ...]', kwarg="problem_key",
                              row=row_index) from None
        if messages is not None:
            users = [m["content"] for m in messages if m["role"] == "user"]
            text = users[-1] if users else messages[-1]["content"]
        else:
            text = value
            if text is not None and not isinstance(text, str):
                raise BadRowError(f"{label}: row {row_index}'s {pkey!r} field is {str(text)[:60]!r} "
                                  f"({type(text).__name__}), not a string or a list of chat messages",
                                  kwarg="problem_key", row=row_index)
            if not text or not text.strip():
                raise BadRowError(f"{label}: row {row_index} has an empty {pkey!r} field", kwarg="problem_key",
                                  row=row_index)
            context = row[ckey] if ckey is not None else None
            if isinstance(context, str) and context.strip():
                text = context.strip() + "\n\n" + text
        if akey is not None:
            try:
                gold = field_value(row, akey)
            except KeyError as e:
                gold = None
                if require_answer:
                    raise BadRowError(f"{label}: row {row_index} has no {akey!r} field (its record lacks "
                                      f"{e.args[0]!r}); fix the row or pass answer_key=...", kwarg="answer_key",
                                      row=row_index) from None
            answer = format_gold(gold) if gold is not None else ""
        elif skey is not None:
            answer = _solution_answer(row[skey] or "")
        else:
            answer = ""
        if not answer and require_answer:
            raise BadRowError(f"{label}: row {row_index} has no usable answer in {akey or skey!r}; fix the row or "
                              "pass answer_key=...", kwarg="answer_key", row=row_index)
        pid = str(row[ikey]) if ikey is not None and row[ikey] is not None else f"{stem}-{row_index}"
        metadata = {k: v for k, v in row.items() if k not in (pkey, akey)}
        problems.append(Problem(problem=text, answer=answer, id=pid, metadata=metadata, messages=messages))
    return problems


def write_splits(out_dir: str | Path, splits: dict[str, list[dict]]) -> dict[str, str]:
    """Writes each split's records to ``<out_dir>/<split>.jsonl``, one JSON object a line (a built-in
    task's files: `demo_task.write_demo_task`, `tool_task.write_tool_task`). Returns {split: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, records in splits.items():
        path = out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        paths[split] = str(path)
    return paths


def problem_to_record(problem: Problem, **extra: Any) -> dict:
    """The JSONL record of a problem (``problem``/``answer``/``id`` + metadata + ``extra``)."""
    record = {k: v for k, v in problem.metadata.items() if k not in ("problem", "answer", "id")}
    if problem.messages is not None:  # the chat messages under `prompt`, where they were read from
        record.update(prompt=[dict(m) for m in problem.messages], answer=problem.answer, id=problem.id)
    else:
        record.update(problem=problem.problem, answer=problem.answer, id=problem.id)
    record.update(extra)
    return record
