"""Where a named model or dataset lives on this machine: a local folder, a gs:// copy, or a
Hugging Face Hub repository in huggingface_hub's cache.

    resolve_model("Qwen/Qwen3-4B-Base")        -> $HF_HOME/hub/models--Qwen--Qwen3-4B-Base/snapshots/<sha>
    resolve_model("Qwen/Qwen3-4B-Base@main")   -> the same, at a revision (branch, tag or commit)
    resolve_model("/data/Qwen3-4B-Base")       -> that folder; gs://... -> its local copy (storage.local_copy)
    resolve_dataset_repo("openai/gsm8k")       -> $HF_HOME/hub/datasets--openai--gsm8k/snapshots/<sha>

A local path that exists always wins over a Hub id of the same spelling. A Hub repository is
fetched with `huggingface_hub.snapshot_download`, only the files a run reads (`MODEL_FILES`,
`TOKENIZER_FILES`, `DATASET_FILES`); huggingface_hub itself honours HF_HOME / HF_HUB_CACHE (where),
HF_TOKEN (gated or private repositories) and HF_HUB_OFFLINE=1 (the cache only, no network).
Offline with the files absent: a HubFilesMissing error that names the one `hf download` command
that fetches them. With several processes (jax.process_count() > 1), process 0 downloads while
the others wait at a barrier, then read the cache (local_files_only), so N processes never write
the same files into one shared cache at once (a host whose own cache lacks them downloads there).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl4llm.storage import is_remote, local_copy

# What a run reads of a model repository: config.json, generation_config.json, the tokenizer
# (tokenizer.json / tokenizer_config.json / special_tokens_map.json / vocab.json + merges.txt /
# tokenizer.model / chat_template.jinja) and the weights (*.safetensors + model.safetensors.index.json).
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")
# The tokenizer alone (read before the weights, so a bad name fails in seconds): the same, no weights.
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.txt", "*.jinja")
# A dataset repository's data files in the formats `datasets` reads, and its card (README.md
# names its configs).
DATASET_FILES = ("README.md", "*.parquet", "*.jsonl", "*.json", "*.jsonl.gz", "*.json.gz", "*.csv", "*.arrow")

# org/name[@revision]: two path parts of letters, digits, - _ . (the Hub's repo-id characters)
_HUB_ID_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


class HubFilesMissing(FileNotFoundError):
    """A Hub repository's files are neither on this machine nor reachable (offline, no network,
    or no such repository); the message names the command that fetches them."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) when `spec` is spelled as a Hub id (`org/name[@revision]`),
    else None (an absolute or ./ path, a gs:// URL, three or more path parts, ...)."""
    match = _HUB_ID_RE.match(str(spec))
    if match is None or str(spec).startswith((".", "~")):
        return None
    return match["repo"], match["revision"]


def download_command(repo_id: str, *, revision: str | None = None, repo_type: str = "model",
                     files: tuple[str, ...] = MODEL_FILES) -> str:
    """The `hf download` command (huggingface_hub's CLI) that fetches what `resolve_*` reads."""
    words = ["hf", "download", repo_id]
    if repo_type != "model":
        words += ["--repo-type", repo_type]
    if revision:
        words += ["--revision", revision]
    for pattern in files:
        words += ["--include", pattern]
    return shlex.join(words)


def _snapshot(repo_id: str, revision: str | None, repo_type: str, files: tuple[str, ...],
              local_files_only: bool) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    command = download_command(repo_id, revision=revision, repo_type=repo_type, files=files)
    where = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=list(files),
                                      local_files_only=local_files_only))
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        raise HubFilesMissing(
            f"the {repo_type} {repo_id!r}{f' at revision {revision!r}' if revision else ''} is not in the Hugging Face "
            f"cache ({where}) and cannot be downloaded now ({str(e).split('.')[0]}). Fetch it on a machine with "
            f"network access (HF_HUB_OFFLINE unset; the same HF_HOME) with: {command}") from None
    except HfHubHTTPError as e:  # no such repository, gated without HF_TOKEN, bad revision
        raise HubFilesMissing(
            f"the Hugging Face Hub gave no {repo_type} {repo_id!r}{f' at revision {revision!r}' if revision else ''}: "
            f"{str(e).splitlines()[0]}. Check the name (org/name[@revision]); a gated or private repository needs "
            f"HF_TOKEN; or fetch it with: {command}") from None


def resolve_hub_repo(repo_id: str, *, revision: str | None = None, repo_type: str = "model",
                     files: tuple[str, ...] = MODEL_FILES) -> Path:
    """The local snapshot folder of a Hub repository, downloaded (only `files`) when absent.

    Several processes: process 0 resolves (downloads) first while the others wait; its outcome is
    broadcast (`multihost_utils.broadcast_one_to_all`, a barrier), so a failure there is raised on
    every process, never left as a hang. The others then read the cache (`local_files_only`: a
    shared HF_HOME now holds the files, nobody writes them twice); a host whose cache lacks them
    (its own disk) downloads them itself, alone in that cache.
    """
    if jax.process_count() == 1:
        return _snapshot(repo_id, revision, repo_type, files, local_files_only=False)
    error, path = None, None
    if jax.process_index() == 0:
        try:
            path = _snapshot(repo_id, revision, repo_type, files, local_files_only=False)
        except Exception as e:  # noqa: BLE001 - raised after the broadcast, so no process waits forever
            error = e
    fetched = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if error is not None:
        raise error
    if not fetched:
        command = download_command(repo_id, revision=revision, repo_type=repo_type, files=files)
        raise HubFilesMissing(f"process 0 could not fetch the {repo_type} {repo_id!r} (its log has the error); "
                              f"fetch it with: {command}")
    if path is not None:
        return path
    try:
        return _snapshot(repo_id, revision, repo_type, files, local_files_only=True)
    except HubFilesMissing:  # this host's own cache: download here
        return _snapshot(repo_id, revision, repo_type, files, local_files_only=False)


def resolve_model(spec: str | os.PathLike, *, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """A model (or tokenizer) folder on this machine: `spec` itself when it exists locally, the local
    copy of a gs:// folder, else the Hub snapshot of `org/name[@revision]` (only `files`).

    A path that is neither (a local folder that does not exist, not spelled as a Hub id) comes
    back as it is: the caller says what is missing. Raises HubFilesMissing (a FileNotFoundError)
    when a Hub id cannot be resolved, naming the `hf download` command that fetches it.
    """
    if is_remote(spec):
        return local_copy(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    hub = parse_hub_id(str(spec))
    if hub is None:
        return path
    repo_id, revision = hub
    try:
        return resolve_hub_repo(repo_id, revision=revision, repo_type="model", files=files)
    except HubFilesMissing as e:
        raise HubFilesMissing(f"{spec!r} is no local folder ({path.absolute()} does not exist), and {e}") from None


def resolve_dataset_repo(repo_id: str, *, revision: str | None = None) -> Path:
    """The local snapshot folder of Hub dataset `repo_id` (its `DATASET_FILES`), downloaded when absent."""
    return resolve_hub_repo(repo_id, revision=revision, repo_type="dataset", files=DATASET_FILES)
