r"""The tool task: products of two 3-digit numbers, which a tiny model cannot compute in its own text
but can by writing Python and reading the result (tool-integrated RL's task where tool use is what
is learned; `jaxrl4llm demo --task tools`).

``make_tool_problems(num, seed)`` draws seeded problems in the demo's format (``data.template: demo``,
the answer in ``\boxed{}``): ``What is 347 * 812?``, gold ``281764``. Two worked solutions:

- ``tool_solution``: the fence format's call (ToRL; `tools.protocol.FENCE`), the observation the
  Python tool feeds back, then the boxed answer copied from it::

      ```python
      print(347 * 812)
      ```
      ```output
      281764
      ```
      \boxed{281764}

- ``text_solution``: the product written out, ``347 * 812 = 281764 \boxed{281764}`` (right, but
  the model has to compute it in its head).

``warm_start_completions`` is the warm start's teacher: code for a `code_share` of the problems (a
seeded pick), text for the rest. A model fine-tuned on it calls the tool on some problems; RL with
tools on raises that share (the calls are right, the text products are not), RL with tools off has
nothing to raise. ``write_tool_task`` writes ``train.jsonl``/``test.jsonl`` (problem, answer, id,
solution) as the demo task does.
"""

from __future__ import annotations

import random
from pathlib import Path

from jaxrl4llm.data.problems import Problem, problem_to_record, write_splits
from jaxrl4llm.tools.protocol import FENCE

LOW, HIGH = 100, 999  # 3-digit factors
CODE_SHARE = 0.3  # the warm start's teacher writes code for this share of its problems


def make_tool_problems(num: int, *, seed: int = 0, id_prefix: str = "tool") -> list[Problem]:
    """``num`` seeded problems ``What is A * B?`` with A, B uniform in [100, 999], gold ``A * B``.
    metadata: {"a": A, "b": B}."""
    rng = random.Random(seed)
    problems = []
    for index in range(num):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        problems.append(Problem(problem=f"What is {a} * {b}?", answer=str(a * b), id=f"{id_prefix}-{index}",
                                metadata={"a": a, "b": b}))
    return problems


def factors(problem: Problem) -> tuple[int, int]:
    """(A, B) of a tool problem (its metadata, else its text); ValueError for another problem."""
    if problem.metadata and "a" in problem.metadata:
        return int(problem.metadata["a"]), int(problem.metadata["b"])
    words = problem.problem.rstrip("?").split()
    if len(words) != 5 or words[:2] != ["What", "is"] or words[3] != "*":
        raise ValueError(f"not a tool-task problem ('What is A * B?'): {problem.problem!r}")
    return int(words[2]), int(words[4])


def tool_solution(problem: Problem) -> str:
    r"""The worked solution that calls Python: the fence call (code block, then the trigger), the
    observation exactly as `tools.protocol.observation_text` renders the printed product, then
    ``\boxed{product}``."""
    a, b = factors(problem)
    call = f"{FENCE.call_opening}\nprint({a} * {b})\n```\n{FENCE.trigger}"
    observation = f"{FENCE.observation_opening}{a * b}{FENCE.observation_closing}"
    return f"{call}{observation}\\boxed{{{a * b}}}"


def text_solution(problem: Problem) -> str:
    r"""The worked solution without a tool: ``A * B = product \boxed{product}``."""
    a, b = factors(problem)
    return f"{a} * {b} = {a * b} \\boxed{{{a * b}}}"


def warm_start_completions(problems: list[Problem], *, code_share: float = CODE_SHARE,
                           seed: int = 0) -> list[str]:
    """The warm start teacher's completion of each problem: `tool_solution` for a seeded
    `code_share` of them (each problem independently), `text_solution` for the rest."""
    if not 0.0 <= code_share <= 1.0:
        raise ValueError(f"code_share must be in [0, 1], got {code_share}")
    rng = random.Random(seed)
    return [tool_solution(p) if rng.random() < code_share else text_solution(p) for p in problems]


def write_tool_task(out_dir: str | Path, *, num_train: int = 4000, num_test: int = 200, seed: int = 0) -> dict[str, str]:
    """Writes ``train.jsonl`` and ``test.jsonl`` (problem, answer, id, solution: `tool_solution`), the
    test problems disjoint from the train split's. Returns the two paths."""
    train = make_tool_problems(num_train, seed=seed, id_prefix="train")
    seen = {p.problem for p in train}
    test = [p for p in make_tool_problems(num_test * 2, seed=seed + 1_000_003, id_prefix="test")
            if p.problem not in seen][:num_test]
    if len(test) < num_test:
        raise ValueError(f"cannot draw {num_test} test problems outside the train split")
    return write_splits(out_dir, {
        split: [problem_to_record(Problem(p.problem, p.answer, f"{split}-{i}", p.metadata), solution=tool_solution(p))
                for i, p in enumerate(problems)]
        for split, problems in (("train", train), ("test", test))})
