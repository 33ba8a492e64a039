"""jaxrl4llm.tools: the tools a policy calls mid-rollout. ``PythonExecutor`` runs the Python code
blocks it writes in confined, pre-warmed worker processes and returns the tool's output
(``python_executor.py``; what each isolation measure stops and does not, in its docstring)."""

from jaxrl4llm.tools.python_executor import ExecutorConfig
from jaxrl4llm.tools.python_executor import PythonExecutor
from jaxrl4llm.tools.python_executor import ToolResult
from jaxrl4llm.tools.python_executor import truncate_middle

__all__ = ["ExecutorConfig", "PythonExecutor", "ToolResult", "truncate_middle"]
