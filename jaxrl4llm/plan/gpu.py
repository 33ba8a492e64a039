"""NVIDIA GPUs for `jaxrl4llm plan`: what one GPU can do, and the devices of a named GPU topology
for XLA's CUDA compiler to compile for on this CPU, with no GPU present (`pip install -e .[gpu]`).

    jaxrl4llm plan ... --topology h100:8      # one host of 8 H100s
    jaxrl4llm plan ... --topology h100:2x8    # 2 hosts x 8 H100s

XLA's CUDA plugin (jax-cuda12-plugin + jax-cuda12-pjrt, or the CUDA 13 build: jax-cuda13-plugin +
jax-cuda13-pjrt, `pip install -e .[gpu13]`; whichever is installed at jaxlib's version,
`cuda_plugin`) builds its devices from a description of the GPU (a `GpuTargetConfigProto`, shipped
here as `gpu_targets/<gpu>.txtpb`, from openxla/xla) instead of asking a driver, and compiles
through ptxas (nvidia-cuda-nvcc-cu12, or nvidia-cuda-nvcc for CUDA 13):
`topologies.get_topology_desc(platform="cuda", target_config=<text>, topology="1x<hosts>x<gpus>")`.
What a program compiled this way tells (jax 0.10.2, measured):
- `memory_analysis()` per GPU. XLA does not refuse a program larger than the GPU's memory (it
  logs "exceeds the base limit" and compiles), so plan compares the bytes with `ChipSpec.hbm`.
- `cost_analysis()` is None: count FLOPs and bytes from the optimized HLO, `as_text()`.
- No autotuning without a GPU (default Triton GEMM configs): temporaries may differ a little
  from a compile on a real GPU.
- A large sort (a mixture of experts' sort of its tokens by expert) compiles to CUB's radix sort,
  whose scratch XLA sizes by loading the CUDA runtime: with none here the compile fails ("Error
  loading CUDA libraries"). `GPU_COMPILE_OPTIONS` compiles XLA's own sort instead (the same
  program otherwise; a sort is a small part of a step).
The devices come host-major (ids 0-7 on host 0, 8-15 on host 1), so a mesh made by reshaping
them row-major keeps its innermost axes (tensor, then fsdp) inside a host's NVLink domain.
"""

from __future__ import annotations

import os
import re
import shutil
from importlib import metadata, resources
from importlib.util import find_spec

import jax
from jax.experimental import topologies

from jaxrl4llm.plan.chips import ChipSpec
from jaxrl4llm.train.config import ConfigError

# hbm: the GPU's memory as CUDA reports it (`device_memory_size` of its gpu_targets file; an
# "80 GB" H100 is 79.1 GiB). A JAX process takes 75% of it by default: run on GPUs with
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 to use what plan counts on. peak_flops: dense bf16 tensor
# core FLOP/s; ici_bandwidth: NVLink bytes/s per direction per GPU (half the bidirectional
# figure NVIDIA quotes). Sources: NVIDIA's H100 SXM, H200 SXM and A100 80 GB SXM datasheets; the
# HGX B200 datasheet (1000 W: 2.25 PFLOP/s dense bf16 of 4.5 sparse, 8 TB/s HBM3e, NVLink 5 at
# 1.8 TB/s bidirectional), as of 2026-11.
# What each kernel adds to a program's time on a GPU beyond its HBM and compute time
# (`ChipSpec.kernel_seconds`), from one H100 80GB HBM3 with jax 0.11.2 (scripts/gpu_check, docs/gpu.md
# "Results"): under jax.profiler (2026-11-28) the Qwen3-0.6B rollout's GPU was busy 3.861 s of its
# 3.873 s, 1.807 s of it in the KV-cache scatters (then system-scope atomic compare-and-swaps,
# since written as plain stores: `sampling.paged_cache.write_tokens`); the other kernels took 2.054 s
# where the meter's HBM traffic predicts 1.867 s: 0.187 s over its 349887 kernels
# (`kernel_launches`, trips counted) = 0.54 us each (small kernels' floor; the host's launches hid
# behind them, CUDA graphs, 1006 launch calls). Fitted on that rollout alone; the same figure is
# assumed for the other GPUs (unmeasured). (The 5.70 us of 2026-11-27 was fitted to the whole gap,
# scatters included.)
GPU_KERNEL_SECONDS = 0.54e-6
GPU_CHIPS: dict[str, ChipSpec] = {
    "h100": ChipSpec(84942979072, 989e12, 3.35e12, 450e9, kernel_seconds=GPU_KERNEL_SECONDS),
    "h200": ChipSpec(151397597184, 989e12, 4.8e12, 450e9, kernel_seconds=GPU_KERNEL_SECONDS),
    "a100": ChipSpec(85100068864, 312e12, 2.039e12, 300e9, kernel_seconds=GPU_KERNEL_SECONDS),
    "b200": ChipSpec(191514411008, 2.25e15, 8.0e12, 900e9, kernel_seconds=GPU_KERNEL_SECONDS),
}

_TOPOLOGY = re.compile(r"(?P<gpu>[a-z0-9]+):(?:(?P<hosts>\d+)x)?(?P<per_host>\d+)")
# XLA's CUDA plugins, in order of preference: (module, pip package, its PJRT package).
CUDA_PLUGINS = (("jax_plugins.xla_cuda12", "jax-cuda12-plugin", "jax-cuda12-pjrt"),
                ("jax_plugins.xla_cuda13", "jax-cuda13-plugin", "jax-cuda13-pjrt"))
