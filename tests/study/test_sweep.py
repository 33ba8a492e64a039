"""Sweeps: grid validation, cell expansion, --emit, resume of a half-done grid (fake runner),
and one real 2-cell sweep in subprocesses."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.study import sweep
from jaxrl4llm.train.config import ConfigError
from jaxrl4llm.train.run_folder import MARKER
from jaxrl4llm.study.sweep import (
    expand_cells, flatten_overrides, format_value, read_grid, run_cells, select_cells, validate_cells,
)

from tests.train.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]


def write_grid(path: Path, **grid) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def tiny_mapping(assets, **extra) -> dict:
    """conftest's tiny run as a grid `overrides:` mapping (values parsed as the CLI does), minus out_dir."""
    items = dict(item.split("=", 1) for item in tiny_overrides(assets, "unused", **extra))
    items.pop("trainer.out_dir")
    return {k: yaml.safe_load(v) for k, v in items.items()}


@pytest.fixture
def grid_files(tmp_path):
    """A grid folder with a base config and a recipe config next to it."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "base.yaml").write_text("trainer:\n  steps: 3\n")
    (tmp_path / "cfg" / "clip.yaml").write_text("algorithm:\n  preset: lite_ppo\n  overrides:\n    eps_high: 0.28\n")
    return tmp_path / "cfg"


# ----------------------------------------------------------------------------- the grid file


def test_grid_expands_to_cells_in_order_with_paths_labels_and_merge_order(grid_files, tmp_path):
    grid = read_grid(write_grid(
        grid_files / "grid.yaml", base="base.yaml", out_root=str(tmp_path / "out"),
        recipes=["grpo", "clip.yaml", {"label": "dapo32", "preset": "dapo", "overrides": {"algorithm": {"overrides": {"overlong_max_length": 32}}}}],
        data=[{"label": "hard", "overrides": {"data.train_files": ["h.jsonl"]}}],
        seeds=[0, 1], overrides={"trainer": {"steps": 5}, "optim.lr": 1e-5}))
    cells = expand_cells(grid)
    assert [c.name for c in cells] == ["grpo/hard/seed0", "grpo/hard/seed1", "clip/hard/seed0", "clip/hard/seed1",
                                       "dapo32/hard/seed0", "dapo32/hard/seed1"]
    clip = cells[2]
    assert clip.labels == {"recipe": "clip", "data": "hard", "seed": 0} and clip.index == 2
    # files: base, then the recipe's; overrides: shared, data, recipe, then the sweep's own
    assert clip.configs == (str(grid_files / "base.yaml"), str(grid_files / "clip.yaml"))
    assert clip.overrides == ("trainer.steps=5", "optim.lr=1.0e-05", "data.train_files=[h.jsonl]", "trainer.seed=0",
                              f"trainer.out_dir={tmp_path / 'out' / 'clip' / 'hard' / 'seed0'}")
    assert cells[4].overrides[3:5] == ("algorithm.preset=dapo", "algorithm.overrides.overlong_max_length=32")
    assert cells[4].out_dir == str(tmp_path / "out" / "dapo32" / "hard" / "seed0")
    # the loaded configs follow: nested overrides merge into the files' sections
    cfgs = validate_cells(cells, check_paths=False)
    assert cfgs[2].recipe().eps_high == 0.28 and cfgs[2].trainer.steps == 5 and cfgs[2].optim.lr == 1e-5
    assert cfgs[4].recipe().overlong_max_length == 32 and cfgs[4].recipe().name == "dapo"
    assert cfgs[1].trainer.seed == 1 and cfgs[1].trainer.out_dir.endswith("grpo/hard/seed1")


def test_an_axis_left_out_adds_no_folder_level(tmp_path):
    cells = expand_cells(read_grid(write_grid(tmp_path / "g.yaml", out_root="o", seeds=[3])))
    assert [(c.name, c.labels) for c in cells] == [("seed3", {"seed": 3})]


@pytest.mark.parametrize("grid, message", [
    ({"out_root": "o", "recipe": ["grpo"]}, r"unknown key\(s\) 'recipe'; valid keys: description, base, out_root, recipes"),
    ({"recipes": ["grpo"]}, r"out_root: is missing"),
    ({"out_root": "o", "base": "nope.yaml"}, r"base: config file 'nope.yaml' does not exist \(looked for .*nope.yaml"),
    ({"out_root": "o", "recipes": ["grpoo"]}, r"recipes\[0\]: 'grpoo' is neither a recipe preset \(.*grpo.*\) nor a .yaml"),
    ({"out_root": "o", "recipes": ["missing.yaml"]}, r"recipes\[0\]: config file 'missing.yaml' does not exist"),
    ({"out_root": "o", "recipes": [{"preset": "grpo", "overides": {}}]}, r"recipes\[0\] has unknown key\(s\) 'overides'; valid keys: label, preset, config, overrides"),
    ({"out_root": "o", "data": [{"preset": "grpo"}]}, r"data\[0\] has unknown key\(s\) 'preset'; valid keys: label, config, overrides"),
    ({"out_root": "o", "data": [{"overrides": {"data.shuffle": False}}]}, r"data\[0\] needs a label"),
    ({"out_root": "o", "models": [{"label": "a/b"}]}, r"models\[0\]: label 'a/b' must be a folder-name-safe word"),
    ({"out_root": "o", "recipes": ["grpo", {"label": "grpo", "preset": "dapo"}]}, r"label\(s\) grpo appear more than once"),
    ({"out_root": "o", "seeds": [0, 0]}, r"seeds: must be a list of distinct integers"),
    ({"out_root": "o", "seeds": ["a"]}, r"seeds: must be a list of distinct integers"),
    ({"out_root": "o", "overrides": {"trainer.seed": 3}}, r"overrides sets trainer.seed, which the sweep sets"),
    ({"out_root": "o", "data": []}, r"data: must be a non-empty list"),
    ({"out_root": "o", "overrides": ["trainer.steps=3"]}, r"overrides must be a mapping of config keys"),
])
def test_grid_errors_name_the_problem_and_the_fix(tmp_path, grid, message):
    with pytest.raises(ConfigError, match=message):
        read_grid(write_grid(tmp_path / "grid.yaml", **grid))


def test_sweep_and_report_have_help(capsys):
    for command in ("sweep", "report"):
        with pytest.raises(SystemExit) as e:
            cli_main([command, "--help"])
        assert e.value.code == 0 and "usage: jaxrl4llm " + command in capsys.readouterr().out


def test_missing_grid_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"Grid file '.*nope.yaml' does not exist"):
        read_grid(tmp_path / "nope.yaml")


def test_every_cell_is_validated_before_any_runs(demo_assets, tmp_path, monkeypatch, capsys):
    overrides = tiny_mapping(demo_assets)
    grid = write_grid(tmp_path / "g.yaml", out_root=str(tmp_path / "out"),
                      recipes=["lite_ppo", {"label": "typo", "preset": "grpo", "overrides": {"trainer.stepz": 2}}],
                      seeds=[0, 1], overrides=overrides)
    ran = []
    monkeypatch.setattr(sweep, "run_in_subprocess", lambda cell, args: ran.append(cell) or 0)
    assert cli_main(["sweep", str(grid)]) == 2
    err = capsys.readouterr().err
    assert "2 of 4 cells have an invalid config; nothing was run" in err
    assert "'trainer.stepz'" in err and "valid keys: steps" in err and "typo/seed0, typo/seed1" in err
    assert ran == [] and not (tmp_path / "out").exists()


def test_missing_data_file_fails_validation_but_not_emit(demo_assets, tmp_path, capsys):
    grid = write_grid(tmp_path / "g.yaml", out_root="o", recipes=["grpo"],
                      overrides={**tiny_mapping(demo_assets), "data.train_files": ["nope/train.jsonl"]})
    assert cli_main(["sweep", str(grid), "--dry-run"]) == 2
    assert "data.train_files: nope/train.jsonl does not exist" in capsys.readouterr().err
    assert cli_main(["sweep", str(grid), "--emit"]) == 0  # the cells run elsewhere


def test_format_value_and_flatten_give_cli_overrides_that_load_back():
    from jaxrl4llm.train.config import apply_overrides

    values = {"a.s": "plain", "a.t": "true", "a.c": "x, y", "a.l": ["p q", "r"], "a.n": None, "a.f": 1e-6,
              "a.b": False, "a.e": {}, "a.d": {"k": {"m": 2}}}
    flat = flatten_overrides(values, "overrides")
    assert "a.s=plain" in flat and "a.d.k.m=2" in flat and "a.e={}" in flat
    loaded = apply_overrides({}, flat)["a"]
    assert loaded == {"s": "plain", "t": "true", "c": "x, y", "l": ["p q", "r"], "n": None, "f": 1e-6, "b": False,
                      "e": {}, "d": {"k": {"m": 2}}}
    assert format_value("runs/x/seed0") == "runs/x/seed0"


def test_emit_prints_one_launch_line_per_selected_cell(demo_assets, tmp_path, capsys):
    grid = write_grid(tmp_path / "g.yaml", out_root="runs/s", recipes=["lite_ppo", "grpo"], seeds=[0, 1],
                      overrides=tiny_mapping(demo_assets))
    assert cli_main(["sweep", str(grid), "--emit", "--only", "grpo"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for seed, line in enumerate(lines):
        args = shlex.split(line)
        assert args[:2] == ["jaxrl4llm", "train"]
        assert args[-3:] == ["algorithm.preset=grpo", f"trainer.seed={seed}", f"trainer.out_dir=runs/s/grpo/seed{seed}"]
        assert f"data.train_files=[{demo_assets['train']}]" in args
    assert cli_main(["sweep", str(grid), "--emit", "--only", "*/seed1", "--emit-prefix", "tpu_scripts/launch.sh"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [shlex.split(x)[0] for x in lines] == ["tpu_scripts/launch.sh"] * 2 and all("seed1" in x for x in lines)
    assert cli_main(["sweep", str(grid), "--emit", "--only", "ppo"]) == 2
    assert "--only ppo matches no cell; the cells are: lite_ppo/seed0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- running and resuming


class FakeRunner:
    """Stands in for `jaxrl4llm train`: records the call, writes the metrics of `steps` steps
    (or fails for the cells in `fail`)."""

    def __init__(self, steps, fail=()):
        self.steps, self.fail, self.calls = steps, set(fail), []

    def __call__(self, cell, args):
        self.calls.append((cell.name, args))
        if cell.name in self.fail:
            (Path(cell.out_dir) / "train.log").write_text("Traceback ...\nRuntimeError: out of memory\n")
            return 1
        lines = [{"step": s, "reward": 0.1 * s} for s in range(1, self.steps + 1)]
        lines[-1]["eval/accuracy"] = 0.5
        (Path(cell.out_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 0


def _grid(demo_assets, tmp_path, **extra):
    path = write_grid(tmp_path / "g.yaml", out_root=str(tmp_path / "out"), recipes=["lite_ppo", "grpo"], seeds=[0, 1],
                      overrides=tiny_mapping(demo_assets, **extra))
    grid = read_grid(path)
    cells = expand_cells(grid)
    return grid, cells, validate_cells(cells)


def test_a_half_done_grid_resumes_skips_and_reports_failures(demo_assets, tmp_path):
    grid, cells, cfgs = _grid(demo_assets, tmp_path)
    runner = FakeRunner(steps=2, fail={"grpo/seed0"})
    first = run_cells(grid, cells, cfgs, runner=runner, log=lambda s: None)
    assert first.finished == ["lite_ppo/seed0", "lite_ppo/seed1", "grpo/seed1"]
    assert list(first.failed) == ["grpo/seed0"] and first.failed["grpo/seed0"] == "exit status 1"
    done = json.loads((tmp_path / "out" / "lite_ppo" / "seed0" / "done.json").read_text())
    assert done["steps"] == 2 and done["eval"] == {"step": 2, "accuracy": 0.5}
    cell = json.loads((tmp_path / "out" / "grpo" / "seed0" / "cell.json").read_text())
    assert cell["labels"] == {"recipe": "grpo", "seed": 0} and cell["index"] == 2
    assert cell["config"]["algorithm"]["preset"] == "grpo" and cell["command"].startswith("jaxrl4llm train ")
    assert not (tmp_path / "out" / "grpo" / "seed0" / "done.json").exists()
    # each cell's folder is marked as its run's before cell.json goes in: `train` may start in it
    assert all((Path(c.out_dir) / MARKER).is_file() for c in cells)

    # the failed cell got as far as a checkpoint at step 1: the next sweep resumes it, skips the rest
    (tmp_path / "out" / "grpo" / "seed0" / "checkpoints" / "1").mkdir(parents=True)
    (tmp_path / "out" / "grpo" / "seed0" / "checkpoints" / "2.orbax-checkpoint-tmp-9").mkdir()  # half-written: ignored
    runner = FakeRunner(steps=2)
    log = []
    second = run_cells(grid, cells, cfgs, runner=runner, log=log.append)
    assert second.skipped == ["lite_ppo/seed0", "lite_ppo/seed1", "grpo/seed1"] and second.finished == ["grpo/seed0"]
    assert [(name, args[-1]) for name, args in runner.calls] == [("grpo/seed0", "--resume")]
    assert any("grpo/seed0: from the checkpoint of step 1" in line for line in log)


def test_unfinished_cell_without_checkpoint_restarts_with_overwrite(demo_assets, tmp_path):
    grid, cells, cfgs = _grid(demo_assets, tmp_path)
    out = Path(cells[0].out_dir)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    runner = FakeRunner(steps=2)
    run_cells(grid, cells[:1], cfgs[:1], runner=runner, log=lambda s: None)
    assert runner.calls[0][1][0] == "train" and runner.calls[0][1][-1] == "trainer.overwrite=true"


def test_a_cell_that_exits_0_short_of_its_steps_is_a_failure(demo_assets, tmp_path):
    grid, cells, cfgs = _grid(demo_assets, tmp_path)
    result = run_cells(grid, cells[:1], cfgs[:1], runner=FakeRunner(steps=1), log=lambda s: None)
    assert result.failed == {"lite_ppo/seed0": "exited 0 but metrics.jsonl ends at step 1 of 2"}


def test_changed_config_of_a_started_cell_is_refused(demo_assets, tmp_path):
    grid, cells, cfgs = _grid(demo_assets, tmp_path)
    run_cells(grid, cells[:1], cfgs[:1], runner=FakeRunner(steps=2), log=lambda s: None)
    grid, cells, cfgs = _grid(demo_assets, tmp_path, **{"optim.lr": 5e-4})
    runner = FakeRunner(steps=2)
    with pytest.raises(ConfigError, match=r"(?s)lite_ppo/seed0: optim.lr: 0.001 -> 0.0005.*delete those folders"):
        run_cells(grid, cells, cfgs, runner=runner, log=lambda s: None)
    assert runner.calls == []
    grid, cells, cfgs = _grid(demo_assets, tmp_path, **{"algorithm.overrides": {"eps_high": 0.28}})
    with pytest.raises(ConfigError, match=r"lite_ppo/seed0: algorithm.overrides: \{\} -> \{'eps_high': 0.28\}"):
        run_cells(grid, cells, cfgs, runner=runner, log=lambda s: None)
    # a config field the cell's record lacks (added to jaxrl4llm since) is no difference
    record = Path(cells[0].out_dir) / "cell.json"
    saved = json.loads(record.read_text())
    del saved["config"]["trainer"]["keep_checkpoints"]
    record.write_text(json.dumps(saved))
    grid, cells, cfgs = _grid(demo_assets, tmp_path)
    assert run_cells(grid, cells[:1], cfgs[:1], runner=runner, log=lambda s: None).skipped == ["lite_ppo/seed0"]


def test_cli_exits_1_listing_failures_and_dry_run_shows_states(demo_assets, tmp_path, monkeypatch, capsys):
    path = write_grid(tmp_path / "g.yaml", out_root=str(tmp_path / "out"), recipes=["lite_ppo", "grpo"],
                      overrides=tiny_mapping(demo_assets))
    monkeypatch.setattr(sweep, "run_in_subprocess", FakeRunner(steps=2, fail={"grpo/seed0"}))
    assert cli_main(["sweep", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 finished, 0 already done, 1 failed" in out and "grpo/seed0: exit status 1" in out
    assert "RuntimeError: out of memory" in out  # the tail of the failed cell's log
    assert cli_main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "lite_ppo/seed0: done (finished)" in out and "grpo/seed0: new (not started)" in out


def test_select_cells_by_pattern(tmp_path):
    cells = expand_cells(read_grid(write_grid(tmp_path / "g.yaml", out_root="o", recipes=["grpo", "dr_grpo"], seeds=[0, 1])))
    assert [c.name for c in select_cells(cells, ["grpo"])] == ["grpo/seed0", "grpo/seed1"]
    assert [c.name for c in select_cells(cells, ["*grpo/seed1"])] == ["grpo/seed1", "dr_grpo/seed1"]
    assert len(select_cells(cells, None)) == 4


def test_shipped_miniature_grid_is_valid():
    grid = read_grid(REPO / "configs" / "sweeps" / "miniature.yaml")
    cells = expand_cells(grid)
    assert len(cells) == 15 and cells[0].name == "lite_ppo/seed0" and cells[-1].name == "scalerl/seed2"
    cfgs = validate_cells(cells, check_paths=False)
    assert [c.recipe().name for c in cfgs[::3]] == ["lite_ppo", "grpo", "dapo", "cispo", "scalerl"]
    assert cfgs[-1].rollout.retire_pass_rate == 0.9 and cfgs[6].recipe().overlong_max_length == 32
    assert all(c.rollout.max_new_tokens == 32 and c.trainer.steps == 60 for c in cfgs)


@pytest.mark.slow
def test_real_two_cell_sweep_runs_resumes_and_reports(demo_assets, tmp_path, capsys, monkeypatch):
    # the cells differ in data order only: the second reuses the first's compiled programs from disk
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla_cache"))
    path = write_grid(tmp_path / "g.yaml", out_root=str(tmp_path / "out"), recipes=["lite_ppo"],
                      data=[{"label": "shuffled"}, {"label": "in_order", "overrides": {"data.shuffle": False}}],
                      seeds=[0], overrides=tiny_mapping(demo_assets))
    assert cli_main(["sweep", str(path)]) == 0
    assert "2 finished, 0 already done, 0 failed" in capsys.readouterr().out
    for name in ("shuffled", "in_order"):
        run = tmp_path / "out" / "lite_ppo" / name / "seed0"
        assert (run / "done.json").is_file() and (run / "train.log").is_file()
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        assert json.loads((run / "config.json").read_text())["data"]["shuffle"] == (name == "shuffled")
    assert cli_main(["sweep", str(path)]) == 0
    assert "0 finished, 2 already done, 0 failed" in capsys.readouterr().out
    assert cli_main(["report", str(tmp_path / "out"), "-o", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "2 runs in 2 arms" in text and "| lite_ppo/in_order | 1 (0) | lite_ppo | 2 |" in text
    assert (tmp_path / "report" / "reward.png").is_file()
