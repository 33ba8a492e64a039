"""The run folder (`trainer.out_dir`): which folder a run owns, and what it may write or delete there.

A run marks its folder first (MARKER, a small JSON file: jaxrl4llm version, creation time,
finish time), then writes only the RUN_OUTPUTS into it. Every check happens before the first
write, so a refused start leaves the folder (or its absence) as it was.

    fresh start  new or empty folder: created, marked. A run folder whose run neither finished
                 nor left a complete checkpoint (it failed early): its RUN_OUTPUTS are removed,
                 with one log line, and it starts over. Another run folder: refused, unless
                 trainer.overwrite=true, which removes its RUN_OUTPUTS (only those). Any other
                 non-empty folder (an HF model folder, a home directory): refused.
    --resume     a run folder with a complete checkpoint; anything else is refused.

Run folders of versions before the marker are recognised by their config.json (a RunConfig's
sections), so they can be resumed or overwritten. OUT may be gs://bucket/path: every check reads
the bucket (jaxrl4llm.storage.as_path).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from jaxrl4llm import __version__
from jaxrl4llm.storage import as_path, is_remote, remove, run_path
from jaxrl4llm.train.config import ConfigError, RunConfig

MARKER = ".jaxrl4llm-run"
# what a run writes into trainer.out_dir, and all a fresh start or trainer.overwrite ever removes
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "response_lengths.jsonl", "tb", "hf_export", "config.json", "layout.json",
               "config_changes.jsonl", "samples.jsonl", "loggers.json")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def read_marker(out: str | Path) -> dict | None:
    """The marker's JSON (None without a marker; {} when it is not a JSON object)."""
    path = as_path(out) / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def mark_run_folder(out: str | Path) -> None:
    """Writes OUT/MARKER for a run starting in OUT (a new run: not finished)."""
    (as_path(out) / MARKER).write_text(json.dumps({
        "about": "a jaxrl4llm run folder (trainer.out_dir); a run removes nothing here but its own outputs",
        "outputs": list(RUN_OUTPUTS), "version": __version__, "created": _now(), "finished": None}, indent=1))


def mark_finished(out: str | Path) -> None:
    """Records in OUT/MARKER that the run finished (a marker is added to a folder of an earlier version)."""
    data = read_marker(out) or {"outputs": list(RUN_OUTPUTS), "created": None}
    data.update(version=__version__, finished=_now())
    (as_path(out) / MARKER).write_text(json.dumps(data, indent=1))


def _is_run_config(path: Path) -> bool:
    """Whether `path` is a config.json a run wrote (the sections of a RunConfig), not an HF model's."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(data, dict) and all(isinstance(data.get(k), dict) for k in ("trainer", "rollout", "algorithm"))
            and "out_dir" in data["trainer"])


def is_run_folder(out: str | Path) -> bool:
    """OUT holds MARKER, or (a run folder of a version before the marker) a run's config.json."""
    out = as_path(out)
    return (out / MARKER).is_file() or _is_run_config(out / "config.json")


def checkpoint_steps(out: str | Path) -> list[int]:
    """The steps of OUT's complete checkpoints, ascending (orbax writes a step to a temporary
    folder and renames it to `checkpoints/<step>` when complete; on gs://, where a rename is
    not atomic, it writes `checkpoints/<step>/commit_success.txt` last)."""
    folder = run_path(out) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()
                  and (not is_remote(out) or (p / "commit_success.txt").exists()))


def check_resumable(out: str | Path) -> int:
    """The newest complete checkpoint step of the run in OUT; a ConfigError when there is
    nothing to resume. Reads only: a refused --resume writes nothing."""
    out = as_path(out)
    key = f"trainer.out_dir={str(out)!r}"
    if not out.is_dir():
        raise ConfigError(f"--resume: {key} does not exist: nothing to resume. Point trainer.out_dir at the run to "
                          f"continue, or start without --resume.")
    if not is_run_folder(out):
        raise ConfigError(f"--resume: {key} is not a jaxrl4llm run folder (no {MARKER} file, no config.json of a run): "
                          f"nothing to resume. Point trainer.out_dir at the run to continue.")
    steps = checkpoint_steps(out)
    if not steps:
        raise ConfigError(f"--resume: {key} holds no complete checkpoint (checkpoints/<step>; trainer.checkpoint_every "
                          f"sets how often a run writes one): nothing to resume. Start without --resume: a run that "
                          f"stopped before its first checkpoint starts over by itself.")
    return steps[-1]


def prepare_out_dir(cfg: RunConfig, resume: bool, log: Callable[[str], None] = print) -> Path:
    """Makes trainer.out_dir ready for a run (module docstring): with `resume`, checks that it
    holds a run to continue and writes nothing; otherwise refuses a folder that is not a run's
    and a run that can be resumed or has finished (unless trainer.overwrite), removes the
    earlier run's RUN_OUTPUTS when starting over (one log line), creates and marks the folder.
    Returns the folder."""
    out = as_path(cfg.trainer.out_dir)
    if resume:
        check_resumable(out)
        return out
    key = f"trainer.out_dir={str(out)!r}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key} is a file, not a folder: choose a new or empty folder for the run.")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not is_run_folder(out):
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        why = " (its config.json is not a run's)" if "config.json" in entries else ""
        raise ConfigError(
            f"{key} is not empty ({shown}) and is not a jaxrl4llm run folder: no {MARKER} file{why}. A run writes only "
            f"into a folder it owns" + (", and trainer.overwrite=true removes only a run's own outputs" if
                                        cfg.trainer.overwrite else "") + ": choose a new or empty trainer.out_dir "
            f"(e.g. {str(out / 'run')!r}).")
    found = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if found:
        steps = checkpoint_steps(out)
        marker = read_marker(out)
        failed_early = not steps and marker is not None and marker.get("finished", "unknown") is None
        if cfg.trainer.overwrite:
            why = "trainer.overwrite"
        elif failed_early:
            why = "no checkpoint to resume (the earlier run stopped before its first one)"
        else:
            state = (f"Pass --resume to continue it from step {steps[-1]}, " if steps else
                     "It has no checkpoint to resume" + (" (it finished)" if marker and marker.get("finished")
                                                         else "") + ". Pass ")
            raise ConfigError(
                f"{key} already holds a run ({', '.join(found)}). {state}trainer.overwrite=true to delete its outputs "
                f"and start over (other files there stay), or choose another trainer.out_dir.")
        for name in found:
            remove(out / name)
        log(f"{why}: removed the earlier run's {', '.join(found)} from {out}")
    out.mkdir(parents=True, exist_ok=True)
    mark_run_folder(out)
    return out
