"""Prompt token ids under a token budget."""

from __future__ import annotations

from typing import Any, Sequence

from jaxrl4llm.data.problems import Problem
from jaxrl4llm.data.templates import format_prompt, is_chat_prompt, is_chat_template


def encode_prompt_text(text: str, tokenizer: Any, template: str, *, chat: bool | None = None) -> list[int]:
    """Token ids of a formatted prompt, as training encodes it: a chat-template prompt without
    extra special tokens (the chat template wrote them), any other with the tokenizer's usual
    ones (e.g. Llama's BOS). `chat`: whether the chat template rendered it (default: whether
    `template` is a chat template; a problem of chat messages is one whatever the template,
    `is_chat_prompt`). Training, `bin-difficulty` and `sample` all encode through here."""
    chat = is_chat_template(template) if chat is None else chat
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def encode_prompts(
    problems: Sequence[Problem | str],
    tokenizer: Any,
    template: str,
    *,
    max_prompt_tokens: int,
    on_overlong: str = "error",
    instruction: str | None = None,
    system_prompt: str | None = None,
) -> tuple[list[list[int]], list[int], int]:
    """Token ids of every formatted prompt, dropping or rejecting those over the budget.

    Args:
      problems: problems (or problem texts) in order.
      tokenizer: a Hugging Face tokenizer.
      template: prompt template name or format string (see ``format_prompt``).
      max_prompt_tokens: the budget (``data.max_prompt_tokens`` in the training config).
      on_overlong: ``"error"`` raises on the first prompt over budget; ``"drop"`` skips it.
      instruction: the template's instruction sentence (see ``format_prompt``; None: the study's).
      system_prompt: a system message before each prompt (see ``format_prompt``; None: none).

    Returns:
      (token id lists of the kept prompts, indices of the kept problems, number dropped).
      Chat prompts are encoded without extra special tokens (the chat template has them);
      other prompts get the tokenizer's usual special tokens (e.g. Llama's BOS).
    """
    if on_overlong not in ("error", "drop"):
        raise ValueError(f"on_overlong must be 'error' or 'drop', got {on_overlong!r}")
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    ids_out, kept, dropped = [], [], 0
    for index, problem in enumerate(problems):
        try:
            text = format_prompt(problem, template, tokenizer, instruction=instruction, system_prompt=system_prompt)
        except ValueError as e:
            pid = f" (id {problem.id})" if isinstance(problem, Problem) else ""
            raise ValueError(f"problem {index}{pid}: {e}") from None
        ids = encode_prompt_text(text, tokenizer, template, chat=is_chat_prompt(problem, template))
        if len(ids) > max_prompt_tokens:
            if on_overlong == "error":
                pid = f" (id {problem.id})" if isinstance(problem, Problem) else ""
                raise ValueError(
                    f"prompt of problem {index}{pid} has {len(ids)} tokens, over the budget of "
                    f"max_prompt_tokens={max_prompt_tokens}; raise data.max_prompt_tokens in the config "
                    "or set data.on_overlong='drop' to skip such problems"
                )
            dropped += 1
            continue
        ids_out.append(ids)
        kept.append(index)
    return ids_out, kept, dropped
