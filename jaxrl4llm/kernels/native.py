"""Build, cache and register the C++ kernels in `csrc/` as XLA FFI targets for the CPU platform.

    lib = <cache>/<hash of sources, flags, compiler, jaxlib>.so    built once by `c++`, then reused

The library is compiled for the machine it runs on (`-march=native` on x86-64) and registered
once per process. `load_kernels()` returns whether the kernels can be used; the environment
switch `JAXRL4LLM_CPU_KERNELS` (0 = off, 1 = required, unset = use them if they build) decides
what a failed build does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("decode_attention.cc", "exact.cc", "matmul.cc", "paged_attention.cc", "top_k.cc")
HEADERS = ("parallel.h", "vector_math.h")
TARGETS = ("jaxrl4llm_decode_attention", "jaxrl4llm_exact_apply_rope", "jaxrl4llm_exact_attention", "jaxrl4llm_exact_matmul",
           "jaxrl4llm_exact_rms_inverse", "jaxrl4llm_exact_rope_tables", "jaxrl4llm_exact_token_logprob", "jaxrl4llm_matmul", "jaxrl4llm_paged_attention", "jaxrl4llm_top_k")


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded (the message holds the compiler output)."""


def _mode() -> str:
    value = os.environ.get("JAXRL4LLM_CPU_KERNELS", "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"JAXRL4LLM_CPU_KERNELS={value!r}: use 0 (off), 1 (required) or leave it unset (auto)")


def compile_flags() -> list[str]:
    """C++ flags: optimised for this machine (AVX-512 registers where it has them).

    On x86-64, JAXRL4LLM_KERNEL_MARCH overrides `-march=native` (e.g. `x86-64-v3` for a library
    that also runs on AVX2-only CPUs; the tests use it to check the kernels' fallback paths).
    JAXRL4LLM_KERNEL_OPT overrides the optimisation level 3 (0-3): the results are the same at
    every level (ISO C++, no fast-math, no FMA contraction), -O1 builds in about half the time.
    """
    level = os.environ.get("JAXRL4LLM_KERNEL_OPT") or "3"
    if level not in ("0", "1", "2", "3"):
        raise KernelBuildError(f"JAXRL4LLM_KERNEL_OPT={level!r}: use 0, 1, 2 or 3 (the default)")
    flags = [f"-O{level}", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += [f"-march={os.environ.get('JAXRL4LLM_KERNEL_MARCH') or 'native'}", "-mprefer-vector-width=512"]
    return flags


def _cache_dir() -> Path:
    root = os.environ.get("JAXRL4LLM_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxrl4llm" / "kernels"


def _cpu_identity() -> str:
    """The CPU model and its instruction-set flags (Linux /proc/cpuinfo; else what platform says)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))


def library_path(compiler: str) -> Path:
    """Where the library built from the current sources with `compiler` lives."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    digest.update(" ".join([compiler] + compile_flags()).encode())
    digest.update(jaxlib.__version__.encode())
    digest.update(_cpu_identity().encode())  # -march=native: a shared cache never serves another CPU's build
    return _cache_dir() / f"jaxrl4llm_cpu_kernels_{digest.hexdigest()[:16]}.so"


def build(compiler: str | None = None) -> Path:
    """Compile the kernels (if not cached) and return the library path. Raises KernelBuildError."""
    compiler = compiler or os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on PATH (set CXX, or JAXRL4LLM_CPU_KERNELS=0)")
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build under a temporary name and rename: concurrent builders (pytest-xdist) never see half a file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [compiler, *compile_flags(), f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}",
               *(str(SOURCE_DIR / s) for s in SOURCES), "-o", partial]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"building the CPU kernels failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """Build + register once per process: (library, None) on success, else (None, why not)."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, name)), platform="cpu")
    except (KernelBuildError, OSError, AttributeError) as error:
        return None, str(error)
    return library, None


def bf16_pairs() -> bool:
    """Whether the loaded kernels take bf16 caches in the pair layout (built with AVX512-BF16)."""
    library, _ = _load()
    return library is not None and bool(library.jaxrl4llm_bf16_pairs())


def load_kernels() -> bool:
    """True if the CPU kernels are built and registered (building them on first call).

    JAXRL4LLM_CPU_KERNELS=0 -> False without building; =1 -> a failed build raises
    KernelBuildError; unset -> a failed build warns once and returns False.
    """
    mode = _mode()
    if mode == "off":
        return False
    _, problem = _load()
    if problem is None:
        return True
    if mode == "on":
        raise KernelBuildError(problem)
    _warn_once(problem)
    return False


def require_kernels() -> None:
    """Build and register the kernels, or raise KernelBuildError saying why they are unavailable."""
    if _mode() == "off":
        raise KernelBuildError("JAXRL4LLM_CPU_KERNELS=0 turns the CPU kernels off; unset it to use them")
    _, problem = _load()
    if problem is not None:
        raise KernelBuildError(problem)


@functools.lru_cache(maxsize=None)
def _warn_once(problem: str) -> None:
    warnings.warn(f"jaxrl4llm CPU kernels unavailable, the sampler uses its XLA path (slower on CPU): {problem}",
                  RuntimeWarning, stacklevel=3)
