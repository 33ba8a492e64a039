"""jaxrl4llm.data: dataset loaders (local, gs://, Hub), prompt templates, prompt encoding, difficulty bins,
demo task."""

from jaxrl4llm.data.demo_task import build_char_tokenizer
from jaxrl4llm.data.demo_task import demo_solution
from jaxrl4llm.data.demo_task import make_demo_problems
from jaxrl4llm.data.demo_task import write_demo_task
from jaxrl4llm.data.difficulty import BinningResult
from jaxrl4llm.data.difficulty import bin_by_correct_counts
from jaxrl4llm.data.difficulty import default_thresholds
from jaxrl4llm.data.difficulty import run_difficulty_binning
from jaxrl4llm.data.difficulty import write_difficulty_bins
from jaxrl4llm.data.encoding import encode_prompt_text
from jaxrl4llm.data.encoding import encode_prompts
from jaxrl4llm.data.problems import Problem
from jaxrl4llm.data.problems import format_gold
from jaxrl4llm.data.problems import is_hub_dataset
from jaxrl4llm.data.problems import load_problems
from jaxrl4llm.data.templates import CHAT_TEMPLATES
from jaxrl4llm.data.templates import PROMPT_TEMPLATES
from jaxrl4llm.data.templates import format_prompt
from jaxrl4llm.data.templates import is_chat_prompt
from jaxrl4llm.data.templates import is_chat_template

__all__ = [
    "BinningResult",
    "CHAT_TEMPLATES",
    "PROMPT_TEMPLATES",
    "Problem",
    "bin_by_correct_counts",
    "build_char_tokenizer",
    "default_thresholds",
    "demo_solution",
    "encode_prompt_text",
    "encode_prompts",
    "format_gold",
    "format_prompt",
    "is_hub_dataset",
    "is_chat_prompt",
    "is_chat_template",
    "load_problems",
    "make_demo_problems",
    "run_difficulty_binning",
    "write_demo_task",
    "write_difficulty_bins",
]
