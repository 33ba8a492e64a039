"""A Hugging Face cache that tests write themselves, as huggingface_hub lays it out, read offline.

    $HF_HOME/hub/models--org--name/
        blobs/<sha256 of the file>                 the files' bytes
        snapshots/<commit>/<path> -> ../../blobs/<sha256>
        refs/main                                   the commit

`offline_hub` points huggingface_hub (and datasets) at an empty HF_HOME under tmp_path with
HF_HUB_OFFLINE=1: both libraries read these variables once, at import, so their module-level
copies are patched too. Nothing reaches the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_repo(hf_home: Path, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model",
                   commit: str = COMMIT, ref: str = "main") -> Path:
    """Store `files` ({path in the repo: bytes}) as huggingface_hub's cache does; the snapshot folder."""
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder`."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME (returned) with HF_HUB_OFFLINE=1, for huggingface_hub and datasets."""
    import huggingface_hub.constants as hub_constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    import datasets.config as datasets_config

    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    return home
