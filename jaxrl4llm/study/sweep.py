"""Sweeps: a grid of runs (recipes x data x models x seeds) from one YAML file, run cell by
cell, resumable (`jaxrl4llm sweep GRID.yaml`; docs/sweeps.md).

    base: ../demo.yaml                    # config file(s) every cell starts from
    out_root: runs/sweeps/miniature       # cell folders: OUT_ROOT/<recipe>/<data>/<model>/seed<k>
    recipes: [lite_ppo, grpo, {label: dapo32, preset: dapo, overrides: {...}}, ../scalerl.yaml]
    data: [{label: hard, overrides: {data.train_files: [bins/hard.jsonl]}}]
    models: [../models/qwen3_4b_base.yaml]
    seeds: [0, 1, 2]
    overrides: {trainer.steps: 60}        # shared by every cell

A cell is a normal run: `jaxrl4llm train -c BASE -c MODEL -c DATA -c RECIPE KEY=VALUE...`,
launched in its own process (a crash or a memory leak ends that cell only), its output teed to
CELL/train.log. Before it starts, CELL/cell.json records its labels, command and config (what
`jaxrl4llm report` groups by); after it finished, CELL/done.json. Running the grid again skips
done cells, resumes unfinished ones from their last checkpoint (`--resume`), and restarts those
that stopped before their first checkpoint.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from jaxrl4llm.core.recipes import PRESETS
from jaxrl4llm.study.predictions import parse_predictions
from jaxrl4llm.train.config import ConfigError, RunConfig, config_to_dict, load_config
from jaxrl4llm.train.run_folder import RUN_OUTPUTS, checkpoint_steps, is_run_folder, mark_run_folder

GRID_KEYS = ("description", "base", "out_root", "recipes", "data", "models", "seeds", "overrides", "predictions")
# grid key -> the cell label's name (cell.json "labels", the report's arm columns), in path order
AXES = {"recipes": "recipe", "data": "data", "models": "model"}
ENTRY_KEYS = ("label", "config", "overrides")
RECIPE_ENTRY_KEYS = ("label", "preset", "config", "overrides")
SET_BY_SWEEP = ("trainer.seed", "trainer.out_dir")  # each cell's own; a grid may not set them
CELL_FILE, DONE_FILE, LOG_FILE = "cell.json", "done.json", "train.log"
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One value of an axis: config files merged after the base and `key=value` overrides."""

    label: str
    configs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Grid:
    """A validated grid file: config paths resolved against the grid's folder."""

    path: str
    out_root: str
    base: tuple[str, ...]
    axes: dict  # grid key ("recipes", "data", "models") -> list[Entry]; only the axes the file names
    seeds: tuple[int, ...]
    overrides: tuple[str, ...]
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid. `name` is its folder under out_root (`grpo/hard/seed1`); `index`
    its position in the grid's order; `train_args` the `jaxrl4llm train` arguments."""

    name: str
    index: int
    labels: dict  # {"recipe": ..., "data": ..., "model": ..., "seed": k}; only the grid's axes
    configs: tuple[str, ...]
    overrides: tuple[str, ...]
    out_dir: str

    @property
    def train_args(self) -> list[str]:
        return [a for c in self.configs for a in ("-c", c)] + list(self.overrides)


# ----------------------------------------------------------------------------- the grid file


