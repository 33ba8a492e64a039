"""The tool-call protocol of tool-integrated reasoning: the text a policy writes to call the Python
tool, the string that hands its row to the host, and the text (then tokens) the host feeds back.

A row decodes until its text ends with its format's trigger. The host reads the model's text since
the last observation (`parse_call`), runs the code (`PythonExecutor.run`), renders the result
(`observation_text`) and feeds it to the row as forced tokens (`observation_tokens`: context for
the model, no loss); the model then decodes on. The reward reads the model's own text
(`model_text`): a ``\\boxed{}`` that the code printed earns nothing.

Three formats (`tool_format(name)`); ``{output}`` is the tool's rendered output (`observation_text`):

- **fence**: the model writes ``"```python\\n{code}\\n```\\n"``, then the trigger ``"```output"``;
  the observation is ``"\\n{output}\\n```\\n"``.
- **qwen3_chat**: the model writes ``'<tool_call>\\n{"name": "python", "arguments": {"code": "..."}}\\n'``,
  then the trigger ``"</tool_call>"``; the observation is
  ``"<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``.
- **llama3_chat**: the model writes ``"<|python_tag|>{code}"``, then the trigger ``"<|eom_id|>"``;
  the observation is
  ``"<|start_header_id|>ipython<|end_header_id|>\\n\\n{output}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n"``.

Sources:

- **fence** (base models, no chat template): ToRL (arXiv 2503.23383; GAIR-NLP/ToRL @cb78cf1,
  ``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py``: vLLM ``stop=["```output"]`` (:266),
  ``OBS_START = '```output'``, ``OBS_END = '\\n```\\n'`` (:77-78), observation
  ``f'{OBS_START}\\n{observation.strip()}{OBS_END}'`` after the stripped stop string (:324), so
  ``"\\n{output}\\n```\\n"`` follows the trigger; ``extract_program`` (:79-99): the last
  ```` ```python ```` block, none when the text ends inside one) and Qwen-Agent's
  ``TIRMathAgent`` (Qwen2.5-Math TIR: the same ``OBS_START``/``OBS_END``, ``stop=[OBS_START]``, the
  last complete block). SimpleTIR (arXiv 2509.02479) writes the same blocks but feeds back
  ``"\\nCode execution result: ...\\n"``; we follow ToRL and Qwen, whose TIR models read
  ```` ```output ```` blocks.
- **qwen3_chat** (Hermes tool calls): Qwen3's chat template as shipped with Qwen/Qwen3-0.6B
  (tokenizer_config.json, 2025-04; reproduced verbatim as ``qwen3_chat_template`` in TRL's
  ``trl/chat_template_utils.py``): an assistant tool call renders as
  ``<tool_call>\\n{"name": NAME, "arguments": ARGS|tojson}\\n</tool_call>`` then ``<|im_end|>\\n``;
  a ``tool`` message as ``<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``
  (consecutive tool messages share one user turn); the generation prompt as
  ``<|im_start|>assistant\\n`` (without ``enable_thinking=False``, so the model opens its own
  ``<think>``). The observation is exactly that text from after ``</tool_call>`` on: it starts with
  the turn's ``<|im_end|>`` (forced, so EOS never needs a host decision; tools.md A4.3). Qwen2.5's
  template renders the tool turn the same way.
- **llama3_chat**: Llama 3.1's built-in code interpreter (model card / llama-models
  ``models/llama3_1/prompt_format.md``: system prompt ``Environment: ipython``; the model writes
  ``<|python_tag|>`` then Python and ends the message with ``<|eom_id|>``, "end of message", when it
  expects a tool result; the result comes back in an ``ipython`` turn,
  ``<|start_header_id|>ipython<|end_header_id|>\\n\\n{output}<|eot_id|>``, as raw text), then the
  generation prompt ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``. The output is raw text
  as in the model card's examples: the Hugging Face chat template of Llama 3.1 renders a tool
  message's content through ``tojson`` when it ``is iterable``, which a Jinja string is, so it
  would quote it (``"2"``). Llama 3.1's generation_config counts ``<|eom_id|>`` among its EOS ids:
  a run with tools must take it out of the ids that end a row, or the row ends there instead of
  handing its call to the host.

Texts are decoded with special tokens kept (``tokenizer.decode(ids, skip_special_tokens=False)``):
``<|python_tag|>`` and ``<|eom_id|>`` are special tokens, which a plain decode drops.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

from jaxrl4llm.rewards.extraction import has_complete_box
from jaxrl4llm.tools.python_executor import STATUSES
from jaxrl4llm.tools.python_executor import ToolResult
from jaxrl4llm.tools.python_executor import truncate_middle


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How a policy calls the Python tool and reads its result (the module docstring's list).

    name: "fence" | "qwen3_chat" | "llama3_chat". trigger: the string that ends a call; a row whose
    text ends with it is handed to the host. call_opening: the string the call's code follows
    (```` ```python ```` opens a block, ``<tool_call>`` the call's JSON, ``<|python_tag|>`` the code).
    observation_opening / observation_closing: the text around the tool's output in the
    observation; the closing leaves the model where it writes again (after the output block, or
    at the start of the next assistant turn).
    """

    name: str
    trigger: str
    call_opening: str
    observation_opening: str
    observation_closing: str


