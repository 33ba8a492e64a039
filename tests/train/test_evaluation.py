"""`jaxrl4llm eval --output`: one JSON line per (problem, sample), so a score can be diagnosed."""

import json

from jaxrl4llm.cli import main as cli_main
from tests.train.conftest import tiny_overrides


def test_eval_output_writes_every_generation(demo_assets, tmp_path, capsys):
    out = tmp_path / "gen" / "results.jsonl"
    args = ["eval", *tiny_overrides(demo_assets, tmp_path / "run"), "data.eval_limit=3", "--output", str(out),
            "trainer.eval_samples=2", "trainer.eval_temperature=1.0"]  # overrides after the flag (issue #28)
    assert cli_main(args) == 0
    result = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["problem"], r["sample"]) for r in lines] == [(i, s) for i in range(3) for s in range(2)]
    assert all(set(r) == {"set", "problem", "sample", "prompt", "response", "extracted", "gold", "reward"} for r in lines)
    assert all(r["set"] == "test" and r["prompt"] and r["gold"] for r in lines)
    assert result["test/accuracy"] == sum(r["reward"] > 0.5 for r in lines) / 6
