"""jaxrl4llm.tools: the tools a policy calls mid-rollout. ``PythonExecutor`` runs the Python code
blocks it writes in confined, pre-warmed worker processes and returns the tool's output
(``python_executor.py``; what each isolation measure stops and does not, in its docstring).
``protocol.py`` is the text around a call: the formats a policy calls the tool in (``tool_format``:
fence, qwen3_chat, llama3_chat), the code a turn calls it with (``parse_call``), the observation fed
back (``observation_text``, ``observation_tokens``), the model's own text for the reward
(``model_text``), SimpleTIR's void turns (``is_void_turn``) and a rollout's tool settings (``ToolsSpec``)."""

from jaxrl4llm.tools.protocol import TOOL_FORMATS
from jaxrl4llm.tools.protocol import NoCall
from jaxrl4llm.tools.protocol import ToolCall
from jaxrl4llm.tools.protocol import ToolFormat
from jaxrl4llm.tools.protocol import ToolsSpec
from jaxrl4llm.tools.protocol import is_void_turn
from jaxrl4llm.tools.protocol import model_text
from jaxrl4llm.tools.protocol import observation_text
from jaxrl4llm.tools.protocol import observation_tokens
from jaxrl4llm.tools.protocol import parse_call
from jaxrl4llm.tools.protocol import tool_format
from jaxrl4llm.tools.protocol import trigger_strings
from jaxrl4llm.tools.python_executor import ExecutorConfig
from jaxrl4llm.tools.python_executor import PythonExecutor
from jaxrl4llm.tools.python_executor import ToolResult
from jaxrl4llm.tools.python_executor import truncate_middle

__all__ = ["ExecutorConfig", "NoCall", "PythonExecutor", "TOOL_FORMATS", "ToolCall", "ToolFormat", "ToolResult",
           "ToolsSpec", "model_text", "observation_text", "observation_tokens", "parse_call", "tool_format",
           "trigger_strings", "truncate_middle"]
