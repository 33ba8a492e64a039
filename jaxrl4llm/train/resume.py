"""What `--resume` may change, and what it finds: a resume continues the same experiment.

    finished_summary(cfg)          a run that already reached trainer.steps: its summary, nothing to do
    config_changes(cfg)            {key: (run's value, new value)} against the run's config.json
    check_config_changes(cfg, ...) lists them; refuses FIXED_ON_RESUME keys unless --allow-config-change
    logged_eval(out, step)         the held-out scores the run logged at a step (0: before its first)

A resume whose config differs from the run's lists every changed key. Keys that fix the shapes
the checkpoint was made with, the data and reward the run learns from, or its randomness
(FIXED_ON_RESUME) are refused unless `--allow-config-change`: the steps after the resume would
belong to another experiment than those before it, in the same metrics.jsonl. The others
(trainer.steps, eval_every, checkpoint_every, optim.*, mesh.*, ...) are allowed and listed. The
changes a resume accepted are appended to OUT/config_changes.jsonl, and config.json holds the
config the run continues with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from jaxrl4llm.storage import as_path
from jaxrl4llm.train.config import ConfigError, RunConfig, config_to_dict
from jaxrl4llm.train.run_folder import read_marker

# prefixes of flattened keys ("rollout.samples_per_prompt") a resume may not change by default
FIXED_ON_RESUME = (
    "model.",  # the parameters' shapes (and what they are)
    "data.train_files", "data.problem_key", "data.answer_key", "data.template", "data.instruction",
    "data.system_prompt", "data.max_prompt_tokens", "data.on_overlong_prompt", "data.shuffle",  # the prompts and their order
    "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_new_tokens",  # the batch's shape
    "trainer.seed", "trainer.ppo_epochs", "trainer.mini_batches",  # the randomness, the update's structure
    "algorithm.",  # the objective
    "teacher.",  # on-policy distillation's target (the teacher, its dtype and temperature)
    "reward.fn",  # what is rewarded (a prefix: reward.fns too)
)
# keys that say where or how a run is shown, never what it computes: not compared
IGNORED = ("trainer.out_dir", "trainer.overwrite", "trainer.progress_bar", "trainer.compile_cache", "trainer.loggers",
           "trainer.project_name", "trainer.experiment_name", "trainer.log_samples")
CHANGES_FILE = "config_changes.jsonl"


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; algorithm.overrides stays one value (a dict)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key != "algorithm.overrides":
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """{key: (the run's value, cfg's value)} for every key that differs from OUT/config.json
    (keys the run's file does not hold, from an earlier version, are not compared)."""
    path = as_path(cfg.trainer.out_dir) / "config.json"
    try:
        saved = _flat(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
    new = _flat(config_to_dict(cfg))
    return {k: (saved[k], v) for k, v in new.items()
            if k in saved and saved[k] != v and not k.startswith(IGNORED)}


def _shown(changes: dict) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_config_changes(cfg: RunConfig, *, allow: bool = False, log: Callable[[str], None] = print) -> dict:
    """The resume's config changes, logged in one line; a ConfigError that lists the
    FIXED_ON_RESUME ones unless `allow` (--allow-config-change). Reads only."""
    changes = config_changes(cfg)
    fixed = {k: v for k, v in changes.items() if k.startswith(FIXED_ON_RESUME)}
    if fixed and not allow:
        others = {k: v for k, v in changes.items() if k not in fixed}
        raise ConfigError(
            f"--resume: the config differs from the run's (trainer.out_dir={cfg.trainer.out_dir!r}, config.json) in "
            f"{_shown(fixed)}: keys that fix the checkpoint's shapes, the data, the reward, the objective or the seed, "
            f"so the steps from here on would be another experiment than those before. Resume with the run's values, "
            f"start a new run (another trainer.out_dir), or pass --allow-config-change to continue anyway."
            + (f" (Also changed, allowed: {_shown(others)}.)" if others else ""))
    if changes:
        log(f"resume: config changed since the run's config.json: {_shown(changes)}")
    return changes


def record_config_changes(out: str | Path, step: int, changes: dict) -> None:
    """Appends {"step", "changes": {key: [old, new]}} to OUT/CHANGES_FILE (a resume that changed the config)."""
    if changes:
        with open(Path(out) / CHANGES_FILE, "a") as f:
            f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _eval_of(record: dict) -> dict:
    return {k[5:]: v for k, v in record.items() if k.startswith("eval/")}


def logged_eval(out: str | Path, step: int = 0) -> dict | None:
    """The held-out scores the run in OUT logged at `step` (0: before training), or None."""
    found = [_eval_of(r) for r in _records(as_path(out)) if r.get("step") == step and _eval_of(r)]
    return found[-1] if found else None


def finished_summary(cfg: RunConfig) -> dict | None:
    """When trainer.out_dir holds a run that finished at trainer.steps or later (its marker says
    finished, its metrics reach the step): the summary `train` returns, from the run's files, with
    `finished_before: True`; else None. Reads only."""
    out = as_path(cfg.trainer.out_dir)
    marker = read_marker(out)
    if not marker or not marker.get("finished"):
        return None
    records = _records(out)
    steps = [r for r in records if "reward" in r]
    last = max((r["step"] for r in steps), default=0)
    if last < cfg.trainer.steps:
        return None
    after = next((_eval_of(r) for r in reversed(records) if _eval_of(r) and r["step"] > 0), None)
    export = out / "hf_export"
    return {"history": steps, "eval_before": logged_eval(out, 0), "eval_after": after, "state": None, "out_dir": str(out),
            "export_dir": str(export) if export.is_dir() else None, "start_step": 0, "finished_before": last}