FENCE = ToolFormat("fence", trigger="```output", call_opening="```python",
                   observation_opening="\n", observation_closing="\n```\n")
QWEN3_CHAT = ToolFormat("qwen3_chat", trigger="</tool_call>", call_opening="<tool_call>",
                        observation_opening="<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                        observation_closing="\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
LLAMA3_CHAT = ToolFormat("llama3_chat", trigger="<|eom_id|>", call_opening="<|python_tag|>",
                         observation_opening="<|start_header_id|>ipython<|end_header_id|>\n\n",
                         observation_closing="<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
TOOL_FORMATS = {f.name: f for f in (FENCE, QWEN3_CHAT, LLAMA3_CHAT)}
TOOL_NAME = "python"  # the one tool a chat-format call may name

# What a turn that is not a call reads back (inside the format's observation). NO_CODE is slime's
# ReTool example's text ("Error: No Python code found", examples/retool/generate_with_retool.py).
NO_CODE = "Error: No Python code found"
UNCLOSED_BLOCK = "Error: the ```python block is not closed with a ``` line"
# What a failed call reads back when the executor gave no line of its own (observation_text).
TIMEOUT_LINE = "TimeoutError: the code ran out of time"
MEMORY_LINE = "MemoryError: the code ran out of memory"
CRASH_LINE = "Error: the Python process died"


def tool_format(name: str) -> ToolFormat:
    """The ToolFormat called `name`; ValueError listing the valid names for any other."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {name!r}: valid formats are {', '.join(map(repr, TOOL_FORMATS))}")
    return TOOL_FORMATS[name]


def trigger_strings(fmt: ToolFormat) -> tuple[str, ...]:
    """The strings at which the sampler hands a row to the host: (fmt.trigger,). They are matched
    like stop strings (sampling/stops.py): in the decode loop on their token spellings
    (`sampling.stops.trigger_token_sequences`), confirmed on the decoded text by the host. As in
    ToRL (vLLM ``stop=["```output"]``) and Qwen-Agent's TIRMathAgent (``stop=[OBS_START]``); the
    chat formats' triggers close the call (``</tool_call>``, Llama 3.1's ``<|eom_id|>``)."""
    return (fmt.trigger,)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A turn that calls the tool: `code`, the Python to run, exactly as the model wrote it."""

    code: str


@dataclasses.dataclass(frozen=True)
class NoCall:
    """A turn whose trigger runs no code. `observation_text`: what the row reads instead (the
    format's observation around an error line: the model resumes and may try again), or "" for a
    trigger inside the code being written, where the row resumes with no forced token and its turn
    goes on (its text still runs from the last observation; the call is not counted against
    max_turns). `reason`: "no_code", "unclosed_block", "invalid_call" or "trigger_in_code"."""

    observation_text: str
    reason: str


def parse_call(fmt: ToolFormat, turn_text: str) -> ToolCall | NoCall:
    """The code a turn calls the tool with, or why it calls none.

    turn_text: the model's text since the last observation (the row's response text when it has
    none), decoded with special tokens kept, ending with the trigger; what follows the turn's last
    trigger is ignored (at most the tail of the token that completed it), and a text without the
    trigger is read whole, as if it followed.

    - **fence**: the last complete ```` ```python ```` block before the trigger (ToRL's and
      Qwen-Agent's ``extract_program``, line by line: a line starting or ending with
      ```` ```python ```` opens a block, a line starting with ```` ``` ```` closes it); its lines,
      joined by "\\n". A trigger inside a block still open is either in the code (mid-line, e.g. in a
      string literal: "trigger_in_code") or follows code that was never closed (at the start of a
      line: "unclosed_block", ``UNCLOSED_BLOCK``; ToRL runs nothing there either).
    - **qwen3_chat**: the JSON between the turn's first ``<tool_call>`` and its last
      ``</tool_call>`` (the row is handed over at the first ``</tool_call>``, so an earlier one
      lay inside the call's code): ``{"name": "python", "arguments": {"code": CODE}}`` (arguments
      may also be a JSON string of that object). A ``</tool_call>`` inside a JSON string is in the
      code ("trigger_in_code"); invalid JSON, another tool name or no string ``code`` is an
      "invalid_call" whose error line names the fault.
    - **llama3_chat**: the text between the turn's first ``<|python_tag|>`` and the trigger.

    No call opening, or code that is only whitespace: "no_code", ``NO_CODE`` (slime's text). An
    error line is rendered as an observation of the format (``observation_text``'s wrapping).
    """
    end = turn_text.rfind(fmt.trigger)
    before = turn_text if end < 0 else turn_text[:end]
    found = _CALL_PARSERS[tool_format(fmt.name).name](fmt, before)
    if isinstance(found, NoCall) or found.code.strip():
        return found
    return _error(fmt, NO_CODE, "no_code")


def is_void_turn(fmt: ToolFormat, turn_text: str) -> bool:
    """SimpleTIR's void turn (arXiv 2509.02479, `--mask_void_turns`): a turn that wrote neither a
    complete call (`parse_call` finds code to run) nor a complete ``\\boxed{...}`` answer
    (`rewards.extraction.has_complete_box`). turn_text: the model's text of a row's last turn (after its
    last observation; the whole response without one), decoded with special tokens kept as for
    `parse_call`. A row whose last turn is void ends having done nothing: the filter drops it
    (`core.void_turn_filter_mask`); SimpleTIR traces such turns to the unstable, low-probability
    text a model writes after a tool's output."""
    return not isinstance(parse_call(fmt, turn_text), ToolCall) and not has_complete_box(turn_text)


def _error(fmt: ToolFormat, line: str, reason: str) -> NoCall:
    return NoCall(fmt.observation_opening + line + fmt.observation_closing, reason)


def _parse_fence(fmt: ToolFormat, before: str) -> ToolCall | NoCall:
    lines = before.split("\n")
    block, code, inside = [], None, False
    for line in lines:
        if line.startswith(fmt.call_opening) or line.endswith(fmt.call_opening):
            block, inside = [], True
        elif line.startswith("```"):
            if inside:
                code, inside = "\n".join(block), False
        elif inside:
            block.append(line)
    if inside:  # the text ends inside a block
        if lines[-1] and not lines[-1].endswith(fmt.call_opening):
            return NoCall("", "trigger_in_code")
        return _error(fmt, UNCLOSED_BLOCK, "unclosed_block")
    return _error(fmt, NO_CODE, "no_code") if code is None else ToolCall(code)


def _parse_qwen3_call(fmt: ToolFormat, before: str) -> ToolCall | NoCall:
    start = before.find(fmt.call_opening)
    if start < 0:
        return _error(fmt, NO_CODE, "no_code")
    body = before[start + len(fmt.call_opening):]
    if _ends_inside_json_string(body):
        return NoCall("", "trigger_in_code")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return _error(fmt, f"Error: the tool call is not valid JSON ({exc})", "invalid_call")
    name = call.get("name") if isinstance(call, dict) else None
    if name != TOOL_NAME:
        return _error(fmt, f"Error: unknown tool {name!r}; the only tool is {TOOL_NAME!r}", "invalid_call")
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return _error(fmt, 'Error: the python tool takes {"code": "<Python code>"} as its arguments', "invalid_call")
    return ToolCall(code)


def _ends_inside_json_string(text: str) -> bool:
    """Whether `text`, read as the start of JSON, ends inside a string (an unescaped '"' opens and closes one)."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _parse_llama3_call(fmt: ToolFormat, before: str) -> ToolCall | NoCall:
    start = before.find(fmt.call_opening)
    if start < 0:
        return _error(fmt, NO_CODE, "no_code")
    return ToolCall(before[start + len(fmt.call_opening):])


_CALL_PARSERS = {"fence": _parse_fence, "qwen3_chat": _parse_qwen3_call, "llama3_chat": _parse_llama3_call}


def observation_text(fmt: ToolFormat, result: ToolResult, *, max_output_chars: int) -> str:
    """The text fed to the row after its trigger: fmt.observation_opening + output +
    fmt.observation_closing (the module docstring's list).

    output: the result's text stripped of surrounding whitespace (ToRL and Qwen-Agent strip it),
    then cut in the middle to `max_output_chars` characters (`truncate_middle`, whose marker says
    how many were dropped; ToRL keeps 128 + "..." + 128 of 256, verl cuts the middle too). By status:

    - "ok": the code's stdout ("" when it printed nothing, as in Qwen-Agent: ``"\\n\\n```\\n"``);
    - "error": the last line of its traceback, as the executor gives it
      ("ZeroDivisionError: division by zero"; the "last line of the error" of ToRL and Qwen);
    - "timeout": the executor's line ("TimeoutError: the code ran longer than 5 s"), else
      ``TIMEOUT_LINE``;
    - "oom": the executor's MemoryError line when it says more than "MemoryError", else
      ``MEMORY_LINE`` ("MemoryError: the code ran out of memory");
    - "crash" (the worker died: os._exit, a segfault): ``CRASH_LINE`` ("Error: the Python process died").

    A status outside `python_executor.STATUSES` is a ValueError.
    """
    if result.status not in STATUSES:
        raise ValueError(f"unknown tool status {result.status!r}: valid statuses are {', '.join(STATUSES)}")
    output = result.output.strip()
    if result.status == "error":
        output = output or "Error"
    elif result.status == "timeout":
        output = output or TIMEOUT_LINE
    elif result.status == "oom":
        output = output if output not in ("", "MemoryError") else MEMORY_LINE
    elif result.status == "crash":
        output = CRASH_LINE
    return fmt.observation_opening + truncate_middle(output, max_output_chars) + fmt.observation_closing


def observation_tokens(fmt: ToolFormat, tokenizer, text: str, *, room: int,
                       max_tool_tokens: int) -> tuple[list[int], bool]:
    """The observation's token ids, at most min(room, max_tool_tokens) of them, and whether it was cut.

    text: an observation of `fmt` (`observation_text`, or a NoCall's). room: the tokens left of the
    row's response budget (budget - length: tool tokens count against it, as in verl and TRL).
    ids = tokenizer.encode(text, add_special_tokens=False) when they fit. A cut keeps the closing:
    ids = encode(text without fmt.observation_closing)[:k - c] + encode(observation_closing), k the
    limit and c the closing's length, so that a cut output still ends its block or user turn and
    the model resumes where it writes (a chat model cut inside the user turn would write the rest
    of it); the output's text is already cut in its middle (`observation_text`), so this cut drops
    the end of its tail, the rare case of an output whose max_output_chars take more than
    max_tool_tokens tokens. When the opening and the closing leave no token of output (k <= o + c,
    o = the opening's length) the ids are the first k: then the row has (nearly) no room left and
    ends as truncated (verl ends it, TRL rolls the call back; tools.md A1/A4.3). Peers cut the
    output's text only (verl: 256 characters, middle; ToRL 128 + 128) and end a row whose tool
    tokens overflow the budget. max_tool_tokens: the engine's fixed K per observation; leave room
    for the opening and closing (qwen3_chat's take about 15 tokens). Both limits in tokens.
    """
    limit = max(0, min(int(room), int(max_tool_tokens)))
    encode = lambda s: [int(t) for t in tokenizer.encode(s, add_special_tokens=False)]
    ids = encode(text)
    if len(ids) <= limit:
        return ids, False
    opening, closing = fmt.observation_opening, fmt.observation_closing
    tail = encode(closing) if closing and text.endswith(closing) else []
    head = encode(opening) if opening and text.startswith(opening) else []
    if not tail or len(head) + len(tail) >= limit:
        return ids[:limit], True
    return encode(text[:len(text) - len(closing)])[:limit - len(tail)] + tail, True


def model_text(tokenizer, response_ids: Sequence[int], tool_mask: Sequence, *, skip_special_tokens: bool = True) -> str:
    """The text of the model's own tokens: tokenizer.decode of the response ids where tool_mask is
    0, in order (the tool spans removed, the model's pieces joined), special tokens skipped as in
    the reward's decode (`sampling.rollout.decode_responses`).

    response_ids [R] int and tool_mask [R] (1 / True = a forced tool token) of one row, up to its
    length. This is the reward's text: a ``\\boxed{}`` that the code printed earns nothing unless the
    model writes it itself (tools.md A4.4; ToRL and SimpleTIR mask tool output out of the loss;
    the model-only reward text closes the same hole for the reward). ValueError when the lengths differ.
    """
    ids, mask = list(response_ids), list(tool_mask)
    if len(ids) != len(mask):
        raise ValueError(f"response_ids has {len(ids)} tokens and tool_mask {len(mask)}: one flag per token")
    return tokenizer.decode([int(t) for t, m in zip(ids, mask) if not m], skip_special_tokens=skip_special_tokens)


@dataclasses.dataclass(frozen=True)
class ToolsSpec:
    """A rollout's tool settings (a future `rollout.tools` config section builds one).

    format: a `TOOL_FORMATS` name. max_turns: tool calls a row may make (>= 1); after them a
    trigger no longer hands the row over and it decodes on (ToRL's script 1, SimpleTIR 5 in
    training / 10 in evaluation, Qwen-Agent's TIRMathAgent 10, slime 16). max_tool_tokens: tokens
    of one observation (>= 1; `observation_tokens`; the engine's fixed K). max_output_chars:
    characters of a tool's output in the observation (>= 1; `observation_text`; ToRL and verl 256).
    timeout: wall-clock seconds of one call (> 0, finite; `ExecutorConfig.timeout`; SimpleTIR 3,
    rStar2-Agent 4, ROLL 5). Defaults: tools.md plan A's.
    """

    format: str = "fence"
    max_turns: int = 4
    max_tool_tokens: int = 128
    max_output_chars: int = 256
    timeout: float = 5.0

    def __post_init__(self):
        if self.format not in TOOL_FORMATS:
            raise ValueError(f"ToolsSpec.format must be one of {', '.join(map(repr, TOOL_FORMATS))}, "
                             f"got {self.format!r}")
        for name in ("max_turns", "max_tool_tokens", "max_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ToolsSpec.{name} must be an integer >= 1, got {value!r}")
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"ToolsSpec.timeout must be a number of seconds > 0 (finite), got {timeout!r}")
