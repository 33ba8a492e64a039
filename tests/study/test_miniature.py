"""The miniature study's setup (study/miniature.py): prepare's task and warm starts (tiny SFT),
the pilot's gates and exit code, and the shipped chain grids with their predictions."""

import glob
import json
from pathlib import Path

import pytest
import yaml

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.data.chain_task import CHAIN_BANDS
from jaxrl4llm.study import miniature
from jaxrl4llm.study.predictions import read_predictions
from jaxrl4llm.study.sweep import expand_cells, read_grid, validate_cells
from jaxrl4llm.train.warm_start import RECIPE_FILE

REPO = Path(__file__).resolve().parents[2]
CHAIN_GRIDS = sorted(glob.glob(str(REPO / "configs" / "sweeps" / "chain_*.yaml")))


def test_prepare_writes_the_task_and_both_starts_and_reuses_them(tmp_path, monkeypatch):
    monkeypatch.setattr(miniature, "CHAIN_TASK", dict(num_train=64, num_test_per_band=4, seed=0))
    monkeypatch.setattr(miniature, "CHAIN_MODEL", dict(architecture="qwen3", hidden_size=32, intermediate_size=64,
                                                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16))
    monkeypatch.setattr(miniature, "CHAIN_SFT", dict(steps=2, batch_size=8, lr=1e-3, length=128))
    lines = []
    paths = miniature.prepare(tmp_path, log=lines.append)
    assert set(paths) == {"train", *CHAIN_BANDS, "base_like", "aligned_like"}
    for start in ("base_like", "aligned_like"):
        recipe = json.loads((tmp_path / start / RECIPE_FILE).read_text())
        assert recipe["teacher"] == miniature.start_recipe(start)["teacher"]
        assert (tmp_path / start / "config.json").is_file() and (tmp_path / start / "tokenizer.json").is_file()
    prompts, completions = miniature.teacher_data(paths["train"], miniature.STARTS["base_like"])
    assert len(prompts) == 64 and any(not stops for _, stops in completions)
    lines.clear()
    miniature.prepare(tmp_path, log=lines.append)
    assert sum("reusing" in line for line in lines) == 2


def _arm(*, truncation, repeat, clip_high, all_same, accuracy, seconds=2.0):
    steps = [{"truncation_rate": truncation, "truncated_repeat_ratio": repeat, "truncated_unfinished_ratio": 1 - repeat,
              "clip_frac_high": clip_high, "all_same_groups": all_same}] * 3
    bands = {f"test_{b}/accuracy": accuracy for b in CHAIN_BANDS}
    return {"steps": steps, "eval": {"accuracy": accuracy, **bands}, "seconds_per_step": seconds}


PASSING = {
    "aligned_like_long": _arm(truncation=0.01, repeat=0.0, clip_high=0.02, all_same=0.3, accuracy=0.6),
    "base_like_long": _arm(truncation=0.2, repeat=0.7, clip_high=0.005, all_same=0.3, accuracy=0.3),
    "aligned_like_short": _arm(truncation=0.3, repeat=0.05, clip_high=0.02, all_same=0.3, accuracy=0.6),
    "base_like_short": _arm(truncation=0.4, repeat=0.4, clip_high=0.02, all_same=0.3, accuracy=0.3),
}


def test_pilot_gates_pass_and_each_failure_is_named():
    gates = miniature.pilot_gates(PASSING)
    assert all(g.passed for g in gates), [g.line() for g in gates if not g.passed]
    weak_clip = {**PASSING, "aligned_like_long": _arm(truncation=0.01, repeat=0.0, clip_high=0.002, all_same=0.3,
                                                      accuracy=0.6)}
    failed = [g.name for g in miniature.pilot_gates(weak_clip) if not g.passed]
    assert failed == ["clips high"]
    assert miniature.pilot_gates(weak_clip)[7].line().startswith("FAIL  clips high: 0.002 (>= 0.01)")


def test_pilot_command_prints_the_gates_writes_them_and_exits_1_on_a_failure(tmp_path, monkeypatch, capsys):
    for start in miniature.STARTS:
        (tmp_path / start).mkdir()
        (tmp_path / start / "config.json").write_text("{}")
    arms = dict(PASSING, base_like_long=_arm(truncation=0.2, repeat=0.7, clip_high=0.0, all_same=0.05, accuracy=0.3))
    monkeypatch.setattr(miniature, "pilot_arm", lambda out, start, budget, evaluate, log: arms[f"{start}_{budget}"])
    (tmp_path / "pilot").mkdir()
    assert cli_main(["miniature", "pilot", "--out-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  all-same groups: 0.05 (>= 0.15)" in out and "9/10 gates passed" in out
    record = json.loads((tmp_path / "pilot" / "gates.json").read_text())
    assert [g["passed"] for g in record["gates"]].count(False) == 1


def test_pilot_without_prepare_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="jaxrl4llm miniature prepare"):
        miniature.pilot(tmp_path)


def test_budgets_and_pilot_recipe_are_the_configs_the_grids_use():
    for name, tokens in miniature.BUDGETS.items():
        assert yaml.safe_load((miniature.CONFIGS / f"{name}_budget.yaml").read_text())["rollout"]["max_new_tokens"] == tokens
    assert (miniature.CONFIGS / f"{miniature.PILOT_RECIPE}.yaml").is_file()
    for start in miniature.STARTS:
        assert yaml.safe_load((miniature.CONFIGS / f"{start}.yaml").read_text())["model"]["path"] == f"runs/miniature/{start}"


def test_chain_grids_are_valid_share_their_baseline_and_predict_arms_that_exist():
    assert len(CHAIN_GRIDS) == 5
    cells = {}
    for grid in CHAIN_GRIDS:
        expanded = expand_cells(read_grid(grid))
        for cell, cfg in zip(expanded, validate_cells(expanded, check_paths=False)):
            assert cells.setdefault(cell.name, cell.overrides) == cell.overrides  # a shared cell is one run
            assert cfg.trainer.ppo_epochs * cfg.trainer.mini_batches == 4 and cfg.trainer.steps == 50
            assert cfg.reward.fn == "jaxrl4llm.rewards:strict_box_reward"
    assert len(cells) == 37
    arms = {tuple(sorted(dict(zip(("recipe", "data", "model"), name.split("/")[:3])).items())) for name in cells}
    predictions = read_predictions(CHAIN_GRIDS)
    assert len(predictions) == 8
    for p in predictions:
        assert tuple(sorted(p.baseline.items())) in arms and tuple(sorted(p.arm.items())) in arms, p.name
