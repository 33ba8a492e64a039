"""trainer.compile_cache: XLA's persistent compilation cache, so a resumed run loads its programs."""

import jax
import jax.numpy as jnp

from jaxrl4llm.train.compile_cache import cache_dir, enable_compile_cache


def test_cache_folder_of_each_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXRL4LLM_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("off") is None and cache_dir(False) is None  # YAML reads `off` as false
    assert cache_dir(True) == cache_dir("auto")
    assert cache_dir("auto") == tmp_path / "xdg" / "jaxrl4llm" / "xla"
    monkeypatch.setenv("JAXRL4LLM_COMPILE_CACHE", str(tmp_path / "shared"))
    assert cache_dir("auto") == tmp_path / "shared"
    assert cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"


def test_a_second_process_loads_the_program_instead_of_compiling(tmp_path):
    """A program compiled once is written to the folder; with the in-memory caches cleared (what a
    new process starts with) the same program is a persistent-cache hit."""
    events = []
    listener = lambda name, **kw: events.append(name)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compile_cache(str(tmp_path)) == tmp_path
        f = lambda x: jnp.tanh(x @ x.T).sum() * 3.0  # noqa: E731
        jax.jit(f)(jnp.ones((17, 5))).block_until_ready()
        assert any(tmp_path.iterdir())
        jax.clear_caches()
        events.clear()
        jax.jit(f)(jnp.ones((17, 5))).block_until_ready()
        assert "/jax/compilation_cache/cache_hits" in events
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.monitoring.unregister_event_listener(listener)
