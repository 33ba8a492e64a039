"""What one accelerator chip can do, for the meter: HBM bytes, peak dense bf16 FLOP/s, HBM and
interconnect bandwidth (public spec sheets), and the devices of a named topology to compile for."""

from __future__ import annotations

import os
import time
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling.memory import SIZING_SHARE
from jaxrl4llm.train.config import ConfigError

GiB = 2**30
# The share of the memory JAX's allocator may hand out that a program may fill by plan's fit check
# (the headroom left for fragmentation and what XLA allocates beside the program); the sampler's
# automatic sizing fills `sampling.memory.SIZING_SHARE` of it.
FIT_SHARE = 0.9
# JAX's GPU allocator preallocates this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION
# says otherwise (jax's docs, "GPU memory allocation").
JAX_GPU_MEM_FRACTION = 0.75


class ChipSpec(NamedTuple):
    """One chip: `hbm` bytes (as XLA reports it in RESOURCE_EXHAUSTED messages for v5p),
    `peak_flops` dense bf16 FLOP/s, `hbm_bandwidth` bytes/s, `ici_bandwidth` bytes/s a chip moves
    over its interconnect in one direction for collectives (TPU ICI links, GPU NVLink);
    `overlap`: compute and memory traffic overlap (TPU, GPU: a program takes the larger of the
    two) or add up (a CPU running XLA's ops one after another); `memory_fraction`: the share of
    `hbm` that JAX's allocator hands a process (`jax_memory_fraction`); `peak_source`: where
    `peak_flops` and `hbm_bandwidth` come from ("datasheet", "measured on <device>", "given");
    `kernel_seconds`: what each kernel launch adds to a program's time (a GPU's host launches every
    top-level op of the program as a kernel, `plan.hlo_cost.kernel_launches`; 0 where the program
    runs on the chip whole, as on a TPU, or where the CPU model's measured peaks already hold it)."""

    hbm: float
    peak_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    overlap: bool = True
    memory_fraction: float = 1.0
    peak_source: str = "datasheet"
    kernel_seconds: float = 0.0

    @property
    def usable_bytes(self) -> float:
        """What JAX's allocator can hand one process of this chip: hbm x memory_fraction."""
        return self.hbm * self.memory_fraction

    @property
    def fit_bytes(self) -> float:
        """The most a program (with the state beside it) may hold by plan's fit check: FIT_SHARE of `usable_bytes`."""
        return FIT_SHARE * self.usable_bytes

    @property
    def sizing_bytes(self) -> float:
        """What the sampler's automatic sizing fills: SIZING_SHARE of `usable_bytes` (as the loop does of
        the device's `bytes_limit`, which is the allocator's share of the chip)."""
        return SIZING_SHARE * self.usable_bytes


def jax_memory_fraction(platform: str, environ: Mapping[str, str] = os.environ) -> float:
    """The share of a chip's memory JAX's allocator hands a process on `platform` ("gpu", "tpu", "cpu").

    GPU: XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75, `JAX_GPU_MEM_FRACTION`), the BFC allocator's
    limit whether it preallocates or not; 1.0 with XLA_PYTHON_CLIENT_ALLOCATOR=platform (no pool).
    TPU and CPU: 1.0 (the TPU runtime's `bytes_limit` is the chip's HBM).
    """
    if platform not in ("gpu", "cuda", "rocm"):
        return 1.0
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0
    text = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if not text:
        return JAX_GPU_MEM_FRACTION
    try:
        fraction = float(text)
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number; set it to a share of "
                          f"the GPU's memory in (0, 1], e.g. 0.9") from None
    if not 0 < fraction <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be in (0, 1]")
    return fraction


# ICI: per-chip one-direction bandwidth summed over links (v4 6 x 45 GB/s... as Google's pages give
# it per chip: v4 270, v5e 200 (4 links x 50), v5p 600 (6 x 100), v6e 448 (4 x 112) GB/s per direction).
TPU_CHIPS = {
    "v4": ChipSpec(32 * GiB, 275e12, 1.2e12, 270e9),
    "v5e": ChipSpec(16 * GiB, 197e12, 0.82e12, 200e9),
    "v5p": ChipSpec(95.74 * GiB, 459e12, 2.76e12, 600e9),
    "v6e": ChipSpec(32 * GiB, 918e12, 1.64e12, 448e9),
}


