r"""Prompt templates: one registry, one ``format_prompt`` for real and demo tasks.

``PROMPT_TEMPLATES`` maps a name to a template string with a ``{problem}`` field, except
``"chat"``, which means "the tokenizer's own chat template" (instruct models):

- ``"base"``: the study's base-model prompt: the problem, then the instruction to reason step
  by step and put the final answer in ``\boxed{}``;
- ``"demo"``: a very short prompt for the tiny demo task (``Q: ...\nA:``);
- ``"chat"``: one user message (problem + the same instruction) rendered with
  ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)``.

A template may also be given directly as a string containing ``{problem}``.
"""

from __future__ import annotations

from typing import Any

from jaxrl4llm.data.problems import Problem

INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."

PROMPT_TEMPLATES: dict[str, str] = {
    "base": "Question: {problem}\n" + INSTRUCTION + "\nAnswer: Let's think step by step.",
    "demo": "Q: {problem}\nA:",
    "chat": "{problem}\n" + INSTRUCTION,
}


def format_prompt(problem: Problem | str, template: str, tokenizer: Any = None) -> str:
    """The prompt text for ``problem`` under ``template`` (a registry name or a format string).

    Args:
      problem: a ``Problem`` or the problem text.
      template: ``"base"``, ``"demo"``, ``"chat"`` or a string with a ``{problem}`` field.
      tokenizer: a Hugging Face tokenizer; required for ``"chat"``.
    """
    text = problem.problem if isinstance(problem, Problem) else str(problem)
    if template in PROMPT_TEMPLATES:
        pattern = PROMPT_TEMPLATES[template]
    elif "{problem}" in template:
        pattern = template
    else:
        raise ValueError(
            f"unknown prompt template {template!r}; use one of {sorted(PROMPT_TEMPLATES)} or a string "
            "containing '{problem}'"
        )
    content = pattern.replace("{problem}", text)  # plain replace: braces such as \boxed{} stay
    if template != "chat":
        return content
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "template 'chat' needs a tokenizer with a chat template (instruct models); pass tokenizer=... "
            "or use template='base' for base models"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
