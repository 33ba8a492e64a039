"""RL learns to use the Python tool (issue #52's learning criterion; a learning run of minutes,
marked `learning`: `./scripts/test -m learning`). `benchmarks/tool_learning.py` builds the tool task
(products of two 3-digit numbers, `data/tool_task.py`) and its warm start (`jaxrl4llm demo --task
tools`'s: SFT on a teacher that writes a ```python block for 30% of the problems and the product in
its text for the rest), then runs `configs/examples/tool_demo.yaml` from it for STEPS steps with the
same seed in three arms: tools on, off (`rollout.tools.format=null`) and wrong (every integer the
tool prints off by one). Held-out accuracy after the last step, on EVAL_LIMIT test problems x 2
samples, must be at least ON_AT_LEAST with tools on, and beat off and wrong by MARGIN each: the
model cannot multiply in its text, and copying a wrong tool's output scores nothing, so the
accuracy must come from running the code. Thresholds from the runs in docs/results/tools.md (a pilot
at these settings: on 15% -> 71%, off 0% -> 0%, wrong 0% -> 21%, 0.96 calls a row at the last step;
about 8 minutes on a 2-core CPU, the warm start 284 s of it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
EVAL_LIMIT = 50
ON_AT_LEAST = 0.5
MARGIN = 0.2


@pytest.mark.learning
def test_rl_with_the_tool_learns_the_products_that_rl_without_it_or_with_a_wrong_tool_does_not(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tool_learning.py"), "--out", str(tmp_path),
                           "--steps", str(STEPS), "--eval-limit", str(EVAL_LIMIT), "--arms", "on,off,wrong"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "tool_learning.json").read_text())["results"]
    after = {arm: results[arm]["accuracy_after"] for arm in ("on", "off", "wrong")}
    assert after["on"] >= ON_AT_LEAST, after
    assert after["on"] >= after["off"] + MARGIN and after["on"] >= after["wrong"] + MARGIN, after
    assert results["on"]["calls_per_row_last"] >= 0.5, results["on"]  # the policy calls on most rows
