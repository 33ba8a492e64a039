"""--resume says what it did (issue #28): a finished run is left alone, a changed config is listed
and its shape- or data-changing keys refused, a resumed run's summary numbers its steps from the
checkpoint and prints the held-out accuracy. One tiny finished run (conftest.finished_run) serves
all; the one that continues it works on a copy."""

import hashlib
import json
import re
import shutil

import pytest

import jaxrl4llm.train.loop as loop
from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.resume import CHANGES_FILE, check_config_changes


def _snapshot(folder) -> dict:
    """Every file under `folder`: its bytes' digest and modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loop, "load_policy", refuse)


def _moved(overrides, out) -> list[str]:
    return [f"trainer.out_dir={out}" if o.startswith("trainer.out_dir=") else o for o in overrides]


def test_resuming_a_finished_run_changes_nothing_and_says_so(finished_run, monkeypatch, capsys):
    out = finished_run["out"]
    before = _snapshot(out)
    assert "hf_export/config.json" in before and "checkpoints/2" in {str(p.relative_to(out)) for p in out.rglob("2")}
    _no_model(monkeypatch)
    assert cli_main(["train", *finished_run["overrides"], "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"{out} holds a run that finished at step 2 (trainer.steps=2): nothing to resume, nothing written" in printed
    assert re.search(r"^\s+1 .*\n\s+2 ", printed, flags=re.M)  # the run's own table, steps 1 and 2
    assert "held-out accuracy: " in printed
    assert _snapshot(out) == before  # no eval row, no export, no config.json written


def test_a_resume_that_changes_shape_or_data_keys_is_refused_and_lists_every_change(finished_run, monkeypatch, capsys):
    out = finished_run["out"]
    before = _snapshot(out)
    _no_model(monkeypatch)
    changed = ["trainer.steps=3", "optim.lr=0.5", "rollout.samples_per_prompt=2", "data.template=base"]
    assert cli_main(["train", *finished_run["overrides"], *changed, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-config-change" in err
    assert ("in data.template 'demo' -> 'base', rollout.samples_per_prompt 4 -> 2: keys that fix the checkpoint's "
            "shapes, the data") in err
    assert "(Also changed, allowed: optim.lr 0.001 -> 0.5, trainer.steps 2 -> 3.)" in err
    assert _snapshot(out) == before
    # --allow-config-change accepts them, listed in one line; the same config has no changes
    lines = []
    cfg = load_config(None, finished_run["overrides"] + changed)
    assert sorted(check_config_changes(cfg, allow=True, log=lines.append)) == [
        "data.template", "optim.lr", "rollout.samples_per_prompt", "trainer.steps"]
    assert lines == ["resume: config changed since the run's config.json: data.template 'demo' -> 'base', "
                     "rollout.samples_per_prompt 4 -> 2, optim.lr 0.001 -> 0.5, trainer.steps 2 -> 3"]
    with pytest.raises(ConfigError, match="model.num_layers 1 -> 2"):
        check_config_changes(load_config(None, finished_run["overrides"] + ["model.num_layers=2"]))
    assert check_config_changes(load_config(None, finished_run["overrides"]), log=lines.append) == {}


def test_a_resumed_run_numbers_its_steps_from_the_checkpoint_and_prints_held_out_accuracy(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run["out"], out)
    overrides = _moved(finished_run["overrides"], out)
    assert cli_main(["train", *overrides, "trainer.steps=3", "optim.lr=0.5", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "resume: config changed since the run's config.json: optim.lr 0.001 -> 0.5, trainer.steps 2 -> 3" in printed
    table = printed[printed.index("step  time(s)"):].splitlines()
    assert [line.split()[0] for line in table[1:2]] == ["3"]  # the one resumed step, numbered 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before = next(r["eval/accuracy"] for r in records if r["step"] == 0)
    after = next(r["eval/accuracy"] for r in records if r["step"] == 3 and "eval/accuracy" in r)
    assert f"held-out accuracy: {100 * before:.1f}% -> {100 * after:.1f}%" in printed
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3]
    assert [json.loads(line) for line in (out / CHANGES_FILE).read_text().splitlines()] == [
        {"step": 2, "changes": {"optim.lr": [0.001, 0.5], "trainer.steps": [2, 3]}}]
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 0.5


def test_a_resume_at_the_last_step_of_a_run_that_stopped_after_its_evaluation_does_not_evaluate_again(
        finished_run, tmp_path, capsys):
    """The run stopped after its final evaluation, before it was marked finished (e.g. its export
    failed): the resume restores step 2, runs no step, reuses the logged evaluation (no second
    eval row) and exports."""
    from jaxrl4llm.train.run_folder import MARKER

    out = tmp_path / "run"
    shutil.copytree(finished_run["out"], out)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "finished": None}))
    shutil.rmtree(out / "hf_export")
    rows = (out / "metrics.jsonl").read_text()
    assert cli_main(["train", *_moved(finished_run["overrides"], out), "--resume"]) == 0
    assert (out / "metrics.jsonl").read_text() == rows
    assert (out / "hf_export" / "config.json").is_file() and json.loads((out / MARKER).read_text())["finished"]
    assert "held-out accuracy: " in capsys.readouterr().out
