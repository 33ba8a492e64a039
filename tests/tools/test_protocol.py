"""The tool-call protocol (`jaxrl4llm.tools.protocol`): each format's call round trip (the exact code,
the last complete block, unclosed blocks and turns without code, a trigger inside the code), the
exact observation texts of every status, the middle cut of the output and the token cut to the
room, the model-only text for the reward, the trigger spellings the decode loop matches, the
qwen3_chat observation against a chat template's rendering, and ToolsSpec's validation.

The tokenizer is a byte-level BPE built here (`tests/tools/chat_tokenizer.py`: nothing is
downloaded), with the formats' markers as added tokens.
"""

import json
import math

import pytest

from jaxrl4llm.sampling.stops import stop_token_sequences, trigger_token_sequences
from jaxrl4llm.tools import (NoCall, ToolCall, ToolResult, ToolsSpec, is_void_turn, model_text, observation_text,
                             observation_tokens, parse_call, tool_format, trigger_strings, truncate_middle)
from jaxrl4llm.tools.protocol import (CRASH_LINE, FENCE, LLAMA3_CHAT, MEMORY_LINE, NO_CODE, QWEN3_CHAT, TIMEOUT_LINE,
                                      UNCLOSED_BLOCK)
from tests.tools.chat_tokenizer import chat_tokenizer

OK_2 = ToolResult("ok", "2\n", 0.01)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def wrapped(fmt, line):
    return fmt.observation_opening + line + fmt.observation_closing


def test_formats_are_named_and_an_unknown_name_lists_the_valid_ones():
    assert [tool_format(n) for n in ("fence", "qwen3_chat", "llama3_chat")] == [FENCE, QWEN3_CHAT, LLAMA3_CHAT]
    assert trigger_strings(FENCE) == ("```output",)
    assert trigger_strings(QWEN3_CHAT) == ("</tool_call>",)
    assert trigger_strings(LLAMA3_CHAT) == ("<|eom_id|>",)
    with pytest.raises(ValueError, match="'hermes'.*'fence', 'qwen3_chat', 'llama3_chat'"):
        tool_format("hermes")


# ---- fence ----------------------------------------------------------------------------------

def test_fence_call_is_the_last_complete_block_exactly():
    code = "x = 6 * 7\nif x:\n    print(x)"
    assert parse_call(FENCE, f"Let me compute.\n```python\n{code}\n```\n```output") == ToolCall(code)
    two = "```python\nprint(1)\n```\nNow the real one:\n```python\nprint(2)\n```\n```output"
    assert parse_call(FENCE, two) == ToolCall("print(2)")
    reopened = "```python\nbroken(\n```python\nprint(3)\n```\n```output"  # an opening line starts the block anew
    assert parse_call(FENCE, reopened) == ToolCall("print(3)")
    # what follows the last trigger (the tail of its token) is ignored; a text without it is read whole
    assert parse_call(FENCE, "```python\nprint(1)\n```\n```output\n") == ToolCall("print(1)")
    assert parse_call(FENCE, "```python\nprint(1)\n```\n") == ToolCall("print(1)")


def test_fence_turns_without_a_complete_block_resume_with_an_error_observation():
    assert parse_call(FENCE, "I think the answer is 4.\n```output") == NoCall(
        "\nError: No Python code found\n```\n", "no_code")
    assert parse_call(FENCE, "```python\n\n```\n```output") == NoCall(wrapped(FENCE, NO_CODE), "no_code")
    # a block still open when the trigger starts a line: never closed (ToRL runs nothing either)
    unclosed = parse_call(FENCE, "```python\nprint(1)\n```output")
    assert unclosed == NoCall("\nError: the ```python block is not closed with a ``` line\n```\n", "unclosed_block")
    assert unclosed.observation_text == wrapped(FENCE, UNCLOSED_BLOCK)
    # an earlier complete block does not count when the turn ends inside another (ToRL's rule)
    assert parse_call(FENCE, "```python\nprint(1)\n```\n```python\nprint(2)\n```output").reason == "unclosed_block"


def test_fence_trigger_inside_the_code_resumes_silently_and_stays_in_the_code():
    code = 'print("```output")\nprint(1)'
    turn = f"```python\n{code}\n```\n```output"
    first_stop = turn[:turn.index("```output") + len("```output")]  # where the row is first handed over
    assert parse_call(FENCE, first_stop) == NoCall("", "trigger_in_code")
    assert parse_call(FENCE, turn) == ToolCall(code)


