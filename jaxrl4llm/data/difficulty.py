"""The study's difficulty bins: Easy / Medium / Hard by correct answers out of N rollouts.

Each problem is answered ``num_rollouts`` times by the model; its correct count c decides its
bin: ``hard`` when c <= hard_max, ``easy`` when c >= easy_min, ``medium`` in between. The bins
are written as JSONL files in the same layout as the source data (so ``load_problems`` reads
them back), together with the histogram of correct counts (JSON + PNG), the study's figure.

``run_difficulty_binning`` does the whole job given any ``generate_fn(prompts, num_samples)``;
the trainer supplies one backed by the JAX sampler (CLI: ``jaxrl4llm bin-difficulty``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from jaxrl4llm.data.problems import Problem, problem_to_record
from jaxrl4llm.data.templates import format_prompt
from jaxrl4llm.rewards import batch_math_reward

BINS = ("easy", "medium", "hard")
GenerateFn = Callable[[list[str], int], list[list[str]]]


def default_thresholds(num_rollouts: int) -> tuple[int, int]:
    """(easy_min, hard_max) = (N - N//4, N//4): for 8 rollouts easy >= 6, hard <= 2."""
    return num_rollouts - num_rollouts // 4, num_rollouts // 4


def _check_thresholds(num_rollouts: int, easy_min: int, hard_max: int) -> None:
    if num_rollouts <= 0:
        raise ValueError(f"num_rollouts must be positive, got {num_rollouts}")
    if not 0 <= hard_max < easy_min <= num_rollouts:
        raise ValueError(
            f"need 0 <= hard_max < easy_min <= num_rollouts, got hard_max={hard_max}, easy_min={easy_min}, "
            f"num_rollouts={num_rollouts}"
        )


def bin_by_correct_counts(counts: Sequence[int], *, num_rollouts: int, easy_min: int, hard_max: int) -> list[str]:
    """Label each correct count ``"easy"`` (>= easy_min), ``"hard"`` (<= hard_max) or ``"medium"``.

    >>> bin_by_correct_counts([0, 4, 8], num_rollouts=8, easy_min=6, hard_max=2)
    ['hard', 'medium', 'easy']
    """
    _check_thresholds(num_rollouts, easy_min, hard_max)
    labels = []
    for i, c in enumerate(counts):
        if isinstance(c, bool) or int(c) != c or not 0 <= c <= num_rollouts:
            raise ValueError(f"correct count {c!r} of problem {i} is not an integer in [0, {num_rollouts}]")
        labels.append("easy" if c >= easy_min else "hard" if c <= hard_max else "medium")
    return labels


def count_histogram(counts: Sequence[int], num_rollouts: int) -> list[int]:
    """Number of problems with each correct count 0..num_rollouts."""
    hist = [0] * (num_rollouts + 1)
    for c in counts:
        hist[int(c)] += 1
    return hist


def _plot_histogram(hist: list[int], easy_min: int, hard_max: int, path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone

    colors = ["#d62728" if c <= hard_max else "#2ca02c" if c >= easy_min else "#ff7f0e" for c in range(len(hist))]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.bar(range(len(hist)), hist, color=colors)
    ax.set_xlabel(f"correct answers out of {len(hist) - 1} rollouts")
    ax.set_ylabel("problems")
    ax.set_title(title)
    ax.set_xticks(range(len(hist)))
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#d62728", label="hard"), Patch(color="#ff7f0e", label="medium"),
                       Patch(color="#2ca02c", label="easy")], loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_difficulty_bins(
    problems: Sequence[Problem],
    counts: Sequence[int],
    out_dir: str | Path,
    *,
    num_rollouts: int,
    easy_min: int | None = None,
    hard_max: int | None = None,
    title: str = "Correct-count distribution",
) -> dict[str, Any]:
    """Write ``easy.jsonl``, ``medium.jsonl``, ``hard.jsonl`` and ``histogram.json``/``.png``.

    Each JSONL record is the problem's source record plus ``correct_count`` and ``difficulty``.

    Returns:
      A summary dict: the file paths, bin sizes, thresholds and the histogram.
    """
    if len(problems) != len(counts):
        raise ValueError(f"got {len(problems)} problems but {len(counts)} correct counts; pass one count per problem")
    default_easy, default_hard = default_thresholds(num_rollouts)
    easy_min = default_easy if easy_min is None else easy_min
    hard_max = default_hard if hard_max is None else hard_max
    labels = bin_by_correct_counts(counts, num_rollouts=num_rollouts, easy_min=easy_min, hard_max=hard_max)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {name: out / f"{name}.jsonl" for name in BINS}
    handles = {name: files[name].open("w", encoding="utf-8") for name in BINS}
    try:
        for problem, count, label in zip(problems, counts, labels):
            record = problem_to_record(problem, correct_count=int(count), difficulty=label)
            handles[label].write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    finally:
        for h in handles.values():
            h.close()
    hist = count_histogram(counts, num_rollouts)
    summary = {
        "num_problems": len(problems),
        "num_rollouts": num_rollouts,
        "easy_min": easy_min,
        "hard_max": hard_max,
        "bin_sizes": {name: labels.count(name) for name in BINS},
        "histogram": {str(c): n for c, n in enumerate(hist)},
        "files": {name: str(path) for name, path in files.items()},
    }
    (out / "histogram.json").write_text(json.dumps(summary, indent=2))
    _plot_histogram(hist, easy_min, hard_max, out / "histogram.png", title)
    summary["files"]["histogram_json"] = str(out / "histogram.json")
    summary["files"]["histogram_png"] = str(out / "histogram.png")
    return summary


@dataclass(frozen=True)
class BinningResult:
    """Output of ``run_difficulty_binning``."""

    counts: list[int]
    labels: list[str]
    summary: dict[str, Any] | None


def run_difficulty_binning(
    problems: Sequence[Problem],
    generate_fn: GenerateFn,
    *,
    rollouts: int = 8,
    template: str = "base",
    tokenizer: Any = None,
    out_dir: str | Path | None = None,
    easy_min: int | None = None,
    hard_max: int | None = None,
    batch_size: int = 64,
    reward_fn: Callable[[list[str], list[str]], list[float]] | None = None,
) -> BinningResult:
    """Sample ``rollouts`` answers per problem, count the correct ones, bin, and write the bins.

    Args:
      problems: the problems to bin.
      generate_fn: ``generate_fn(prompts, num_samples) -> list[list[str]]``, one list of
        ``num_samples`` completions per prompt (the trainer wires the JAX sampler here).
      rollouts: samples per problem (N).
      template: prompt template (see ``format_prompt``); ``tokenizer`` is needed for "chat".
      out_dir: where to write the bins and histogram (None: do not write).
      easy_min, hard_max: thresholds (default ``default_thresholds(rollouts)``).
      batch_size: prompts per ``generate_fn`` call.
      reward_fn: ``(responses, golds) -> rewards``; default ``rewards.batch_math_reward``.
    """
    reward_fn = batch_math_reward if reward_fn is None else reward_fn
    default_easy, default_hard = default_thresholds(rollouts)
    easy_min = default_easy if easy_min is None else easy_min
    hard_max = default_hard if hard_max is None else hard_max
    _check_thresholds(rollouts, easy_min, hard_max)
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    counts: list[int] = []
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        prompts = [format_prompt(p, template, tokenizer) for p in chunk]
        samples = generate_fn(prompts, rollouts)
        if len(samples) != len(prompts) or any(len(s) != rollouts for s in samples):
            shape = [len(s) for s in samples] if isinstance(samples, list) else type(samples).__name__
            raise ValueError(
                f"generate_fn must return one list of {rollouts} completions per prompt ({len(prompts)} prompts); "
                f"got lengths {shape}"
            )
        responses = [r for group in samples for r in group]
        golds = [p.answer for p in chunk for _ in range(rollouts)]
        rewards = reward_fn(responses, golds)
        counts.extend(int(round(sum(rewards[i * rollouts : (i + 1) * rollouts]))) for i in range(len(chunk)))
    labels = bin_by_correct_counts(counts, num_rollouts=rollouts, easy_min=easy_min, hard_max=hard_max)
    summary = None
    if out_dir is not None:
        summary = write_difficulty_bins(problems, counts, out_dir, num_rollouts=rollouts, easy_min=easy_min,
                                        hard_max=hard_max)
    return BinningResult(counts=counts, labels=labels, summary=summary)
