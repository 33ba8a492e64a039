"""The TPU ragged paged attention kernel compiles for v5p (XLA's TPU compiler, no chip) at every shipped
model's head shape, with the blocks `kernels/tpu_blocks.py` chooses: a shipped config's sampler program
compiles on its default topology where the kernel's own blocks overflowed a core's scoped VMEM
(Qwen3-0.6B and 1.7B: E1001 CompileTimeScopedVmemOom), and a shard with more slots than one call's page
table fits in SMEM runs them in several calls. The cheap part of planning every configs/models/*.yaml
(the whole plan of each takes minutes: docs/results/scaling.md has the run and its command)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm.kernels.tpu_blocks import TPU_SMEM, ragged_blocks, slots_per_call, smem_bytes
from jaxrl4llm.plan.compile_errors import classify, error_frames
from jaxrl4llm.plan.programs import plan_layout, topology_devices
from jaxrl4llm.sampling.paged_cache import kernel_paged_attention
from jaxrl4llm.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "configs" / "models").glob("*.yaml"))
SLOT_PAGES = 576  # a 9216-token slot (1024 prompt + 8192 response tokens) in 16-token pages


def device_heads() -> dict:
    """(kv heads, query heads a kv head, head_dim, dtype) a sampler device of each shipped config holds."""
    out = {}
    for path in MODELS:
        cfg = load_config([path], [])
        m, tp = cfg.model, cfg.rollout.tensor_parallel or 1
        out.setdefault((m.num_kv_heads // tp, m.num_heads // m.num_kv_heads, m.head_dim, m.dtype), []).append(path.stem)
    return out


def compile_kernel(kvh: int, group: int, head_dim: int, dtype: str, slots: int, pages: int = SLOT_PAGES,
                   block_sizes: dict | None = None, topology: str = "v5p:2x2x1"):
    """Compile one shard's kernel call (`kernel_paged_attention` on one chip of `topology`, `pages` a slot);
    its blocks by the rule unless `block_sizes` says."""
    device = topology_devices(topology)[0]
    mesh = Mesh(np.array([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    shape = lambda s, t: jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(mesh, P()))
    args = (shape((1, slots, kvh, group, head_dim), jnp.float32), shape((1, 1024, 16, 2 * kvh, head_dim), dtype),
            shape((1, slots, pages), jnp.int32), shape((1, slots), jnp.int32))
    attend = lambda *a: kernel_paged_attention(*a, mesh=mesh, batch_axes=("data",), block_sizes=block_sizes)
    with jax.set_mesh(mesh):
        return jax.jit(attend).lower(*args).compile()


@pytest.mark.parametrize("heads", sorted(device_heads()), ids=lambda h: "-".join(device_heads()[h]))
def test_the_kernel_compiles_for_v5p_at_every_shipped_head_shape(heads):
    kvh, group, head_dim, dtype = heads
    blocks, why = ragged_blocks("TPU v5", q_heads=kvh * group, kv_heads=kvh, head_dim=head_dim, page_size=16,
                                dtype=dtype)
    assert blocks is not None, why
    compiled = compile_kernel(kvh, group, head_dim, dtype, slots=64)
    assert compiled.memory_analysis() is not None


def test_the_kernels_own_blocks_do_not_compile_there_and_plan_says_vmem():
    """The bug, compiled: Qwen3-0.6B's heads on one v5p chip with the kernel's own 128 pages x 32 queries."""
    with pytest.raises(Exception) as e:  # noqa: B017, PT011 - XLA's JaxRuntimeError
        compile_kernel(8, 2, 128, "bfloat16", slots=64, block_sizes=dict(num_kv_pages_per_block=128,
                                                                          num_queries_per_block=32))
    failure = classify(f"{type(e.value).__name__}: {e.value}", "sampler/decode", error_frames(e.value))
    assert failure.kind == "vmem" and failure.limit == 16 * 2**20 and failure.needed > 16 * 2**20, failure


def test_more_slots_than_one_calls_page_table_compile_in_calls():
    """96 slots of 4096 pages (64k tokens): their page table (1.5 MiB) overflows a core's 1 MiB of SMEM in one
    call (XLA: "would exceed memory (size=1048576)"); in two calls of 48 it fits."""
    assert smem_bytes(96, 4096) > TPU_SMEM and slots_per_call(96, 4096) == 48
    compiled = compile_kernel(2, 4, 128, "bfloat16", slots=96, pages=4096)
    assert compiled.as_text().count("custom_call_target=\"tpu_custom_call\"") == 2


def test_every_shipped_config_on_its_topology_runs_the_kernel_with_blocks_that_fit():
    """The layout `plan` compiles (configs/models/*.yaml on mesh.topology): the TPU kernel, its blocks in the reason."""
    for path in MODELS:
        cfg = load_config([path], [])
        choice = plan_layout(cfg, cfg.mesh.topology).decode_attention
        assert choice.kernel == "tpu_ragged" and not choice.fallback, (path.stem, choice.reason)
        assert "KV pages x" in choice.reason and "scoped VMEM" in choice.reason, choice.reason
