"""Native CPU kernels for the sampler's decode step, called from JAX through XLA's FFI.

XLA:CPU runs decode-sized matmuls (M = 64 rows) at ~60% of the machine's bf16 peak, decode
attention (one query per row against a small per-row KV cache) as many tiny batched matmuls,
paged attention as gathers of every live page into a copy (its pool write as long as a pool copy),
and TopK as a serial per-row sort; these kernels do the same math in C++ (docs/sampling.md
has the measurements). They are compiled from `csrc/` with the machine's
C++ compiler on first use and cached; on other platforms, or when they cannot be built, the
sampler runs its XLA formulation, which tests hold the kernels to.

    JAXRL4LLM_CPU_KERNELS=0   never use them      (=1: require them: a build failure is an error)
    JAXRL4LLM_KERNEL_CACHE    where the built library goes (default ~/.cache/jaxrl4llm/kernels)
    JAXRL4LLM_KERNEL_MARCH    x86-64 target instead of -march=native (e.g. x86-64-v3)
    JAXRL4LLM_KERNEL_OPT      the compiler's optimisation level (default 3; 1 builds in half the
                              time, the same results, slower kernels: for checks, not for runs)
    CXX                       the compiler (default c++)
"""

from jaxrl4llm.kernels.decode_attention import decode_attention
from jaxrl4llm.kernels.matmul import matmul, pack_weight
from jaxrl4llm.kernels.native import KernelBuildError, bf16_pairs, load_kernels, require_kernels
from jaxrl4llm.kernels.paged_attention import paged_attention
from jaxrl4llm.kernels.top_k import top_k

__all__ = ["KernelBuildError", "bf16_pairs", "decode_attention", "load_kernels", "matmul", "pack_weight",
           "paged_attention", "require_kernels", "top_k"]
