"""XLA's persistent compilation cache for a run: a `--resume`, a rerun or a second sweep cell
loads its programs from disk instead of compiling them again (minutes at Qwen3-8B size on a pod).

`trainer.compile_cache`: auto (default) = `$JAXRL4LLM_COMPILE_CACHE`, else
`$XDG_CACHE_HOME/jaxrl4llm/xla` (~/.cache/jaxrl4llm/xla); off = no cache; a path = that folder
(on a pod: a folder every host sees, e.g. on a shared disk, or each host's own local disk).
JAX keys each entry by the program, the compiler version and flags, and the devices, so a
changed config or jax version compiles anew and never loads a stale program.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from jaxrl4llm.storage import cache_root


def cache_dir(setting: str | bool) -> Path | None:
    """The cache folder of a `trainer.compile_cache` value (None: off; YAML reads `off` as false)."""
    if setting is False or setting in ("off", "", "none", "false"):
        return None
    if setting is not True and setting != "auto":
        return Path(setting).expanduser()
    if os.environ.get("JAXRL4LLM_COMPILE_CACHE"):
        return Path(os.environ["JAXRL4LLM_COMPILE_CACHE"]).expanduser()
    return cache_root() / "xla"


def enable_compile_cache(setting: str | bool) -> Path | None:
    """Points JAX's persistent compilation cache at `cache_dir(setting)`; every program is cached,
    however quick its compile (a run's dozens of small ones add up). Returns the folder.

    JAX opens its cache once per process, in the folder set at the first compile: a later run of
    the same process with another folder (a notebook's second run, the test suite) reopens it there."""
    folder = cache_dir(setting)
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(folder):
        reset_cache()  # reopened in `folder` at the next compile
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