def format_value(value: Any) -> str:
    """A YAML value as the text after `key=` on a command line (flow style: [a, b], {k: v})."""
    if isinstance(value, str):
        try:
            plain = yaml.safe_load(value) == value and not any(ch in value for ch in "[]{},#")
        except yaml.YAMLError:
            plain = False
        return value if plain and value.strip() == value and value else json.dumps(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("\n...").strip()


def flatten_overrides(mapping: Any, where: str) -> list[str]:
    """`{trainer: {steps: 3}, data.train_files: [a]}` -> ["trainer.steps=3", "data.train_files=[a]"].
    Nested mappings become dotted keys, so they merge into the config instead of replacing a section."""
    if mapping is None:
        return []
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where} must be a mapping of config keys to values (e.g. {{trainer.steps: 60}}), got {mapping!r}.")
    out = []
    for key, value in mapping.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where} has a non-text key {key!r}; keys look like section.key (trainer.steps).")
        if isinstance(value, dict) and value:
            out += flatten_overrides({f"{key}.{k}": v for k, v in value.items()}, where)
        else:
            if key in SET_BY_SWEEP:
                raise ConfigError(f"{where} sets {key}, which the sweep sets for every cell (seeds: and out_root:); "
                                  f"remove it from the grid.")
            out.append(f"{key}={format_value(value)}")
    return out


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _config_path(path: Any, grid_dir: Path, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: a config file path must be text, got {path!r}.")
    resolved = os.path.normpath(path if os.path.isabs(path) else os.path.join(grid_dir, path))
    if not Path(resolved).is_file():
        raise ConfigError(f"{where}: config file {path!r} does not exist (looked for {resolved}; paths in a grid are "
                          f"relative to the grid file's folder, like `include:` in a config).")
    return resolved


def _check_label(label: Any, where: str) -> str:
    if not isinstance(label, str) or not _LABEL_RE.match(label):
        raise ConfigError(f"{where}: label {label!r} must be a folder-name-safe word (letters, digits, . _ + -), "
                          f"e.g. label: dapo_long.")
    return label


def _parse_entry(raw: Any, axis: str, i: int, grid_dir: Path) -> Entry:
    where = f"{axis}[{i}]"
    if isinstance(raw, str):
        if axis == "recipes" and not raw.endswith((".yaml", ".yml")):
            if raw not in PRESETS:
                raise ConfigError(f"{where}: {raw!r} is neither a recipe preset ({', '.join(PRESETS)}) nor a .yaml config "
                                  f"file; name a preset, a config path, or {{label: ..., preset: ..., overrides: ...}}.")
            return Entry(label=raw, overrides=(f"algorithm.preset={raw}",))
        path = _config_path(raw, grid_dir, where)
        return Entry(label=_check_label(Path(raw).stem, where), configs=(path,))
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a preset name, a config path or a mapping with keys "
                          f"{', '.join(RECIPE_ENTRY_KEYS if axis == 'recipes' else ENTRY_KEYS)}; got {raw!r}.")
    valid = RECIPE_ENTRY_KEYS if axis == "recipes" else ENTRY_KEYS
    unknown = [k for k in raw if k not in valid]
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}.")
    configs = tuple(_config_path(p, grid_dir, where) for p in _as_list(raw.get("config") or []))
    overrides = flatten_overrides(raw.get("overrides"), f"{where}.overrides")
    preset = raw.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"{where}: preset {preset!r} is not a recipe; valid presets: {', '.join(PRESETS)}.")
        overrides = [f"algorithm.preset={preset}"] + overrides
    label = raw.get("label")
    if label is None and preset and not configs:
        label = preset
    elif label is None and len(configs) == 1 and not preset:
        label = Path(configs[0]).stem
    elif label is None:
        raise ConfigError(f"{where} needs a label: (a short folder name for this {AXES[axis]}, e.g. label: hard).")
    return Entry(label=_check_label(label, where), configs=configs, overrides=tuple(overrides))


