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

A problem whose prompt is a list of chat messages (``Problem.messages``: TRL's and verl's
``prompt`` column) is rendered as it is with the tokenizer's chat template
(``add_generation_prompt=True``), whatever the template: the template's words and ``instruction``
are for plain-text problems; ``"qwen3_thinking"`` / ``"qwen3_no_thinking"`` still pass
``enable_thinking``.

``system_prompt`` (``data.system_prompt``) goes first as a system message: before a row's chat
messages (unless they open with a system message of their own, which is kept instead), or before
the user message of the chat templates. A plain-text template (``"base"``, ``"demo"``, a format
string) has no system message: a plain-text problem under it with a system prompt is an error
(write the text into your template string instead, or use ``"chat"``).
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


def is_chat_prompt(problem: Problem | str, template: str) -> bool:
    """True when ``problem``'s prompt is rendered by the tokenizer's chat template: a chat template,
    or a problem that holds chat messages (encoded without extra special tokens)."""
    return is_chat_template(template) or (isinstance(problem, Problem) and problem.messages is not None)


def _render_chat(messages: list, tokenizer: Any, what: str, thinking: bool | None) -> str:
    """`messages` rendered with the tokenizer's chat template, the assistant's turn opened; `what`
    (e.g. "template 'chat'") names the caller in errors."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{what} needs a tokenizer with a chat template (instruct models); pass tokenizer=... "
            "or use template='base' for base models"
        )
    kwargs = {}
    if thinking is not None:
        if "enable_thinking" not in str(tokenizer.chat_template):
            raise ValueError(
                f"{what} passes enable_thinking={thinking} but the tokenizer's chat template "
                "does not use enable_thinking (not a Qwen3 hybrid-thinking model?), so it would be ignored; "
                "use template='chat'"
            )
        kwargs["enable_thinking"] = bool(thinking)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def format_prompt(
    problem: Problem | str, template: str, tokenizer: Any = None, *, enable_thinking: bool | None = None,
    instruction: str | None = None, system_prompt: str | None = None,
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
      system_prompt: a system message before the prompt (module docstring); None: none.
    """
    messages = problem.messages if isinstance(problem, Problem) else None
    if messages is not None:  # a chat: rendered as it is (module docstring)
        if template not in PROMPT_TEMPLATES and "{problem}" not in template:
            raise ValueError(f"unknown prompt template {template!r}; use one of {sorted(PROMPT_TEMPLATES)} or a "
                             "string containing '{problem}'")
        chat = [dict(m) for m in messages]
        if system_prompt is not None and chat[0].get("role") != "system":
            chat.insert(0, {"role": "system", "content": system_prompt})
        named = CHAT_TEMPLATES.get(template)
        return _render_chat(chat, tokenizer, f"a prompt of chat messages (template {template!r})",
                            named if enable_thinking is None else enable_thinking)
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
        if system_prompt is not None:
            raise ValueError(
                f"a system prompt is a chat-template message; template {template!r} is plain text. Use "
                "template='chat' (or 'qwen3_thinking' / 'qwen3_no_thinking'), or write the text into your own "
                "template string"
            )
        return content
    named = CHAT_TEMPLATES[template]
    if enable_thinking is not None and named is not None and enable_thinking != named:
        raise ValueError(f"template {template!r} sets enable_thinking={named}, but enable_thinking={enable_thinking} "
                         "was passed; use one or the other")
    thinking = named if enable_thinking is None else enable_thinking
    chat = [{"role": "user", "content": content}]
    if system_prompt is not None:
        chat.insert(0, {"role": "system", "content": system_prompt})
    return _render_chat(chat, tokenizer, f"template {template!r}", thinking)