# Where ptxas comes from: the CUDA 12 wheel (nvidia/cuda_nvcc/bin) or the CUDA 13 one (nvidia/cu13/bin).
_NVCC_MODULES = ("nvidia.cuda_nvcc", "nvidia.cu13")
_INSTALL = ("install XLA's CUDA compiler with `pip install -e .[gpu]` (CUDA 12, about 210 MB; no GPU needed) "
            "or `pip install -e .[gpu13]` (CUDA 13)")


def _find(module: str):
    try:
        return find_spec(module)
    except ModuleNotFoundError:  # not even the parent namespace (jax_plugins, nvidia)
        return None


def cuda_plugin() -> tuple[str, str, str] | None:
    """The (module, pip package, PJRT package) of `CUDA_PLUGINS` to compile with: an installed one
    at jaxlib's version (CUDA 12 first), else the first installed one (`gpu_topology_devices`
    then names the version mismatch), else None."""
    installed = [p for p in CUDA_PLUGINS if _find(p[0]) is not None]
    jaxlib_version = metadata.version("jaxlib")

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return next((p for p in installed if version(p[1]) == jaxlib_version), installed[0] if installed else None)


# compiler options of every program compiled for a GPU topology on this CPU (module docstring)
GPU_COMPILE_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def compile_options(devices) -> dict | None:
    """The compiler options `plan` compiles a program for `devices` with: `GPU_COMPILE_OPTIONS` on
    GPU devices, else None (XLA's defaults)."""
    return dict(GPU_COMPILE_OPTIONS) if next(iter(devices)).platform in ("gpu", "cuda") else None


def is_gpu_topology(topology: str) -> bool:
    """Whether `topology` names one of `GPU_CHIPS` ("h100:8"); TPU names ("v5p:4x4x4") are not."""
    return topology.split(":")[0].lower() in GPU_CHIPS


def parse_gpu_topology(topology: str) -> tuple[str, int, int]:
    """(gpu, hosts, gpus per host) of "h100:8" (1 host) or "h100:2x8" (2 hosts x 8 GPUs)."""
    gpu = topology.split(":")[0].lower()
    if gpu not in GPU_CHIPS:
        raise ConfigError(f"--topology {topology!r}: unknown GPU {gpu!r}; known: {', '.join(GPU_CHIPS)} "
                          f"(e.g. h100:8, h100:2x8)")
    match = _TOPOLOGY.fullmatch(topology.lower())
    if not match or int(match["per_host"]) < 1 or int(match["hosts"] or 1) < 1:
        raise ConfigError(f"--topology {topology!r}: a GPU topology is <gpu>:<gpus per host> or "
                          f"<gpu>:<hosts>x<gpus per host>, e.g. {gpu}:8 (one host) or {gpu}:2x8 (2 hosts x 8 GPUs)")
    return gpu, int(match["hosts"] or 1), int(match["per_host"])


def gpu_chip_spec(topology: str) -> ChipSpec:
    """The ChipSpec of one GPU of `topology` ("h100:2x8" -> GPU_CHIPS["h100"])."""
    return GPU_CHIPS[parse_gpu_topology(topology)[0]]


def gpu_target_config(gpu: str) -> str:
    """The GpuTargetConfigProto text of `gpu` (a key of GPU_CHIPS), from gpu_targets/."""
    return (resources.files("jaxrl4llm.plan") / "gpu_targets" / f"{gpu}.txtpb").read_text()


def missing_gpu_packages() -> list[str]:
    """The pip packages of the `gpu` (or `gpu13`) extra that are missing: a CUDA plugin (either
    CUDA_PLUGINS entry), and ptxas (from nvidia-cuda-nvcc-cu12 or nvidia-cuda-nvcc, or a CUDA
    toolkit where XLA looks for one)."""
    missing = []
    if cuda_plugin() is None:
        missing.append(" + ".join(CUDA_PLUGINS[0][1:]) + " (or " + " + ".join(CUDA_PLUGINS[1][1:]) + ")")
    nvcc_dirs = [d for m in _NVCC_MODULES if (spec := _find(m)) for d in (spec.submodule_search_locations or [])]
    roots = [*nvcc_dirs, os.environ.get("CUDA_ROOT"), "/usr/local/cuda", "/opt/cuda"]
    if not (shutil.which("ptxas") or "xla_gpu_cuda_data_dir" in os.environ.get("XLA_FLAGS", "")
            or any(r and os.path.exists(os.path.join(r, "bin", "ptxas")) for r in roots)):
        missing.append("nvidia-cuda-nvcc-cu12 or nvidia-cuda-nvcc (ptxas)")
    return missing


def gpu_topology_devices(topology: str) -> list[jax.Device]:
    """The devices of a named GPU topology ("h100:8", "h100:2x8"), host-major, to compile for
    with no GPU present (module docstring). Errors say what to install or how to name it."""
    gpu, hosts, per_host = parse_gpu_topology(topology)
    if missing := missing_gpu_packages():
        raise ConfigError(f"--topology {topology!r} needs XLA's CUDA compiler, but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not installed: {_INSTALL}.")
    _, dist, _ = cuda_plugin()
    plugin_version, jaxlib_version = metadata.version(dist), metadata.version("jaxlib")
    if plugin_version != jaxlib_version:
        extra = "gpu13" if dist == CUDA_PLUGINS[1][1] else "gpu"
        raise ConfigError(f"--topology {topology!r}: {dist} {plugin_version} does not match jaxlib "
                          f"{jaxlib_version}; reinstall with `pip install -e .[{extra}]`.")
    try:
        return list(topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(gpu),
                                                 topology=f"1x{hosts}x{per_host}").devices)
    except Exception as e:  # noqa: BLE001 - the plugin failed to load, or rejected the target file
        raise ConfigError(f"cannot build GPU topology {topology!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          f"{_INSTALL}, at jax's version.") from None