def read_grid(path: str | Path) -> Grid:
    """Reads and validates a grid YAML file; returns a Grid (raises ConfigError naming the problem)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Grid file {str(path)!r} does not exist (looked in {Path.cwd()}); e.g. configs/sweeps/miniature.yaml.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Grid file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"Grid file {path} must hold a mapping with keys {', '.join(GRID_KEYS)}.")
    unknown = [k for k in raw if k not in GRID_KEYS]
    if unknown:
        raise ConfigError(f"Grid file {path}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(GRID_KEYS)}.")
    if not isinstance(raw.get("out_root"), str) or not raw["out_root"]:
        raise ConfigError(f"Grid file {path}: out_root: is missing; name the folder that holds the cells, e.g. "
                          f"out_root: runs/sweeps/{path.stem}.")
    grid_dir = path.parent
    base = tuple(_config_path(p, grid_dir, "base") for p in _as_list(raw.get("base") or []))
    axes = {}
    for axis in AXES:
        if axis not in raw:
            continue
        entries = raw[axis]
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"Grid file {path}: {axis}: must be a non-empty list (or left out).")
        parsed = [_parse_entry(e, axis, i, grid_dir) for i, e in enumerate(entries)]
        labels = [e.label for e in parsed]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ConfigError(f"Grid file {path}: {axis}: label(s) {', '.join(twice)} appear more than once; give each "
                              f"entry its own label:.")
        axes[axis] = parsed
    seeds = raw.get("seeds", [0])
    seeds = _as_list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"Grid file {path}: seeds: must be a list of distinct integers (trainer.seed), got {raw.get('seeds')!r}.")
    parse_predictions(raw.get("predictions"), f"Grid file {path}: predictions")  # judged by the report
    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise ConfigError(f"Grid file {path}: description: must be text.")
    return Grid(path=str(path), out_root=raw["out_root"], base=base, axes=axes, seeds=tuple(seeds),
                overrides=tuple(flatten_overrides(raw.get("overrides"), "overrides")), description=description)


def expand_cells(grid: Grid) -> list[Cell]:
    """The cross product recipes x data x models x seeds, in that order (seeds vary fastest).

    A cell's folder is out_root/<recipe>/<data>/<model>/seed<k> with one level per axis the grid
    names (an axis left out of the file adds no level; one named with a single entry does, so
    adding entries later keeps the existing folders). Files merge as base, model, data, recipe;
    overrides apply in the order shared, model, data, recipe, then trainer.seed and trainer.out_dir."""
    axes = [axis for axis in AXES if axis in grid.axes]
    cells = []
    combos = itertools.product(*[grid.axes[a] for a in axes]) if axes else [()]
    for combo in combos:
        by_axis = dict(zip(axes, combo))
        merge_order = [by_axis[a] for a in ("models", "data", "recipes") if a in by_axis]
        for seed in grid.seeds:
            parts = [e.label for e in combo] + [f"seed{seed}"]
            name = "/".join(parts)
            out_dir = os.path.join(grid.out_root, *parts)
            labels = {AXES[a]: e.label for a, e in by_axis.items()}
            labels["seed"] = seed
            cells.append(Cell(
                name=name, index=len(cells), labels=labels,
                configs=grid.base + tuple(c for e in merge_order for c in e.configs),
                overrides=grid.overrides + tuple(o for e in merge_order for o in e.overrides)
                + (f"trainer.seed={seed}", f"trainer.out_dir={format_value(out_dir)}"),
                out_dir=out_dir,
            ))
    return cells


def select_cells(cells: Sequence[Cell], patterns: Sequence[str] | None) -> list[Cell]:
    """The cells whose name matches any pattern (fnmatch; `grpo` also matches everything under
    grpo/); all cells when there are no patterns. No match is a ConfigError listing the names."""
    if not patterns:
        return list(cells)
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(c.name, p.rstrip("/") + "/*")
                                      for p in patterns)]
    if not chosen:
        raise ConfigError(f"--only {' '.join(patterns)} matches no cell; the cells are: {', '.join(c.name for c in cells)}.")
    return chosen


def _local(path: str | None) -> bool:
    return bool(path) and "://" not in path


def cell_config(cell: Cell, *, check_paths: bool = True) -> RunConfig:
    """The cell's validated RunConfig. check_paths: its data files and model folder must exist
    here (off for --emit: the cells run elsewhere)."""
    cfg = load_config(list(cell.configs), list(cell.overrides))
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: set it in the base config or the grid's overrides.")
    if check_paths:
        for key, paths in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files),
                           ("model.path", [cfg.model.path] if cfg.model.path else [])):
            missing = [p for p in paths if _local(p) and not Path(p).exists()]
            if missing:
                raise ConfigError(f"{key}: {', '.join(missing)} does not exist (paths are relative to {Path.cwd()}).")
    return cfg


def validate_cells(cells: Sequence[Cell], *, check_paths: bool = True) -> list[RunConfig]:
    """Loads every cell's config before any cell runs; returns the configs, or raises one
    ConfigError listing each distinct problem with the cells that have it."""
    configs, problems = [], {}
    for cell in cells:
        try:
            configs.append(cell_config(cell, check_paths=check_paths))
        except ConfigError as e:
            problems.setdefault(str(e), []).append(cell.name)
    if problems:
        lines = [f"  {msg}\n    (cells: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''})"
                 for msg, names in problems.items()]
        raise ConfigError(f"{sum(map(len, problems.values()))} of {len(cells)} cells have an invalid config; nothing "
                          f"was run:\n" + "\n".join(lines))
    return configs


def emit_lines(cells: Sequence[Cell], prefix: str = "jaxrl4llm train") -> list[str]:
    """One shell line per cell: `PREFIX -c ... KEY=VALUE ... trainer.out_dir=...` (quoted)."""
    return [f"{prefix} {shlex.join(c.train_args)}" for c in cells]


# ----------------------------------------------------------------------------- cell state


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first key whose value differs, as "key: old -> new". A config field only one side
    has is skipped (one added to jaxrl4llm since the cell started is no difference); free-form
    mappings (algorithm.overrides) are compared whole."""
    if isinstance(a, dict) and isinstance(b, dict) and not prefix.endswith("overrides"):
        for k in [k for k in a if k in b]:
            d = _first_difference(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
            if d:
                return d
        return None
    return None if a == b else f"{prefix}: {a!r} -> {b!r}"


def cell_status(cell: Cell, config: dict) -> tuple[str, str]:
    """(status, detail) of a cell's folder: "done" (done.json), "resume" (a checkpoint to
    continue from), "restart" (outputs but no checkpoint: started over), "new", or "changed"
    (its cell.json was written for another config: the detail names the first difference)."""
    out = Path(cell.out_dir)
    record = out / CELL_FILE
    if record.is_file():
        try:
            old = json.loads(record.read_text()).get("config")
        except ValueError:
            old = None
        diff = _first_difference(old, config) if old is not None else None
        if diff:
            return "changed", diff
    if (out / DONE_FILE).is_file():
        return "done", "finished"
    steps = checkpoint_steps(out)
    if steps:
        return "resume", f"from the checkpoint of step {steps[-1]}"
    found = [n for n in RUN_OUTPUTS if (out / n).exists()]
    if found:
        return "restart", f"no checkpoint yet ({', '.join(found)} present): starts over"
    return "new", "not started"


def launch_args(cell: Cell, status: str) -> list[str]:
    """The `jaxrl4llm train` arguments for a cell in `status` (adds --resume or trainer.overwrite=true)."""
    extra = {"resume": ["--resume"], "restart": ["trainer.overwrite=true"]}.get(status, [])
    return ["train"] + cell.train_args + extra


def last_step(out_dir: str | Path) -> int:
    """The largest `step` in OUT/metrics.jsonl (0 when there is none)."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def final_eval(out_dir: str | Path) -> dict:
    """The last held-out evaluation in OUT/metrics.jsonl as {"step": k, "<set>/accuracy": ...} ({} if none)."""
    path = Path(out_dir) / "metrics.jsonl"
    best: dict = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                ev = {k[5:]: v for k, v in rec.items() if k.startswith("eval/")}
                if ev and rec.get("step", 0) >= best.get("step", -1):
                    best = {"step": rec.get("step", 0), **ev}
    return best


# ----------------------------------------------------------------------------- running


def run_in_subprocess(cell: Cell, args: list[str], *, echo: bool = True) -> int:
    """Runs `python -m jaxrl4llm.cli ARGS` in a child process (the working directory and
    environment of this one), appending its output to CELL/train.log and, with echo, to this
    process's stdout; returns the exit status. Ctrl-C stops the child and propagates."""
    out = Path(cell.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (out / LOG_FILE).open("ab") as log:
        log.write(f"\n$ jaxrl4llm {shlex.join(args)}\n".encode())
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl4llm.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                log.write(chunk)
                log.flush()
                if echo:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
            return proc.wait()
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        finally:
            proc.stdout.close()


@dataclasses.dataclass
class SweepResult:
    """Cell names by outcome; `failed` maps a name to what went wrong."""

    finished: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    failed: dict = dataclasses.field(default_factory=dict)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return ""
    return "\n".join("      " + s for s in [s for s in text.splitlines() if s.strip()][-lines:])


def run_cells(grid: Grid, cells: Sequence[Cell], configs: Sequence[RunConfig], *,
              runner: Callable[[Cell, list], int] | None = None, log: Callable[[str], None] = print) -> SweepResult:
    """Runs the cells in order: skips done ones, resumes or restarts unfinished ones, writes
    cell.json before and done.json after a successful run; a failing cell is recorded and the
    next one starts. Refuses (ConfigError, before running anything) when a cell's folder holds
    a run of another config. `runner(cell, train_args) -> exit status` defaults to
    run_in_subprocess. Returns the SweepResult."""
    runner = runner or run_in_subprocess
    dicts = [config_to_dict(c) for c in configs]
    states = [cell_status(cell, d) for cell, d in zip(cells, dicts)]
    changed = [f"  {c.name}: {detail}" for c, (s, detail) in zip(cells, states) if s == "changed"]
    if changed:
        raise ConfigError("These cells' folders hold runs of a different config (cell.json), so resuming or skipping "
                          "them would mix two experiments:\n" + "\n".join(changed)
                          + f"\nRestore the grid, delete those folders, or choose another out_root (now {grid.out_root}).")
    result = SweepResult()
    for i, (cell, cfg, cfg_dict, (status, detail)) in enumerate(zip(cells, configs, dicts, states)):
        head = f"[{i + 1}/{len(cells)}] {cell.name}"
        if status == "done":
            log(f"{head}: done, skipped")
            result.skipped.append(cell.name)
            continue
        log(f"{head}: {'starting' if status == 'new' else detail}")
        out = Path(cell.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if not is_run_folder(out) and {p.name for p in out.iterdir()} <= {CELL_FILE, LOG_FILE}:
            mark_run_folder(out)  # the cell's folder is its run's: `train` starts in it next to cell.json
        args = launch_args(cell, status)
        (out / CELL_FILE).write_text(json.dumps({
            "grid": grid.path, "cell": cell.name, "index": cell.index, "labels": cell.labels,
            "command": "jaxrl4llm " + shlex.join(["train", *cell.train_args]), "config": cfg_dict,
        }, indent=1))
        t0 = time.perf_counter()
        try:
            code = runner(cell, args)
        except Exception as e:  # the runner itself broke (e.g. could not start a process): this cell fails
            code, why = -1, f"{type(e).__name__}: {e}"
        else:
            why = f"exit status {code}"
        seconds = time.perf_counter() - t0
        reached = last_step(out)
        if code == 0 and reached < cfg.trainer.steps:
            code, why = -1, f"exited 0 but metrics.jsonl ends at step {reached} of {cfg.trainer.steps}"
        if code != 0:
            log(f"{head}: FAILED ({why}) after {seconds:.0f}s; log: {out / LOG_FILE}\n{_tail(out / LOG_FILE)}")
            result.failed[cell.name] = why
            continue
        (out / DONE_FILE).write_text(json.dumps({
            "cell": cell.name, "labels": cell.labels, "steps": reached, "seconds": round(seconds, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "eval": final_eval(out)}, indent=1))
        log(f"{head}: done in {seconds:.0f}s")
        result.finished.append(cell.name)
    return result


def sweep_command(args) -> int:
    """`jaxrl4llm sweep`: validate, then --emit / --dry-run / run; returns the exit status
    (1 when any cell failed)."""
    grid = read_grid(args.grid)
    all_cells = expand_cells(grid)
    cells = select_cells(all_cells, args.only)
    if args.emit:
        validate_cells(all_cells, check_paths=False)
        print("\n".join(emit_lines(cells, args.emit_prefix)))
        return 0
    configs = validate_cells(all_cells)
    configs = [configs[c.index] for c in cells]
    if args.dry_run:
        for cell, cfg in zip(cells, configs):
            status, detail = cell_status(cell, config_to_dict(cfg))
            print(f"{cell.name}: {status} ({detail})\n  jaxrl4llm {shlex.join(launch_args(cell, status))}")
        print(f"{len(cells)} of {len(all_cells)} cells; all configs valid.")
        return 0
    print(f"sweep {grid.path}: {len(cells)} of {len(all_cells)} cells under {grid.out_root}")
    result = run_cells(grid, cells, configs)
    print(f"sweep: {len(result.finished)} finished, {len(result.skipped)} already done, {len(result.failed)} failed")
    if result.failed:
        print("failed cells (run the same command again to retry them; finished cells are skipped):")
        for name, why in result.failed.items():
            print(f"  {name}: {why}")
        return 1
    print(f"report: jaxrl4llm report {grid.out_root} -o {os.path.join(grid.out_root, 'report')}")
    return 0
