"""Where a run's files live: a local path or a `gs://bucket/path` URL, behind one path type.

    run_path("runs/x")            -> pathlib.Path, absolute
    run_path("gs://bucket/runs/x") -> etils.epath.Path (gcsfs underneath: `pip install jaxrl4llm[gcs]`)

Both have the pathlib methods the run uses (`/`, exists, is_dir, iterdir, glob, mkdir,
read_text, write_text, rename, open). Orbax writes checkpoints to either directly (tensorstore's
own GCS driver); a gs:// step is complete when orbax has written its `commit_success.txt`
(GCS has no atomic rename, so orbax commits by that file there). What needs a local folder or
file (a Hugging Face model folder read by `tokenizers` and `safetensors`, a data file read by
`datasets`) is copied once into a local cache by `local_copy`. The files a run appends to are
staged locally and copied whole (train/run_files.py).

The GCS emulator (tests, CI): `STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT`, the variable
Google's own clients read, points gcsfs at it; `use_storage_emulator` passes it on to
tensorstore (TENSORSTORE_GCS_HTTP_URL) and turns off gcsfs's bucket-type probe (a gRPC call an
emulator does not serve), so that one variable points every layer at the emulator. It runs on
import of this module, before gcsfs or tensorstore read their settings.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

REMOTE_PREFIXES = ("gs://",)


def use_storage_emulator(env=os.environ) -> str | None:
    """When STORAGE_EMULATOR_HOST is set: TENSORSTORE_GCS_HTTP_URL to the same address (unless
    set) and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false. Returns the address (None when unset)."""
    host = env.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    if "://" not in host:
        host = env["STORAGE_EMULATOR_HOST"] = f"http://{host}"
    env.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    env.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return host


use_storage_emulator()


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is a gs:// URL."""
    return str(path).startswith(REMOTE_PREFIXES)


def run_path(path: str | os.PathLike) -> Any:
    """`path` as a path object: an absolute pathlib.Path, or an etils epath.Path for gs://."""
    if not is_remote(path):
        return Path(path).absolute()
    try:
        import gcsfs  # noqa: F401  (epath's gs:// backend)
    except ImportError as e:
        raise ValueError(f"{path}: gs:// paths need gcsfs: pip install 'jaxrl4llm[gcs]'") from e
    from etils import epath

    return epath.Path(str(path))


def as_path(path: str | os.PathLike) -> Any:
    """`path` as a path object as given: a pathlib.Path (a relative path stays relative, as the
    user wrote it in messages), or an etils epath.Path for gs://."""
    return run_path(path) if is_remote(path) else Path(path)


def remove(path: Any) -> None:
    """Deletes file or folder `path` (pathlib or epath), with everything below it."""
    if isinstance(path, Path):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    else:
        path.rmtree() if path.is_dir() else path.unlink()


def cache_root() -> Path:
    """jaxrl4llm's local cache folder, `$XDG_CACHE_HOME/jaxrl4llm` (default ~/.cache/jaxrl4llm): its
    gs:// copies (gcs/), staged run files (runs/) and XLA's compiled programs (xla/) live below."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxrl4llm"


def local_copy(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """A local copy of folder or file `path`: `path` itself when local; for gs://, a copy under
    `cache` (default `$XDG_CACHE_HOME/jaxrl4llm/gcs`, ~/.cache/jaxrl4llm/gcs) made once (files
    already there with the same size are kept). A gs:// path with nothing there gives a path
    that does not exist (the caller names the setting)."""
    if not is_remote(path):
        return Path(path)
    run_path(path)  # gcsfs installed, or the error that says how
    import fsspec

    fs, source = fsspec.core.url_to_fs(str(path).rstrip("/"))
    root = Path(cache) if cache else cache_root() / "gcs"
    target = root / str(path).split("://", 1)[1].rstrip("/")
    for name, info in fs.find(source, detail=True).items():  # every file below, in one listing
        local = target / name[len(source):].lstrip("/")
        if local.is_file() and local.stat().st_size == info["size"]:
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f"{local.name}.partial{os.getpid()}")  # processes sharing the cache
        fs.get_file(name, str(partial))
        partial.rename(local)
    return target


def upload_folder(local: str | os.PathLike, remote: str):
    """Copies the files of local folder `local` to `remote` (a gs:// folder); returns its path."""
    local, target = Path(local), run_path(remote)
    for item in sorted(local.rglob("*")):
        if item.is_file():
            dest = target / str(item.relative_to(local))
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(item, "rb") as src, dest.open("wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    return target
