r"""The chain task: multi-step arithmetic chains whose response length, forks and truncation belong
to the policy (issue #40, the miniature study's task; docs/results/miniature.md).

A problem is a chain of 1-8 operations on one-digit operands, the running value kept in
``[0, VALUE_MAX]`` (an operation that would leave it is flipped): ``7+5-3+8=?``, gold ``17``.
Its worked solutions come in three styles, so the length of a correct response is the policy's
choice:

- ``full``: one step per operation, ``7+5=12 12-3=9 9+8=17 \boxed{17}`` (18-70 characters);
- ``merged``: two operations per step, ``7+5-3=9 9+8=17 \boxed{17}``;
- ``direct``: the answer alone, ``\boxed{17}``.

``TeacherMixture`` draws the SFT completions of a warm start from these styles and from two
degenerate continuations a base model shows: a *loop* (the chain stops advancing and repeats one
step without end) and a *run-on* (after its answer the response goes on into a new question of
its own). Those two never emit EOS, so a policy that learned them is truncated by any budget.
``BASE_LIKE`` and ``ALIGNED_LIKE`` are the study's base and instruct models in miniature
(constructed stand-ins, not models of either).

``write_chain_task`` writes ``train.jsonl`` (1-8 operations, uniform) and one held-out file per
chain-length band (``CHAIN_BANDS``), whose accuracies the evaluation logs side by side.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

from jaxrl4llm.data.problems import Problem, problem_to_record

VALUE_MAX = 19  # the running value stays in [0, VALUE_MAX]: one- and two-digit numbers only
MAX_OPS = 8
# held-out bands by number of operations: the file test_<band>.jsonl and the eval set's name
CHAIN_BANDS = {"ops1-2": (1, 2), "ops3-5": (3, 5), "ops6-8": (6, 8)}
STYLES = ("full", "merged", "direct")
_PROBLEM_RE = re.compile(r"^(\d)((?:[+-]\d){1,8})=\?$")
_OP_RE = re.compile(r"([+-])(\d)")


def make_chain_problems(num: int, *, seed: int = 0, min_ops: int = 1, max_ops: int = MAX_OPS,
                        id_prefix: str = "chain") -> list[Problem]:
    """``num`` seeded chain problems, operations drawn uniformly from ``min_ops..max_ops``.

    Operands and the start are 1-9; ``+`` and ``-`` are equally likely unless one would leave
    ``[0, VALUE_MAX]``. metadata: ``{"ops": n}``.
    """
    if not 1 <= min_ops <= max_ops <= MAX_OPS:
        raise ValueError(f"need 1 <= min_ops <= max_ops <= {MAX_OPS}, got min_ops={min_ops}, max_ops={max_ops}")
    rng = random.Random(seed)
    problems = []
    for index in range(num):
        ops = rng.randint(min_ops, max_ops)
        value = rng.randint(1, 9)
        text = str(value)
        for _ in range(ops):
            operand = rng.randint(1, 9)
            op = rng.choice("+-")
            if op == "+" and value + operand > VALUE_MAX:
                op = "-"
            if op == "-" and value - operand < 0:
                op = "+"
            value = value + operand if op == "+" else value - operand
            text += f"{op}{operand}"
        problems.append(Problem(problem=f"{text}=?", answer=str(value), id=f"{id_prefix}-{index}",
                                metadata={"ops": ops}))
    return problems


def chain_operations(problem: Problem | str) -> tuple[int, list[tuple[str, int]]]:
    """``"7+5-3=?"`` -> ``(7, [("+", 5), ("-", 3)])``; a ValueError for any other text."""
    text = problem.problem if isinstance(problem, Problem) else str(problem)
    match = _PROBLEM_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not a chain problem (like '7+5-3=?'): {text!r}")
    return int(match.group(1)), [(op, int(d)) for op, d in _OP_RE.findall(match.group(2))]


def _steps(start: int, operations: list[tuple[str, int]], per_step: int) -> list[str]:
    """The worked steps, `per_step` operations each: ["7+5-3=9", "9+8=17"]."""
    steps, value = [], start
    for i in range(0, len(operations), per_step):
        text = str(value)
        for op, operand in operations[i : i + per_step]:
            value = value + operand if op == "+" else value - operand
            text += f"{op}{operand}"
        steps.append(f"{text}={value}")
    return steps


def chain_solution(problem: Problem | str, style: str = "full") -> str:
    r"""A correct worked solution in `style` (``STYLES``), ending in ``\boxed{answer}``."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    start, operations = chain_operations(problem)
    steps = [] if style == "direct" else _steps(start, operations, 1 if style == "full" else 2)
    answer = _steps(start, operations, len(operations))[0].rsplit("=", 1)[1]
    return " ".join(steps + [rf"\boxed{{{answer}}}"])


