"""Where a run writes the files it appends to: OUT itself, or for a gs:// OUT a local staging
folder copied to OUT at each checkpoint, at the end and on a preemption.

GCS objects are written whole (no append), but a run appends to its metrics (metrics.jsonl),
its TensorBoard events (tb/), its per-step lengths (response_lengths.jsonl), its accepted
config changes (config_changes.jsonl), its logged rollouts (samples.jsonl) and its W&B / MLflow
run ids (loggers.json): STAGED. With `trainer.out_dir: gs://bucket/run` these
live in `$XDG_CACHE_HOME/jaxrl4llm/runs/bucket/run` (~/.cache/...) on process 0, and `sync`
rewrites every staged file changed since the last sync as a whole object of OUT. The
checkpoints go straight to gs:// (orbax, tensorstore's GCS driver), the marker and config.json
are small whole files written in place, the HF export is written locally and uploaded.

    files = RunFiles(cfg.trainer.out_dir)   # files.dir: where to append (OUT when local)
    files.pull()                            # a resume: the staged files as OUT holds them
    ...append to files.dir / "metrics.jsonl" ...
    files.sync()                            # after each checkpoint save, at the end, on SIGTERM

What OUT holds is never ahead of what a resume needs: a resume pulls OUT's copies, and the
metrics writer drops the lines after the checkpoint it resumes from (`truncate_after`), so the
metrics continue without a gap or a repeated step. A run killed without warning (a host lost)
loses only its staged lines since the last sync: those of steps after its last checkpoint,
which the resume runs again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from jaxrl4llm.storage import cache_root, is_remote, run_path

STAGED = ("metrics.jsonl", "response_lengths.jsonl", "config_changes.jsonl", "tb", "samples.jsonl", "loggers.json")


def staging_folder(out_dir: str) -> Path:
    """The local folder of gs:// run `out_dir`'s staged files: `$XDG_CACHE_HOME/jaxrl4llm/runs/`
    (default ~/.cache) + bucket/path."""
    return cache_root() / "runs" / str(out_dir).split("://", 1)[1].strip("/")


class RunFiles:
    """The folder a run appends its files to (`dir`), and its copy to a gs:// run folder."""

    def __init__(self, out_dir: str | os.PathLike, *, enabled: bool = True):
        """enabled=False (every process of a multi-host run but the first): pull and sync do nothing."""
        self.dir = staging_folder(str(out_dir)) if is_remote(out_dir) else Path(out_dir)
        self.remote = run_path(out_dir) if is_remote(out_dir) and enabled else None
        self._synced: dict[str, tuple[int, int]] = {}  # relative name -> (size, mtime_ns) of the last upload

    def _local_files(self) -> dict[str, Path]:
        found = {}
        for name in STAGED:
            item = self.dir / name
            for f in ([item] if item.is_file() else sorted(item.rglob("*")) if item.is_dir() else []):
                if f.is_file():
                    found[str(f.relative_to(self.dir))] = f
        return found

    def pull(self) -> None:
        """Makes the staging folder hold OUT's staged files and nothing else (a staging folder
        left by an earlier run on this machine is replaced). Local OUT: nothing to do."""
        if self.remote is None:
            return
        for name in STAGED:
            item = self.dir / name
            shutil.rmtree(item) if item.is_dir() else item.unlink(missing_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        import fsspec

        fs, root = fsspec.core.url_to_fs(str(self.remote).rstrip("/"))
        for name in STAGED:
            for path in fs.find(f"{root}/{name}"):  # the file, or every file below the folder
                local = self.dir / path[len(root):].lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(path, str(local))
        self._synced = {name: _stamp(f) for name, f in self._local_files().items()}

    def sync(self) -> list[str]:
        """Rewrites each staged file changed since the last sync as a whole object of OUT;
        returns their names (local OUT: nothing to do, [])."""
        if self.remote is None:
            return []
        written = []
        for name, f in self._local_files().items():
            stamp = _stamp(f)
            if self._synced.get(name) == stamp:
                continue
            with open(f, "rb") as src, (self.remote / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            self._synced[name] = stamp
            written.append(name)
        return written


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
