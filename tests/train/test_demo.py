"""The README's first command, shortened: `jaxrl4llm demo --quick` end to end (task, SFT warm
start, Lite PPO, report, curves), and the rule that reuses a warm start."""

import json

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.demo import WARMSTART_RECIPE, warm_start_matches, warm_start_recipe


def test_quick_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli_main(["demo", "--quick", "--out-dir", str(out), "trainer.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy: " in printed and "% -> " in printed
    assert (out / "rl" / "curves.png").stat().st_size > 10_000
    assert (out / "rl" / "hf_export" / "config.json").is_file()
    warm = out / "warmstart"
    assert (warm / "tokenizer.json").is_file() and (warm / "model.safetensors").is_file()
    assert json.loads((warm / WARMSTART_RECIPE).read_text())["sft"]["steps"] == 30
    steps = [json.loads(line)["step"] for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 3]  # eval before, three steps, eval after


def test_warm_start_is_reused_only_for_the_same_recipe(tmp_path):
    recipe = warm_start_recipe(None)
    assert not warm_start_matches(tmp_path, recipe)  # empty folder
    (tmp_path / "config.json").write_text("{}")
    assert not warm_start_matches(tmp_path, recipe)  # no recipe file: built by something else
    (tmp_path / WARMSTART_RECIPE).write_text(json.dumps(recipe))
    assert warm_start_matches(tmp_path, recipe)
    assert not warm_start_matches(tmp_path, warm_start_recipe(17))  # other SFT steps
    (tmp_path / WARMSTART_RECIPE).write_text("{not json")
    assert not warm_start_matches(tmp_path, recipe)
