"""What one accelerator chip can do, for the meter: HBM bytes, peak dense bf16 FLOP/s, HBM and
interconnect bandwidth (public spec sheets), and the devices of a named topology to compile for."""

from __future__ import annotations

from typing import NamedTuple

from jaxrl4llm.train.config import ConfigError

GiB = 2**30


class ChipSpec(NamedTuple):
    """One chip: `hbm` bytes (as XLA reports it in RESOURCE_EXHAUSTED messages for v5p),
    `peak_flops` dense bf16 FLOP/s, `hbm_bandwidth` bytes/s, `ici_bandwidth` bytes/s a chip moves
    over its interconnect in one direction for collectives (TPU ICI links, GPU NVLink);
    `overlap`: compute and memory traffic overlap (TPU, GPU: a program takes the larger of the
    two) or add up (a CPU running XLA's ops one after another)."""

    hbm: float
    peak_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    overlap: bool = True


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
    import time

    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_matmul_peak(sizes: tuple[int, ...] = (1024, 2048), reps: int = 5) -> float:
    """This CPU's best bf16 x bf16 -> f32 matmul FLOP/s over square sizes, measured now (the
    model's matmul form; benchmarks/train_step.py's MFU divides by it too)."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    matmul = jax.jit(lambda x, y: jnp.einsum("ij,jk->ik", x, y, preferred_element_type=jnp.float32))
    return max(2 * n**3 / _best_seconds(matmul, *(jax.device_put(jnp.ones((n, n), jnp.bfloat16), cpu),) * 2,
                                        reps=reps) for n in sizes)


def measure_cpu_chip(*, matmul_sizes: tuple[int, ...] = (1024, 2048), copy_mib: int = 256, reps: int = 5) -> ChipSpec:
    """This machine's CPU as the meter's chip, measured now (the machine is noisy: measure in the
    same run as what is predicted). peak_flops: `cpu_matmul_peak` (at the 48M model's own matmul
    shapes the rate is the same within 15%); hbm_bandwidth: bytes read + written per second by a
    copy of a `copy_mib` MiB array (main memory, past the caches); hbm: the machine's memory.
    Compute and memory time add up on a CPU (`overlap=False`): XLA:CPU runs one op at a time,
    each bound by one or the other."""
    import os

    import numpy as np

    peak = cpu_matmul_peak(matmul_sizes, reps)
    source = np.ones(copy_mib * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    bandwidth = 2 * source.nbytes / _best_seconds(lambda: np.copyto(target, source), reps=reps)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ChipSpec(float(memory), float(peak), float(bandwidth), float("inf"), overlap=False)