# ---- qwen3_chat -----------------------------------------------------------------------------

def qwen3_call(arguments, name="python"):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_qwen3_call_is_the_json_code_exactly():
    code = 'x = "a\\nb"\nprint(x, {"k": 1})'
    turn = "<think>\nI will run it.\n</think>\n\n" + qwen3_call({"code": code})
    assert parse_call(QWEN3_CHAT, turn) == ToolCall(code)
    assert parse_call(QWEN3_CHAT, qwen3_call(json.dumps({"code": code}))) == ToolCall(code)  # arguments as a string
    assert parse_call(QWEN3_CHAT, qwen3_call({"code": "s = '<tool_call>'"})) == ToolCall("s = '<tool_call>'")


def test_qwen3_trigger_inside_a_json_string_resumes_silently_and_stays_in_the_code():
    code = "print('</tool_call>')"
    turn = qwen3_call({"code": code})
    first_stop = turn[:turn.index("</tool_call>") + len("</tool_call>")]
    assert parse_call(QWEN3_CHAT, first_stop) == NoCall("", "trigger_in_code")
    assert parse_call(QWEN3_CHAT, turn) == ToolCall(code)


def test_qwen3_invalid_calls_resume_with_an_error_tool_response():
    assert parse_call(QWEN3_CHAT, "The answer is 4.</tool_call>") == NoCall(wrapped(QWEN3_CHAT, NO_CODE), "no_code")
    bad_json = parse_call(QWEN3_CHAT, '<tool_call>\n{"name": "python", "arguments": {"code": 1 +}}\n</tool_call>')
    assert bad_json.reason == "invalid_call"
    assert bad_json.observation_text.startswith(QWEN3_CHAT.observation_opening + "Error: the tool call is not valid JSON (")
    assert bad_json.observation_text.endswith(")" + QWEN3_CHAT.observation_closing)
    assert parse_call(QWEN3_CHAT, qwen3_call({"code": "ls"}, name="bash")) == NoCall(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nError: unknown tool 'bash'; the only tool is 'python'\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n", "invalid_call")
    for arguments in ({"source": "print(1)"}, {"code": 1}, "not json"):
        assert parse_call(QWEN3_CHAT, qwen3_call(arguments)) == NoCall(wrapped(
            QWEN3_CHAT, 'Error: the python tool takes {"code": "<Python code>"} as its arguments'), "invalid_call")
    assert parse_call(QWEN3_CHAT, qwen3_call({"code": "  \n"})).reason == "no_code"


def test_qwen3_observation_is_what_the_qwen3_template_renders_for_the_tool_turn(tokenizer):
    code = 'x = "a"\nprint(x * 2)'
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
                {"role": "tool", "content": "aa"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cut = rendered.index("</tool_call>") + len("</tool_call>")
    turn, after = rendered[:cut], rendered[cut:]
    assert turn.startswith("<|im_start|>assistant\n<tool_call>\n")
    assert parse_call(QWEN3_CHAT, turn[len("<|im_start|>assistant\n"):]) == ToolCall(code)
    assert after == observation_text(QWEN3_CHAT, ToolResult("ok", "aa\n", 0.0), max_output_chars=256)


# ---- llama3_chat ----------------------------------------------------------------------------

def test_llama3_call_is_the_text_after_the_python_tag_exactly():
    code = "import math\nprint(math.factorial(5))"
    assert parse_call(LLAMA3_CHAT, f"<|python_tag|>{code}<|eom_id|>") == ToolCall(code)
    assert parse_call(LLAMA3_CHAT, "print(1)<|eom_id|>") == NoCall(
        "<|start_header_id|>ipython<|end_header_id|>\n\nError: No Python code found<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n", "no_code")
    assert parse_call(LLAMA3_CHAT, "<|python_tag|> \n<|eom_id|>").reason == "no_code"


# ---- observations ---------------------------------------------------------------------------

def test_observation_texts_are_exact():
    assert observation_text(FENCE, OK_2, max_output_chars=256) == "\n2\n```\n"
    assert observation_text(QWEN3_CHAT, OK_2, max_output_chars=256) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert observation_text(LLAMA3_CHAT, OK_2, max_output_chars=256) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("result, line", [
    (ToolResult("ok", "", 0.0), ""),
    (ToolResult("error", "ZeroDivisionError: division by zero", 0.0), "ZeroDivisionError: division by zero"),
    (ToolResult("timeout", "TimeoutError: the code ran longer than 5 s", 5.0), "TimeoutError: the code ran longer than 5 s"),
    (ToolResult("timeout", "", 5.0), TIMEOUT_LINE),
    (ToolResult("oom", "MemoryError", 0.1), MEMORY_LINE),
    (ToolResult("oom", "MemoryError: Unable to allocate 8 GiB", 0.1), "MemoryError: Unable to allocate 8 GiB"),
    (ToolResult("crash", "the Python process died", 0.1), CRASH_LINE),
])
def test_each_status_renders_a_line_a_model_can_read(result, line):
    assert observation_text(FENCE, result, max_output_chars=256) == "\n" + line + "\n```\n"
    assert TIMEOUT_LINE == "TimeoutError: the code ran out of time" and MEMORY_LINE.startswith("MemoryError: ")
    assert CRASH_LINE == "Error: the Python process died"


def test_an_unknown_status_is_an_error():
    with pytest.raises(ValueError, match="'killed'"):
        observation_text(FENCE, ToolResult("killed", "", 0.0), max_output_chars=256)


def test_long_output_is_cut_in_the_middle():
    output = "A" * 300 + "B" * 300
    text = observation_text(FENCE, ToolResult("ok", "\n" + output + "\n", 0.0), max_output_chars=100)
    body = text[len("\n"):-len("\n```\n")]
    assert body == truncate_middle(output, 100) and len(body) <= 100
    assert body.startswith("AAAA") and body.endswith("BBBB") and "chars dropped" in body


@pytest.mark.parametrize("fmt", [FENCE, QWEN3_CHAT, LLAMA3_CHAT], ids=lambda f: f.name)
def test_observation_tokens_fit_or_are_cut_keeping_the_closing(tokenizer, fmt):
    text = observation_text(fmt, ToolResult("ok", "The product is 42 and the sum is 13. " * 4, 0.0),
                            max_output_chars=1000)
    ids = encode(tokenizer, text)
    assert observation_tokens(fmt, tokenizer, text, room=1000, max_tool_tokens=1000) == (ids, False)
    assert observation_tokens(fmt, tokenizer, text, room=len(ids), max_tool_tokens=len(ids)) == (ids, False)
    opening, closing = encode(tokenizer, fmt.observation_opening), encode(tokenizer, fmt.observation_closing)
    head = encode(tokenizer, text[:-len(fmt.observation_closing)])
    k = len(opening) + len(closing) + 4
    for room, cap in ((1000, k), (k, 1000)):  # the smaller limit rules
        cut, truncated = observation_tokens(fmt, tokenizer, text, room=room, max_tool_tokens=cap)
        assert truncated and len(cut) == k
        assert cut == head[:k - len(closing)] + closing and cut[:len(opening)] == opening
        assert tokenizer.decode(cut, skip_special_tokens=False).endswith(fmt.observation_closing)
    # no room for the opening, the closing and a token of output: the first tokens
    for room in (len(closing), len(opening) + len(closing)):
        assert observation_tokens(fmt, tokenizer, text, room=room, max_tool_tokens=100) == (ids[:room], True)
    assert observation_tokens(fmt, tokenizer, text, room=0, max_tool_tokens=100) == ([], True)
    assert observation_tokens(fmt, tokenizer, text, room=-3, max_tool_tokens=100) == ([], True)


# ---- model text ------------------------------------------------------------------------------

def test_model_text_drops_the_tool_spans(tokenizer):
    pieces = [("Let me compute.\n```python\nprint('\\\\boxed{99}')\n```\n```output", 0),
              (observation_text(FENCE, ToolResult("ok", "\\boxed{99}\n", 0.0), max_output_chars=256), 1),
              ("So the answer is \\boxed{6}.", 0)]
    ids, mask = [], []
    for text, is_tool in pieces:
        piece = encode(tokenizer, text)
        ids += piece
        mask += [is_tool] * len(piece)
    assert model_text(tokenizer, ids, mask) == pieces[0][0] + pieces[2][0]
    assert "\\boxed{99}\n" not in model_text(tokenizer, ids, mask)
    assert tokenizer.decode(ids) == "".join(p for p, _ in pieces)  # the whole row holds the tool's box
    with pytest.raises(ValueError, match="one flag per token"):
        model_text(tokenizer, ids, mask[:-1])


def test_model_text_of_a_chat_turn_keeps_the_call_and_drops_the_tool_turn(tokenizer):
    call = qwen3_call({"code": "print(6)"})
    obs = observation_text(QWEN3_CHAT, ToolResult("ok", "6\n", 0.0), max_output_chars=256)
    ids = encode(tokenizer, call) + encode(tokenizer, obs) + encode(tokenizer, "\\boxed{6}<|im_end|>")
    mask = [0] * len(encode(tokenizer, call)) + [1] * len(encode(tokenizer, obs)) + [0] * (len(ids) - len(
        encode(tokenizer, call)) - len(encode(tokenizer, obs)))
    assert model_text(tokenizer, ids, mask) == call + "\\boxed{6}"  # <|im_end|> is special: skipped


# ---- trigger spellings ----------------------------------------------------------------------

def test_trigger_token_sequences_spell_each_formats_trigger(tokenizer):
    fence = trigger_token_sequences(FENCE, tokenizer)
    for row in fence.tolist():
        assert "```output" in tokenizer.decode([t for t in row if t >= 0])
    turn = encode(tokenizer, "Compute it.\n```python\nprint(2 * 3)\n```\n```output")
    assert any(all(t < 0 or t == s for t, s in zip(row, turn[-len(row):])) for row in fence.tolist())
    assert trigger_token_sequences(QWEN3_CHAT, tokenizer).tolist() == [[tokenizer.convert_tokens_to_ids("</tool_call>")]]
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    assert trigger_token_sequences(LLAMA3_CHAT, tokenizer).tolist() == [[eom]]
    assert stop_token_sequences(tokenizer, ["<|eom_id|>"]) is None  # a decode that skips special tokens drops it


# ---- ToolsSpec ------------------------------------------------------------------------------

def test_tools_spec_defaults_and_validation():
    spec = ToolsSpec()
    assert (spec.format, spec.max_turns, spec.max_tool_tokens, spec.max_output_chars, spec.timeout) == (
        "fence", 4, 128, 256, 5.0)
    assert ToolsSpec(format="llama3_chat", max_turns=1, timeout=1).timeout == 1
    with pytest.raises(ValueError, match=r"ToolsSpec\.format must be one of 'fence', 'qwen3_chat', 'llama3_chat'"):
        ToolsSpec(format="xml")
    for field in ("max_turns", "max_tool_tokens", "max_output_chars"):
        for bad in (0, -1, 2.5, True, "3"):
            with pytest.raises(ValueError, match=rf"ToolsSpec\.{field} must be an integer >= 1"):
                ToolsSpec(**{field: bad})
    for bad in (0, -1.0, math.inf, math.nan, "5", None):
        with pytest.raises(ValueError, match=r"ToolsSpec\.timeout must be a number of seconds > 0"):
            ToolsSpec(timeout=bad)


@pytest.mark.parametrize("text, void", [
    ("Let me compute.\n```python\nprint(3 * 4)\n```\n```output", False),  # a call
    ("```python\nprint(3 * 4)\n```\n", False),  # a complete block, the trigger not yet written
    ("The product is 12, so \\boxed{12}.", False),  # an answer
    ("I think the answer is 12.", True),  # neither: SimpleTIR's void turn
    ("```python\nprint(3 * 4", True),  # code never closed
    ("so \\boxed{12", True),  # a box never closed
    ("", True),
])
def test_a_void_turn_wrote_neither_a_complete_call_nor_a_boxed_answer(text, void):
    assert is_void_turn(FENCE, text) is void


def test_void_turns_of_the_chat_formats_read_their_calls():
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert not is_void_turn(QWEN3_CHAT, call)
    assert is_void_turn(QWEN3_CHAT, '<tool_call>\n{"name": "python"')  # cut inside the call
    assert not is_void_turn(LLAMA3_CHAT, "<|python_tag|>print(1)<|eom_id|>")
    assert is_void_turn(LLAMA3_CHAT, "print(1)")  # no python tag: no call
