"""One XLA persistent compilation cache for the whole test session, in a folder of its own.

Every `train()` builds its jitted programs anew (closures over its config), so tests that train
the same tiny model compile the same programs again and again; with the cache, a program compiled
once is loaded from disk after that, as a relaunched run's are (train/compile_cache.py). The
folder is new each session: nothing comes from ~/.cache or an earlier run. Only programs that
took a while to compile are written (the suite's thousands of tiny ones are quicker to compile
than to store). A test that points the cache at a folder of its own (trainer.compile_cache=PATH)
has it there; the next test is back in the session's. The plan tests go without: their programs
are compiled for TPU topologies with no chip, which XLA can write but not load back.

Compile speed (`./scripts/test`): every test but those marked `xla_default_opt` runs with
tests/subprocess_xla_flags.py's FAST_COMPILE in XLA_FLAGS (LLVM's cheapest code generation, and
on jaxlib 0.10 XLA's elemental fusion emitter): the suite is mostly compiling tiny programs, and
the flags change how XLA's float sums are vectorised, not what they compute (a float32 log-prob
moves by about one ulp). The tests marked `xla_default_opt` pin float bits or claim bit-equality
at the level users run, so scripts/test runs them in a second pytest process without the flags,
and here they fail when a flag is set.

The longest test files run first (HEAVY_FILES): `./scripts/test` hands whole files to its two
workers in collection order (--dist loadfile --no-loadscope-reorder), so a long file started
last would leave one worker running it alone at the end of the suite.
"""

import os
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from tests.subprocess_xla_flags import FAST_COMPILE, has_fast_compile

MIN_COMPILE_SECONDS = 0.2  # a program quicker to compile than this is not written
WITHOUT = ("plan",)  # tests/<folder>/ whose programs are not cached
# The slowest files, slowest first (seconds of one worker, `--durations=0` of the fast-compile pass on the
# 2-core CI machine with other work beside it, 2026-12-06): collected ahead of the rest so that the two
# workers start them first (longest processing time first: the suite ends with short files on both
# workers, not one worker on a long file).
HEAVY_FILES = (
    "train/test_demo.py",  # all `xla_default_opt` (the second pass's longest: the quick demo + 2 learning runs)
    "plan/test_plan.py",  # TPU compiles, ~320 s
    "train/test_multihost.py",  # a 1-process and a 2-process run + fault tests, ~150 s
    "test_gpu_check.py",  # every phase's dry run, ~160 s
    "test_notebooks.py",  # 5 notebooks, ~150 s
    "plan/test_meter.py",
    "sampling/test_continuous.py",
    "kernels/test_cpu_kernels.py",
    "sampling/test_generate.py",
    "plan/test_continuous_plan.py",
    "train/test_teacher.py",  # a teacher's runs, ~60 s
    "sampling/test_tool_rollout.py",  # parked tool rows against the oracle, ~30 s
    "train/test_layout.py",
    "train/test_async_rl.py",
    "train/test_programs.py",
    "models/test_transformer.py",
    "train/test_loop.py",  # also the second pass's exact-numerics run
)


def pytest_runtest_setup(item):
    """A test marked xla_default_opt fails, naming the fix, in a process whose XLA_FLAGS set the
    LLVM optimisation level: its pinned bits would not hold there."""
    flags = os.environ.get("XLA_FLAGS", "")
    if item.get_closest_marker("xla_default_opt") and has_fast_compile(flags):
        pytest.fail(f"{item.nodeid} is marked xla_default_opt: it pins float bits or claims bit-equality at XLA's "
                    f"default LLVM optimisation level, and this process has XLA_FLAGS={flags!r}. Run it without "
                    f"{FAST_COMPILE} (./scripts/test runs the marked tests in a second process, "
                    "`pytest -m xla_default_opt`).", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def session_compile_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xla_session")
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    reset_cache()
    yield folder
    for k, v in before.items():
        jax.config.update(k, v)
    reset_cache()


@pytest.fixture(autouse=True)
def _compile_cache_back_in_the_session_folder(request, session_compile_cache):
    """JAX opens its cache once, in the folder the config names at the first compile after a
    reset: after a test that pointed it elsewhere (its own folder, or `auto`'s ~/.cache), the next
    test's programs go to the session's folder again."""
    tests = Path(__file__).parent
    without = request.node.path.is_relative_to(tests) and request.node.path.relative_to(tests).parts[0] in WITHOUT
    if without:
        jax.config.update("jax_enable_compilation_cache", False)
        reset_cache()  # JAX checks the flag once per opening
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", str(session_compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        reset_cache()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """HEAVY_FILES first, in their order; every other test keeps its place (a stable sort)."""
    tests = Path(__file__).parent
    stale = [f for f in HEAVY_FILES if not (tests / f).is_file()]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py HEAVY_FILES names files that do not exist: {stale}; "
                                "remove or rename them there")
    rank = {tests / f: i for i, f in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(Path(item.path), len(HEAVY_FILES)))
