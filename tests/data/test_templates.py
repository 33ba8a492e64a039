"""Prompt templates and prompt encoding under a token budget."""

import pytest

from jaxrl4llm.data import PROMPT_TEMPLATES, Problem, encode_prompts, format_prompt, make_demo_problems

PROBLEM = Problem(problem="What is $1+1$?", answer="2", id="p0")


def test_registry_names():
    assert {"base", "demo", "chat", "qwen3_thinking", "qwen3_no_thinking"} <= set(PROMPT_TEMPLATES)


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


# A Qwen3-style hybrid-thinking chat template (the switch as Qwen3's own template spells it).
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture()
def qwen3_style_tokenizer(tmp_path):
    """The character tokenizer (built locally, nothing downloaded) with a Qwen3-style chat template."""
    from transformers import AutoTokenizer

    from jaxrl4llm.data import build_char_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_char_tokenizer(tmp_path / "tok"))
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    return tokenizer


def test_qwen3_thinking_switch(qwen3_style_tokenizer):
    tok = qwen3_style_tokenizer
    thinking = format_prompt(PROBLEM, "qwen3_thinking", tok)
    no_thinking = format_prompt(PROBLEM, "qwen3_no_thinking", tok)
    default = format_prompt(PROBLEM, "chat", tok)
    head = "<|im_start|>user\nWhat is $1+1$?\n" + r"Please reason step by step, and put your final answer within \boxed{}."
    assert thinking.startswith(head) and no_thinking.startswith(head)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert default == thinking  # the template's own default (enable_thinking undefined) thinks
    assert format_prompt(PROBLEM, "chat", tok, enable_thinking=False) == no_thinking
    assert format_prompt(PROBLEM, "chat", tok, enable_thinking=True) == thinking


def test_qwen3_templates_are_chat_templates(qwen3_style_tokenizer):
    from jaxrl4llm.data import CHAT_TEMPLATES, is_chat_template

    assert CHAT_TEMPLATES == {"chat": None, "qwen3_thinking": True, "qwen3_no_thinking": False}
    assert all(is_chat_template(name) for name in CHAT_TEMPLATES) and not is_chat_template("base")
    problems = [PROBLEM, Problem("2+2?", "4", "p1")]
    ids, kept, _ = encode_prompts(problems, qwen3_style_tokenizer, "qwen3_no_thinking", max_prompt_tokens=500)
    assert kept == [0, 1]
    assert qwen3_style_tokenizer.decode(ids[1]) == format_prompt(problems[1], "qwen3_no_thinking", qwen3_style_tokenizer)


def test_thinking_switch_errors(char_tokenizer, qwen3_style_tokenizer):
    with pytest.raises(ValueError, match="does not use enable_thinking"):
        format_prompt(PROBLEM, "qwen3_no_thinking", char_tokenizer)  # `role: content` template ignores it
    with pytest.raises(ValueError, match="needs a tokenizer"):
        format_prompt(PROBLEM, "qwen3_thinking")
    with pytest.raises(ValueError, match="chat-template switch"):
        format_prompt(PROBLEM, "base", enable_thinking=False)
    with pytest.raises(ValueError, match="sets enable_thinking=True"):
        format_prompt(PROBLEM, "qwen3_thinking", qwen3_style_tokenizer, enable_thinking=False)


def test_instruction_replaces_the_studys_sentence_and_is_refused_where_there_is_none():
    prompt = format_prompt(PROBLEM, "base", instruction="Give the number only.")
    assert prompt == "Question: What is $1+1$?\nGive the number only.\nAnswer: Let's think step by step."
    assert format_prompt(PROBLEM, "base", instruction=None) == format_prompt(PROBLEM, "base")
    for template in ("demo", "Solve {problem}"):
        with pytest.raises(ValueError, match="has no instruction to replace"):
            format_prompt(PROBLEM, template, instruction="Give the number only.")
    ids, kept, _ = encode_prompts([PROBLEM], _WordTokenizer(), "base", max_prompt_tokens=64, instruction="Short.")
    assert kept == [0] and len(ids[0]) == len("Question: What is $1+1$?\nShort.\nAnswer: Let's think step by step.".split())


class _WordTokenizer:
    """Whitespace 'tokenizer' (what encode_prompts needs of one)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


CHAT_PROBLEM = Problem(problem="What is 2+3?", answer="5", id="c0",
                       messages=({"role": "user", "content": "What is 2+3?"},))


@pytest.mark.parametrize("template", ["base", "demo", "chat", "Solve {problem}"])
def test_chat_messages_render_as_they_are_whatever_the_template(char_tokenizer, template):
    """TRL and verl: the row's messages through the chat template, with the assistant's turn opened."""
    assert format_prompt(CHAT_PROBLEM, template, char_tokenizer) == "user: What is 2+3?\nassistant:"
    assert format_prompt(CHAT_PROBLEM, template, char_tokenizer, system_prompt="Be brief.") == \
        "system: Be brief.\nuser: What is 2+3?\nassistant:"


def test_a_rows_own_system_message_is_kept(char_tokenizer):
    own = Problem("q", "1", "i", messages=({"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}))
    assert format_prompt(own, "base", char_tokenizer, system_prompt="Ours.") == "system: Mine.\nuser: q\nassistant:"


def test_chat_messages_need_a_chat_template():
    with pytest.raises(ValueError, match=r"a prompt of chat messages \(template 'base'\) needs a tokenizer with a "
                                         r"chat template"):
        format_prompt(CHAT_PROBLEM, "base")


def test_system_prompt_on_plain_text(char_tokenizer):
    assert format_prompt(PROBLEM, "chat", char_tokenizer, system_prompt="Be brief.").startswith(
        "system: Be brief.\nuser: What is $1+1$?")
    with pytest.raises(ValueError, match=r"a system prompt is a chat-template message; template 'base' is plain text"):
        format_prompt(PROBLEM, "base", system_prompt="Be brief.")


def test_a_format_error_names_the_problem(char_tokenizer):
    with pytest.raises(ValueError, match=r"problem 0 \(id p0\): a system prompt is a chat-template message"):
        encode_prompts([PROBLEM], char_tokenizer, "base", max_prompt_tokens=64, system_prompt="x")
