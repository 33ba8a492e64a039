"""Pre-registered predictions (study/predictions.py): parsing with clear errors, Holm's adjustment
against hand-computed values, and the verdicts on hand-written runs."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.study.predictions import holm_adjust, judge, parse_predictions
from jaxrl4llm.study.study_report import find_run_dirs, load_run
from jaxrl4llm.train.config import ConfigError
from tests.study.test_study_report import make_run

PREDICTION = {"name": "token agg", "takeaway": "token beats sequence", "baseline": {"recipe": "base"},
              "arm": {"recipe": "token"}, "readout": {"metric": "response_length", "direction": "up"}, "accuracy": "up"}


def test_holm_adjustment_by_hand():
    # sorted 0.01, 0.02, 0.04 with m = 3: 0.03, max(0.03, 0.04) = 0.04, max(0.04, 0.04) = 0.04
    assert holm_adjust([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm_adjust([0.5, math.nan])[0] == 0.5 and math.isnan(holm_adjust([0.5, math.nan])[1])
    assert holm_adjust([0.9, 0.6]) == [1.0, 1.0]


@given(st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_holm_never_lowers_a_p_value_and_keeps_the_order(ps):
    adjusted = holm_adjust(ps)
    assert all(a >= p and a <= 1.0 for a, p in zip(adjusted, ps))
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    assert all(adjusted[i] <= adjusted[j] for i, j in zip(order, order[1:]))


def test_a_wrong_prediction_entry_is_an_error_that_names_it():
    with pytest.raises(ConfigError, match=r"predictions\[0\].*missing accuracy"):
        parse_predictions([{k: v for k, v in PREDICTION.items() if k != "accuracy"}])
    with pytest.raises(ConfigError, match=r"readout must be \{metric"):
        parse_predictions([{**PREDICTION, "readout": {"metric": "x", "direction": "sideways"}}])
    with pytest.raises(ConfigError, match="unknown key"):
        parse_predictions([{**PREDICTION, "arms": {}}])


def test_verdicts_engaged_held_reversed_and_inconclusive(tmp_path):
    base_acc, token_acc, flat_acc = [0.50, 0.51, 0.49], [0.60, 0.62, 0.61], [0.52, 0.47, 0.50]
    for recipe, accs, length in (("base", base_acc, 10.0), ("token", token_acc, 20.0), ("flat", flat_acc, 10.0)):
        for seed, acc in enumerate(accs):
            make_run(tmp_path / recipe / f"seed{seed}", seed=seed, labels={"recipe": recipe}, index=seed,
                     final={"test": acc}, reward=lambda step, seed: 0.0)
            path = tmp_path / recipe / f"seed{seed}" / "metrics.jsonl"  # response lengths: `length` + seed noise
            records = [json.loads(line) for line in path.read_text().splitlines()]
            records = [{**r, "response_length": length + seed} if "response_length" in r else r for r in records]
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = [load_run(p) for p in find_run_dirs([tmp_path])]
    predictions = parse_predictions([
        PREDICTION,
        {**PREDICTION, "name": "down", "readout": {"metric": "response_length", "direction": "down"}, "accuracy": "down"},
        {**PREDICTION, "name": "flat", "arm": {"recipe": "flat"}, "accuracy": "none", "primary": False},
    ])
    token, down, flat = judge(predictions, runs)
    assert token.engaged == "engaged" and token.verdict == "held"
    assert token.accuracy.diff == pytest.approx(0.11) and token.accuracy_p_adjusted == pytest.approx(
        min(1.0, 2 * token.accuracy.p_value))  # Holm over the 2 primary predictions, both with this p
    assert down.engaged == "reversed" and down.verdict == "reversed"
    assert flat.engaged == "not engaged" and flat.verdict == "no difference detected (as predicted)"
    # an arm with no run yet (a sweep in progress, or a label typo) is said so and left out of Holm's m
    token, pending = judge(parse_predictions([PREDICTION, {**PREDICTION, "arm": {"recipe": "missing"}}]), runs)
    assert pending.verdict == pending.engaged == "no run yet with {recipe: missing}"
    assert token.accuracy_p_adjusted == pytest.approx(token.accuracy.p_value)  # m = 1


def test_report_judges_the_predictions_of_a_grid_file(tmp_path):
    for recipe, acc in (("base", 0.5), ("token", 0.6)):
        for seed in range(2):
            make_run(tmp_path / "runs" / recipe / f"seed{seed}", seed=seed, labels={"recipe": recipe}, index=seed,
                     final={"test": acc + 0.01 * seed})
    grid = tmp_path / "grid.yaml"
    grid.write_text("out_root: runs\nrecipes: [lite_ppo]\npredictions:\n  - name: token agg\n    baseline: {recipe: base}\n"
                    "    arm: {recipe: token}\n    readout: {metric: entropy, direction: up}\n    accuracy: up\n")
    assert cli_main(["report", str(tmp_path / "runs"), "-o", str(tmp_path / "rep"), "--no-plots",
                     "--predictions", str(grid)]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "## Predictions and outcomes" in text and "| token agg |" in text and "+10 pp" in text
