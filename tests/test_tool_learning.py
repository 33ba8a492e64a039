"""benchmarks/tool_learning.py's arguments and its wrong tool (no model, no run: sub-second)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("tool_learning", REPO / "benchmarks" / "tool_learning.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_arguments_and_the_off_by_one_tool():
    script = _script()
    args = script.parse_args(["--steps", "5", "--arms", "on,wrong", "trainer.seed=1"])
    assert (args.steps, args.arms, args.overrides) == (5, ["on", "wrong"], ["trainer.seed=1"])
    assert script.parse_args([]).arms == ["on", "off", "wrong"]
    with pytest.raises(SystemExit):
        script.parse_args(["--arms", "on,bogus"])
    paths = {"warmstart": "w", "train": "t.jsonl", "test": "e.jsonl"}
    off = script.arm_overrides("off", paths, Path("o"), args)
    assert "rollout.tools.format=null" in off and off[-1] == "trainer.seed=1"
    assert "rollout.tools.format=null" not in script.arm_overrides("wrong", paths, Path("o"), args)
    assert script.off_by_one("121932\n") == "121933\n"
    assert script.off_by_one("-3 and 9") == "-2 and 10"
    assert script.off_by_one("no digits") == "no digits"
