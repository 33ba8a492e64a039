"""XLA_FLAGS for fast compiles: the in-process suite's (scripts/test: every test but those marked
`xla_default_opt`) and the test subprocesses' that compile programs of their own (the runs on
simulated CPU devices, tests/*/..._main.py, and the GPU check's dry run, tests/test_gpu_check.py).

The suite is mostly compiling tiny programs, so compile time is most of its time:
- `--xla_backend_optimization_level=0`: XLA's CPU backend skips LLVM's optimisation passes, a
  fifth to a quarter off such a process (tests/train/sharded_step_main.py, twice each way on the
  shared 2-core VM at load 7-9: 178 s -> 133 s, 253 s -> 205 s).
- `--xla_cpu_use_fusion_emitters=false` (jaxlib 0.10; later XLA has no other emitters and no flag:
  `fast_compile_flags`): fusions by XLA's elemental IR emitter instead of the MLIR fusion
  emitters. tests/train/test_step.py, one process, 2026-12-06: XLA's compile time 57.4 s -> 20.1 s
  (JAX_LOG_COMPILES=1, summed), the file 74 s -> 37 s.
- `--xla_cpu_parallel_codegen_split_count=1`: LLVM compiles each program as one module instead of
  splitting it into parts for a thread pool (for the suite's tiny programs the split costs more
  than it saves on 2 cores). tests/train/test_loop.py + tests/sampling/test_generate.py, one
  process, A B A B on the 2-core VM with other work beside it, 2026-12-06: 80.0 and 82.9 CPU-s with
  it, 94.3 and 102.4 without (-15 to -19%); it changes how code is split, not what it computes.
The first two change how float sums are vectorised and rounded (a float32 log-prob moves by about one ulp),
not what they compute. Each test run under them compares programs made under the same flags (8
devices against 1, two processes against one, packed rows against padded) or checks against a
tolerance, never a pinned figure; the tests that pin float bits or claim bit-equality at the level
users run are marked `xla_default_opt` and run without them (tests/conftest.py).

This module imports no JAX (subprocess launchers read it before any backend starts).
"""

from importlib import metadata

OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
CODEGEN_SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count"
FAST_COMPILE_PREFIXES = (OPT_LEVEL_FLAG, FUSION_EMITTERS_FLAG, CODEGEN_SPLIT_FLAG)


def _jaxlib_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return (0, 0)


def fast_compile_flags() -> str:
    """The fast-compile flags this jaxlib knows (an unknown flag in XLA_FLAGS is a fatal error):
    the emitters flag on jaxlib 0.10 (jaxlib 0.12 rejects it)."""
    flags = [f"{OPT_LEVEL_FLAG}=0", f"{CODEGEN_SPLIT_FLAG}=1"]
    if _jaxlib_version() < (0, 11):
        flags.append(f"{FUSION_EMITTERS_FLAG}=false")
    return " ".join(flags)


FAST_COMPILE = fast_compile_flags()


def without_fast_compile(flags: str) -> str:
    """XLA_FLAGS `flags` less the fast-compile ones (a process that must compile as users do)."""
    return " ".join(f for f in flags.split() if not f.startswith(FAST_COMPILE_PREFIXES))


def has_fast_compile(flags: str) -> bool:
    return any(f.startswith(FAST_COMPILE_PREFIXES) for f in flags.split())


def xla_flags(devices: int, inherited: str = "") -> str:
    """`inherited` (the caller's XLA_FLAGS) + `devices` simulated CPU devices + FAST_COMPILE."""
    return f"{inherited} --xla_force_host_platform_device_count={devices} {FAST_COMPILE}".strip()


if __name__ == "__main__":  # scripts/test: XLA_FLAGS="$XLA_FLAGS $(python -m tests.subprocess_xla_flags)"
    print(FAST_COMPILE)
