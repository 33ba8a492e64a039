"""Prompt sets of a run: problems from local files, formatted with the configured template and
tokenized once, with the prompt-length budget enforced (error or drop, as configured)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jaxrl4llm.train.config import ConfigError, RunConfig


@dataclasses.dataclass(frozen=True)
class PromptSet:
    name: str
    token_ids: list[list[int]]
    answers: list[str]
    texts: list[str]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def longest(self) -> int:
        """Tokens of the set's longest prompt (0 when empty)."""
        return max(map(len, self.token_ids), default=0)


def build_prompt_set(name: str, problems, tokenizer, cfg: RunConfig) -> PromptSet:
    from jaxrl4llm.data import encode_prompts, format_prompt

    try:
        ids, kept, dropped = encode_prompts(
            problems, tokenizer, cfg.data.template, max_prompt_tokens=cfg.data.max_prompt_tokens,
            on_overlong=cfg.data.on_overlong_prompt, instruction=cfg.data.instruction,
        )
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    texts = [format_prompt(problems[i], cfg.data.template, tokenizer=tokenizer, instruction=cfg.data.instruction)
             for i in kept]
    return PromptSet(name=name, token_ids=[list(x) for x in ids], answers=[str(problems[i].answer) for i in kept],
                     texts=texts, dropped=dropped)


def _load_file(path: str, cfg: RunConfig):
    from jaxrl4llm.data import load_problems

    if not Path(path).is_file():
        raise ConfigError(f"Data file {path!r} does not exist; check data.train_files / data.eval_files (paths are relative to {Path.cwd()}).")
    return load_problems(path, problem_key=cfg.data.problem_key, answer_key=cfg.data.answer_key)


def load_prompt_sets(cfg: RunConfig, tokenizer) -> tuple[PromptSet, list[PromptSet]]:
    """(train set, [eval sets]) from data.train_files / data.eval_files."""
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: list at least one JSONL/JSON/parquet file of problems.")
    train_problems = []
    for f in cfg.data.train_files:
        train_problems.extend(_load_file(f, cfg))
    train = build_prompt_set("train", train_problems, tokenizer, cfg)
    evals = []
    for f in cfg.data.eval_files:
        problems = _load_file(f, cfg)
        if cfg.data.eval_limit:
            problems = problems[: cfg.data.eval_limit]
        evals.append(build_prompt_set(Path(f).stem, problems, tokenizer, cfg))
    return train, evals