@dataclasses.dataclass(frozen=True)
class TeacherMixture:
    """How a warm start's SFT completions are drawn: a style by its weight, then, with their
    probabilities, a wrong boxed answer (off by 1-3, the steps right), a loop or a run-on (both
    without EOS)."""

    full: float
    merged: float
    direct: float
    wrong_box: float
    loop: float = 0.0
    run_on: float = 0.0

    def __post_init__(self):
        weights = (self.full, self.merged, self.direct)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"style weights must be >= 0 with a positive sum, got {weights}")
        for name in ("wrong_box", "loop", "run_on"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {getattr(self, name)}")
        if self.loop + self.run_on > 1.0:
            raise ValueError(f"loop + run_on must be <= 1, got {self.loop + self.run_on}")


# The study's base model in miniature: mixed styles, a wrong box often, 1 response in 5 that does
# not stop (loops, run-ons). Its instruct model: full or merged chains, always stops, rarely wrong.
BASE_LIKE = TeacherMixture(full=0.4, merged=0.3, direct=0.3, wrong_box=0.35, loop=0.12, run_on=0.08)
ALIGNED_LIKE = TeacherMixture(full=0.6, merged=0.4, direct=0.0, wrong_box=0.05)


def _wrong_box(solution: str, rng: random.Random) -> str:
    match = re.search(r"\\boxed\{(\d+)\}$", solution)
    value = int(match.group(1))
    wrong = value + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if 0 <= value + d <= VALUE_MAX + 3])
    return solution[: match.start(1)] + str(wrong) + "}"


def teacher_completion(problem: Problem, mixture: TeacherMixture, rng: random.Random, *,
                       max_chars: int) -> tuple[str, bool]:
    """One SFT completion of `problem` drawn from `mixture`: ``(text, stops)``. A loop or a run-on
    fills `max_chars` and does not stop (no EOS is to follow it); every other completion stops."""
    style = rng.choices(STYLES, weights=(mixture.full, mixture.merged, mixture.direct))[0]
    solution = chain_solution(problem, style)
    if rng.random() < mixture.wrong_box:
        solution = _wrong_box(solution, rng)
    degenerate = rng.random()
    if degenerate < mixture.loop:  # the chain stops advancing: one of its steps again and again
        start, operations = chain_operations(problem)
        steps = _steps(start, operations, 1)
        kept = steps[: rng.randint(1, len(steps))]
        text = " ".join(kept)
        while len(text) < max_chars:
            text += " " + kept[-1]
        return text[:max_chars], False
    if degenerate < mixture.loop + mixture.run_on:  # past its answer, on into a question of its own
        text = solution
        while len(text) < max_chars:
            extra = make_chain_problems(1, seed=rng.randrange(2**31), max_ops=3)[0]
            text += f" {extra.problem} {chain_solution(extra, 'full')}"
        return text[:max_chars], False
    return solution, True


def write_chain_task(out_dir: str | Path, *, num_train: int = 4000, num_test_per_band: int = 100,
                     seed: int = 0) -> dict[str, str]:
    """Writes ``train.jsonl`` (1-8 operations) and ``test_<band>.jsonl`` for each of ``CHAIN_BANDS``
    (problem, answer, id, ops, solution: the full chain). Held-out problems never occur in train.
    Returns {"train": path, "<band>": path, ...}."""
    train = make_chain_problems(num_train, seed=seed, id_prefix="train")
    seen = {p.problem for p in train}
    splits = {"train": train}
    for offset, (band, (low, high)) in enumerate(CHAIN_BANDS.items()):
        held_out: list[Problem] = []
        draw_seed = seed + 1_000_003 * (offset + 1)
        for attempt in range(100):
            for p in make_chain_problems(num_test_per_band, seed=draw_seed + attempt, min_ops=low, max_ops=high):
                if p.problem not in seen and len(held_out) < num_test_per_band:
                    seen.add(p.problem)
                    held_out.append(Problem(p.problem, p.answer, f"{band}-{len(held_out)}", p.metadata))
            if len(held_out) == num_test_per_band:
                break
        else:
            raise ValueError(f"cannot draw {num_test_per_band} distinct held-out problems of {low}-{high} "
                             f"operations; ask for fewer (num_test_per_band)")
        splits[band] = held_out
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, problems in splits.items():
        path = out / ("train.jsonl" if split == "train" else f"test_{split}.jsonl")
        with path.open("w", encoding="utf-8") as f:
            for p in problems:
                f.write(json.dumps(problem_to_record(p, solution=chain_solution(p, "full"))) + "\n")
        paths[split] = str(path)
    return paths
