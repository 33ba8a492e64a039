r"""Prompt templates: one registry, one ``format_prompt`` for real and demo tasks.

``PROMPT_TEMPLATES`` maps a name to a template string with a ``{problem}`` field; the chat
names (``CHAT_TEMPLATES``) also mean "render with the tokenizer's own chat template" (instruct
models):

- ``"base"``: the study's base-model prompt: the problem, then the instruction to reason step
  by step and put the final answer in ``\boxed{}``;
- ``"demo"``: a very short prompt for the tiny demo task (``Q: ...\nA:``);
- ``"chat"``: one user message (problem + the same instruction) rendered with
  ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)``;
- ``"qwen3_thinking"`` / ``"qwen3_no_thinking"``: ``"chat"`` with ``enable_thinking=True`` /
  ``False`` passed to the chat template (Qwen3's hybrid-thinking switch: with False the Qwen3
  template appends an empty ``<think>\n\n</think>`` block, so the model answers directly). The
  tokenizer's chat template must read ``enable_thinking``; otherwise the switch would be silently
  ignored, so it is an error. ``format_prompt(..., enable_thinking=...)`` does the same for
  ``"chat"``.

A template may also be given directly as a string containing ``{problem}``.

``instruction`` replaces the study's sentence in the templates that carry it (all but
``"demo"``): a small instruct model that rambles under "reason step by step" may be asked for a
short answer instead (``data.instruction`` in a run config).
"""

from __future__ import annotations

from typing import Any

from jaxrl4llm.data.problems import Problem

INSTRUCTION = r"Please reason step by step, and put your final answer within \boxed{}."

PROMPT_TEMPLATES: dict[str, str] = {
    "base": "Question: {problem}\n{instruction}\nAnswer: Let's think step by step.",
    "demo": "Q: {problem}\nA:",
    "chat": "{problem}\n{instruction}",
    "qwen3_thinking": "{problem}\n{instruction}",
    "qwen3_no_thinking": "{problem}\n{instruction}",
}

# Chat template names -> the enable_thinking value passed to the tokenizer's chat template
# (None: not passed, the template's own default).
CHAT_TEMPLATES: dict[str, bool | None] = {"chat": None, "qwen3_thinking": True, "qwen3_no_thinking": False}


def is_chat_template(template: str) -> bool:
    """True when ``template`` is rendered by the tokenizer's chat template (no extra special tokens)."""
    return template in CHAT_TEMPLATES


def format_prompt(
    problem: Problem | str, template: str, tokenizer: Any = None, *, enable_thinking: bool | None = None,
    instruction: str | None = None,
) -> str:
    """The prompt text for ``problem`` under ``template`` (a registry name or a format string).

    Args:
      problem: a ``Problem`` or the problem text.
      template: ``"base"``, ``"demo"``, ``"chat"``, ``"qwen3_thinking"``, ``"qwen3_no_thinking"``
        or a string with a ``{problem}`` field.
      tokenizer: a Hugging Face tokenizer; required for the chat templates.
      enable_thinking: with a chat template, the value passed as ``enable_thinking`` to
        ``tokenizer.apply_chat_template`` (Qwen3's thinking switch); ``None`` (default) uses the
        template name's value (``"chat"``: not passed). The tokenizer's chat template must use
        ``enable_thinking`` when it is passed.
      instruction: the sentence after the problem in the templates that have one (default
        ``INSTRUCTION``, the study's); an error for ``"demo"`` and format strings.
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
    if instruction is not None and "{instruction}" not in pattern:
        raise ValueError(f"template {template!r} has no instruction to replace; use 'base', 'chat', 'qwen3_thinking' "
                         "or 'qwen3_no_thinking', or write the sentence into your own template string")
    # plain replace: braces such as \boxed{} stay
    content = pattern.replace("{instruction}", INSTRUCTION if instruction is None else instruction)
    content = content.replace("{problem}", text)
    if not is_chat_template(template):
        if enable_thinking is not None:
            raise ValueError(
                f"enable_thinking is a chat-template switch; template {template!r} is plain text. Use "
                "template='qwen3_thinking' / 'qwen3_no_thinking' (or 'chat' with enable_thinking=...)"
            )
        return content
    named = CHAT_TEMPLATES[template]
    if enable_thinking is not None and named is not None and enable_thinking != named:
        raise ValueError(f"template {template!r} sets enable_thinking={named}, but enable_thinking={enable_thinking} "
                         "was passed; use one or the other")
    thinking = named if enable_thinking is None else enable_thinking
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"template {template!r} needs a tokenizer with a chat template (instruct models); pass tokenizer=... "
            "or use template='base' for base models"
        )
    kwargs = {}
    if thinking is not None:
        if "enable_thinking" not in str(tokenizer.chat_template):
            raise ValueError(
                f"template {template!r} passes enable_thinking={thinking} but the tokenizer's chat template "
                "does not use enable_thinking (not a Qwen3 hybrid-thinking model?), so it would be ignored; "
                "use template='chat'"
            )
        kwargs["enable_thinking"] = bool(thinking)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, **kwargs
    )