def tpu_chip_spec(topology: str) -> ChipSpec:
    generation = topology.split(":")[0].lower()
    if generation not in TPU_CHIPS:
        raise ConfigError(f"--topology {topology!r}: unknown TPU generation {generation!r}; "
                          f"known: {', '.join(TPU_CHIPS)} (e.g. v5p:4x4x4, v5e:2x2)")
    return TPU_CHIPS[generation]


def _best_seconds(f, *args, reps: int = 5) -> float:
    """The fastest of `reps` timed calls of f(*args), after one untimed call (the compile)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(device=None, sizes: tuple[int, ...] = (1024, 2048), reps: int = 5) -> float:
    """`device`'s best bf16 x bf16 -> f32 matmul FLOP/s over square sizes (2 n^3 / seconds), measured
    now on random operands (the model's matmul form). Default device: the first CPU."""
    device = device or jax.devices("cpu")[0]
    matmul = jax.jit(lambda x, y: jnp.einsum("ij,jk->ik", x, y, preferred_element_type=jnp.float32))
    best = 0.0
    for n in sizes:
        x, y = (jax.device_put(jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16), device) for i in (0, 1))
        best = max(best, 2 * n**3 / _best_seconds(matmul, x, y, reps=reps))
    return best


def copy_bandwidth(device=None, mib: int = 256, reps: int = 5) -> float:
    """`device`'s memory bandwidth, bytes read + written per second by an elementwise pass over a
    `mib` MiB float32 array (y = x + 1: one read and one write of every element), measured now."""
    device = device or jax.devices("cpu")[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (mib * 2**20 // 4,), jnp.float32), device)
    return 2 * x.nbytes / _best_seconds(jax.jit(lambda a: a + 1), x, reps=reps)


def read_bandwidth(device=None, mib: int = 256, reps: int = 5) -> float:
    """`device`'s memory read bandwidth, bytes read per second by a bfloat16 sum over a `mib` MiB array
    (one read of every element, a scalar written), measured now: a decode step's traffic, which reads
    the weights and the live KV and writes little (`copy_bandwidth` reads and writes alike)."""
    device = device or jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones((mib * 2**20 // 2,), jnp.bfloat16), device)
    return x.nbytes / _best_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, reps=reps)


def cpu_matmul_peak(sizes: tuple[int, ...] = (1024, 2048), reps: int = 5) -> float:
    """This CPU's best bf16 x bf16 -> f32 matmul FLOP/s over square sizes, measured now
    (`matmul_peak` on the first CPU device; benchmarks/train_step.py's MFU divides by it too)."""
    return matmul_peak(None, sizes, reps)


def measured_peaks(chip: ChipSpec, device=None) -> ChipSpec:
    """`chip` priced at `device`'s measured bf16 matmul rate and copy bandwidth (`plan --peak measured`:
    a GPU or TPU host measuring itself). Default device: `jax.devices()[0]`, the host's accelerator
    when it has one. Sizes large enough to fill a GPU (8192^2 matmuls, a 1 GiB copy); smaller on a CPU."""
    device = device or jax.devices()[0]
    small = device.platform == "cpu"
    peak = matmul_peak(device, (1024, 2048) if small else (4096, 8192))
    bandwidth = copy_bandwidth(device, 256 if small else 1024)
    return chip._replace(peak_flops=float(peak), hbm_bandwidth=float(bandwidth),
                         peak_source=f"measured on {device.device_kind}")


def measure_cpu_chip(*, matmul_sizes: tuple[int, ...] = (1024, 2048), copy_mib: int = 256, reps: int = 5) -> ChipSpec:
    """This machine's CPU as the meter's chip, measured now (the machine is noisy: measure in the
    same run as what is predicted). peak_flops: `cpu_matmul_peak` (at the 48M model's own matmul
    shapes the rate is the same within 15%); hbm_bandwidth: bytes read + written per second by a
    copy of a `copy_mib` MiB array (main memory, past the caches); hbm: the machine's memory.
    Compute and memory time add up on a CPU (`overlap=False`): XLA:CPU runs one op at a time,
    each bound by one or the other."""
    peak = cpu_matmul_peak(matmul_sizes, reps)
    source = np.ones(copy_mib * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    bandwidth = 2 * source.nbytes / _best_seconds(lambda: np.copyto(target, source), reps=reps)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ChipSpec(float(memory), float(peak), float(bandwidth), float("inf"), overlap=False,
                    peak_source="measured on this CPU")
