"""`jaxrl4llm eval --output`: one JSON line per (problem, sample), so a score can be diagnosed."""

import json

import pytest

from jaxrl4llm.cli import main as cli_main
from tests.train.conftest import tiny_overrides


def test_eval_output_writes_every_generation(demo_assets, tmp_path, capsys):
    out = tmp_path / "gen" / "results.jsonl"
    args = ["eval", *tiny_overrides(demo_assets, tmp_path / "run"), "data.eval_limit=3", "--output", str(out),
            "trainer.eval_samples=2", "trainer.eval_temperature=1.0"]  # overrides after the flag (issue #28)
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["problem"], r["sample"]) for r in lines] == [(i, s) for i in range(3) for s in range(2)]
    assert all(set(r) == {"set", "problem", "sample", "prompt", "response", "extracted", "gold", "reward"} for r in lines)
    assert all(r["set"] == "test" and r["prompt"] and r["gold"] for r in lines)
    assert result["test/accuracy"] == sum(r["reward"] > 0.5 for r in lines) / 6
    # n = 2: mean@2, pass@1 (= mean@2), pass@2, maj@1, maj@2, and the table (benchmark x metric) on stderr
    assert result["test/mean@2"] == result["test/accuracy"] == pytest.approx(result["test/pass@1"])
    assert {"test/pass@2", "test/maj@1", "test/maj@2", "pass@2", "maj@2"} <= set(result)
    firsts = [r for r in lines if r["sample"] == 0]  # maj@1 = the first sample's correctness
    assert result["test/maj@1"] == pytest.approx(sum(r["reward"] > 0.5 and r["extracted"] is not None for r in firsts) / 3)
    header = next(line for line in captured.err.splitlines() if line.startswith("benchmark"))
    assert header.split() == ["benchmark", "accuracy", "mean@2", "pass@1", "pass@2", "maj@1", "maj@2", "response_length"]


def test_eval_of_a_runs_export_writes_the_aggregate_into_the_run_folder(finished_run, tmp_path, capsys):
    """model.path=RUN/hf_export: the printed aggregate is also RUN/eval.json (a copy of the shared
    finished run, which the other tests keep as it is)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run["out"], run)
    overrides = [o for o in finished_run["overrides"] if not o.startswith(("trainer.out_dir=", "data.eval_limit="))]
    out = tmp_path / "results.jsonl"
    assert cli_main(["eval", *overrides, f"model.path={run / 'hf_export'}", "data.eval_limit=2",
                     "--output", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert json.loads((run / "eval.json").read_text()) == result
    assert f"aggregate: {run / 'eval.json'}" in captured.err
    assert set(result) >= {"test/accuracy", "test/pass@1", "test/response_length", "accuracy", "reward_errors"}
    assert len(out.read_text().splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "run"]  # nothing else written


def test_the_table_has_a_row_per_set_in_file_order_and_the_mean():
    from jaxrl4llm.train.evaluation import format_table

    result = {"math/accuracy": 0.5, "math/mean@2": 0.5, "math/pass@1": 0.5, "math/pass@2": 0.75, "math/maj@2": 0.5,
              "math/maj@1": 0.25, "math/response_length": 10.0, "aime/accuracy": 0.0, "aime/mean@2": 0.0,
              "aime/pass@1": 0.0, "aime/pass@2": 0.0, "aime/maj@1": 0.0, "aime/maj@2": 0.0,
              "aime/response_length": 20.0, "accuracy": 0.25, "pass@2": 0.375, "reward_errors": 0}
    lines = format_table(result).splitlines()
    assert lines[0].split() == ["benchmark", "accuracy", "mean@2", "pass@1", "pass@2", "maj@1", "maj@2", "response_length"]
    assert [line.split()[0] for line in lines[2:]] == ["math", "aime", "mean"]
    assert lines[2].split()[1:] == ["0.5000", "0.5000", "0.5000", "0.7500", "0.2500", "0.5000", "10.0"]
    assert lines[4].split()[1:5] == ["0.2500", "-", "-", "0.3750"]  # a mean not in the result shows "-"


def test_a_vote_is_the_verifiers_normalised_answer():
    from jaxrl4llm.train.evaluation import vote_key

    assert vote_key(r"\frac{1}{2}") == vote_key("1/2") == vote_key(" 1 / 2 ") == vote_key("0.5")  # one number
    assert vote_key("x + 1") == vote_key("x+1") != vote_key("x+2")  # a string, whitespace compacted
    assert vote_key("3") != vote_key("4") and vote_key(None) is None
