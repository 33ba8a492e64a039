"""data/tool_task.py: the tool task's problems, its worked solutions (the fence protocol's exact
call and observation), the warm start teacher's mix, the task files, and configs/examples/tool_demo.yaml."""

from pathlib import Path

import pytest
import yaml

from jaxrl4llm.data import build_char_tokenizer, format_prompt, load_problems
from jaxrl4llm.data.tool_task import (make_tool_problems, text_solution, tool_solution, warm_start_completions,
                                      write_tool_task)
from jaxrl4llm.tools.protocol import FENCE, ToolCall, ToolsSpec, model_text, observation_text, parse_call
from jaxrl4llm.tools.python_executor import ToolResult

REPO = Path(__file__).resolve().parents[2]


def test_problems_are_seeded_products_of_two_3_digit_numbers():
    problems = make_tool_problems(50, seed=3)
    assert problems == make_tool_problems(50, seed=3) and problems != make_tool_problems(50, seed=4)
    for p in problems:
        a, b = p.metadata["a"], p.metadata["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert p.problem == f"What is {a} * {b}?" and p.answer == str(a * b)


def test_the_tool_solution_is_the_fence_protocol_exactly():
    """The call parses to code that prints the gold answer, the observation is what the rollout feeds
    back for that output, and the text after it boxes the answer."""
    p = make_tool_problems(1, seed=0)[0]
    solution = tool_solution(p)
    cut = solution.index(FENCE.trigger) + len(FENCE.trigger)
    call = parse_call(FENCE, solution[:cut])
    assert isinstance(call, ToolCall) and call.code == f"print({p.metadata['a']} * {p.metadata['b']})"
    output = str(p.metadata["a"] * p.metadata["b"])  # what the code prints
    observation = observation_text(FENCE, ToolResult("ok", output + "\n", 0.0), max_output_chars=32)
    assert solution == solution[:cut] + observation + f"\\boxed{{{p.answer}}}"
    assert text_solution(p).endswith(f"= {p.answer} \\boxed{{{p.answer}}}")


def test_warm_start_teacher_writes_code_for_its_share_of_the_problems():
    problems = make_tool_problems(400, seed=1)
    completions = warm_start_completions(problems, code_share=0.3, seed=0)
    with_code = [c.startswith(FENCE.call_opening) for c in completions]
    assert 0.22 < sum(with_code) / len(problems) < 0.38
    assert completions == warm_start_completions(problems, code_share=0.3, seed=0)
    assert not any(c.startswith(FENCE.call_opening) for c in warm_start_completions(problems, code_share=0.0))
    assert all(c.startswith(FENCE.call_opening) for c in warm_start_completions(problems, code_share=1.0))
    with pytest.raises(ValueError, match="code_share"):
        warm_start_completions(problems, code_share=1.5)


def test_task_files_load_and_fit_the_warm_start_and_rollout_budgets(tmp_path):
    """Written, loaded back (the factors read from the text), disjoint splits; with the demo's
    character tokenizer a prompt + tool solution + EOS fits the SFT length (128) and the response
    budget (96 tokens: the tool's tokens count against it)."""
    from jaxrl4llm.models import load_tokenizer
    from jaxrl4llm.train.demo import TOOL_SFT

    paths = write_tool_task(tmp_path / "data", num_train=24, num_test=8, seed=0)
    train, test = load_problems(paths["train"]), load_problems(paths["test"])
    assert len(train) == 24 and len(test) == 8 and not {p.problem for p in train} & {p.problem for p in test}
    tokenizer = load_tokenizer(build_char_tokenizer(tmp_path / "tok"))
    for p in train:
        solution = tool_solution(p)
        response = tokenizer(" " + solution)["input_ids"]
        assert len(tokenizer(format_prompt(p, "demo"))["input_ids"]) + len(response) + 1 <= TOOL_SFT["length"]
        assert len(response) + 1 <= 96
        tool = [0.0] * len(response)  # the observation's characters, as the rollout would mark them
        start = 1 + solution.index(FENCE.trigger) + len(FENCE.trigger)
        end = start + len(FENCE.observation_opening + p.answer + FENCE.observation_closing)
        tool[start:end] = [1.0] * (end - start)
        assert model_text(tokenizer, response, tool).endswith(f"\\boxed{{{p.answer}}}")  # the model boxes it itself


def test_tool_demo_config_is_the_demo_with_tools_on(tmp_path):
    """configs/examples/tool_demo.yaml: the demo's config (it loads without its rollout.tools section)
    plus a rollout.tools section whose keys are ToolsSpec's (the fence format)."""
    from jaxrl4llm.train.config import load_config

    path = REPO / "configs" / "examples" / "tool_demo.yaml"
    raw = yaml.safe_load(path.read_text())
    spec = ToolsSpec(**raw["rollout"]["tools"])
    assert spec.format == "fence" and spec.max_turns >= 1
    plain = dict(raw, rollout={k: v for k, v in raw["rollout"].items() if k != "tools"},
                 include=str(REPO / "configs" / "demo.yaml"))
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    cfg = load_config(tmp_path / "plain.yaml")
    assert cfg.data.template == "demo" and cfg.rollout.max_new_tokens == 96 and cfg.recipe().name == "lite_ppo"


def test_the_tool_demo_has_its_own_warm_start_recipe_and_config():
    from jaxrl4llm.train.demo import config_path, warm_start_recipe

    assert config_path("tools").name == "tool_demo.yaml" and config_path().name == "demo.yaml"
    tools, arithmetic = warm_start_recipe(task="tools"), warm_start_recipe()
    assert tools["task"]["name"] == "tools" and tools["sft"]["code_share"] == 0.3 and tools != arithmetic
    assert "name" not in arithmetic["task"]  # the arithmetic demo's recipe as before: its warm starts are reused
    with pytest.raises(ValueError, match="unknown demo task"):
        config_path("chess")
