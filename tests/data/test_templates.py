"""Prompt templates and prompt encoding under a token budget."""

import pytest

from jaxrl4llm.data import PROMPT_TEMPLATES, Problem, encode_prompts, format_prompt, make_demo_problems

PROBLEM = Problem(problem="What is $1+1$?", answer="2", id="p0")


def test_registry_names():
    assert {"base", "demo", "chat"} <= set(PROMPT_TEMPLATES)


def test_base_template_asks_for_steps_and_a_box():
    prompt = format_prompt(PROBLEM, "base")
    assert "What is $1+1$?" in prompt
    assert "step by step" in prompt and r"\boxed{}" in prompt


def test_demo_template_is_short():
    prompt = format_prompt(make_demo_problems(1)[0], "demo")
    assert prompt.startswith("Q: ") and prompt.endswith("\nA:") and 40 <= len(prompt) <= 80


def test_custom_template_string_keeps_braces():
    assert format_prompt("x?", r"Solve {problem} and box it: \boxed{}") == r"Solve x? and box it: \boxed{}"
    assert format_prompt(Problem("A {b} c", "1", "i"), "demo") == "Q: A {b} c\nA:"


def test_unknown_template_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown prompt template 'nope'.*base"):
        format_prompt(PROBLEM, "nope")


def test_chat_template_uses_the_tokenizer(char_tokenizer):
    prompt = format_prompt(PROBLEM, "chat", char_tokenizer)
    assert prompt.startswith("user: What is $1+1$?") and prompt.endswith("assistant:")
    assert r"\boxed{}" in prompt


def test_chat_template_needs_a_tokenizer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        format_prompt(PROBLEM, "chat")


def test_encode_prompts_keeps_order_and_ids(char_tokenizer):
    problems = make_demo_problems(6, seed=3)
    ids, kept, dropped = encode_prompts(problems, char_tokenizer, "demo", max_prompt_tokens=200)
    assert kept == list(range(6)) and dropped == 0
    assert char_tokenizer.decode(ids[2]) == format_prompt(problems[2], "demo")
    assert all(len(i) == len(format_prompt(p, "demo")) for i, p in zip(ids, problems))  # one id per char


def test_encode_prompts_drop(char_tokenizer):
    problems = [Problem("1+1?", "2", "a"), Problem("x" * 100, "1", "b"), Problem("2+2?", "4", "c")]
    ids, kept, dropped = encode_prompts(problems, char_tokenizer, "demo", max_prompt_tokens=20, on_overlong="drop")
    assert kept == [0, 2] and dropped == 1 and len(ids) == 2


def test_encode_prompts_error_names_index_length_budget_and_key(char_tokenizer):
    problems = [Problem("1+1?", "2", "a"), Problem("x" * 100, "1", "long-one")]
    with pytest.raises(ValueError) as err:
        encode_prompts(problems, char_tokenizer, "demo", max_prompt_tokens=20)
    message = str(err.value)
    for part in ("problem 1", "long-one", "106 tokens", "max_prompt_tokens=20", "data.max_prompt_tokens"):
        assert part in message


def test_encode_prompts_rejects_bad_mode(char_tokenizer):
    with pytest.raises(ValueError, match="on_overlong"):
        encode_prompts([PROBLEM], char_tokenizer, "demo", max_prompt_tokens=10, on_overlong="truncate")
