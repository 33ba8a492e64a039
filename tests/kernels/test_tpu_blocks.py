"""kernels/tpu_blocks.py: the TPU ragged paged attention kernel's blocks fit a core's scoped VMEM and
its page table SMEM, by a count held to XLA's own (no compile here: the figures below are XLA's TPU
compiler's, libtpu 0.0.42.1, CPU compile; tests/plan/test_tpu_kernel_blocks.py compiles the kernel),
and every shipped config's head shape gets blocks that fit on every TPU generation."""

from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxrl4llm.kernels import tpu_blocks
from jaxrl4llm.kernels.tpu_blocks import (MiB, RaggedBlocks, heads_per_block, ragged_blocks, scoped_vmem_limit,
                                          slots_per_call, smem_bytes, tpu_generation, vmem_bytes)
from jaxrl4llm.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "configs" / "models").glob("*.yaml"))
KINDS = ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite")

# (kv heads, query heads a kv head, head_dim, kv pages, queries, dtype) -> XLA's "Scoped allocation with
# size" (E1001, compiled for v5p with vmem_limit_bytes=64 KiB so that every block reports its size)
XLA_SCOPED = {
    (8, 2, 128, 128, 32, "bfloat16"): 16.79 * MiB,  # Qwen3-0.6B / 1.7B on one chip, the kernel's own blocks
    (8, 2, 128, 64, 32, "bfloat16"): 8.79 * MiB,
    (8, 2, 128, 64, 64, "bfloat16"): 9.54 * MiB,
    (8, 2, 128, 8, 8, "bfloat16"): 1.22 * MiB,
    (8, 2, 128, 32, 128, "bfloat16"): 7.04 * MiB,
    (4, 4, 128, 128, 32, "bfloat16"): 8.79 * MiB,  # Qwen3-4B, rollout.tensor_parallel=2
    (2, 4, 128, 128, 32, "bfloat16"): 4.41 * MiB,  # Qwen3-8B, rollout.tensor_parallel=4
    (8, 2, 128, 16, 32, "float32"): 2.41 * MiB,
}


@pytest.mark.parametrize("case", sorted(XLA_SCOPED))
def test_the_vmem_count_is_xlas(case):
    """The count is XLA's to within the 0.01 MiB it prints and VMEM_SLACK (64 KiB) above it: never under."""
    kvh, group, dh, pages, queries, dtype = case
    qb, kvb = heads_per_block(kvh * group, kvh, dtype, dtype)
    ours = vmem_bytes(kv_pages=pages, queries=queries, page_size=16, q_heads_block=qb, kv_heads_block=kvb,
                      head_dim=dh, kv_dtype=dtype)
    assert XLA_SCOPED[case] - 0.01 * MiB <= ours <= XLA_SCOPED[case] + tpu_blocks.VMEM_SLACK + 0.01 * MiB


def test_the_smem_count_is_xlas():
    """XLA: 400 slots x 576 pages (a 9216-token slot) fit a core's 1 MiB of SMEM, 406 overflow it by
    2.1K, 1024 need the page table's 2,621,440 bytes alone; calls of `slots_per_call` slots fit."""
    assert smem_bytes(400, 576) <= tpu_blocks.TPU_SMEM < smem_bytes(406, 576)
    assert smem_bytes(1024, 576) > 2621440
    for slots in (1, 16, 64, 342, 400, 1024, 4096):
        per_call = slots_per_call(slots, 576)
        assert smem_bytes(per_call, 576) <= tpu_blocks.SMEM_SHARE * tpu_blocks.TPU_SMEM
        calls = -(-slots // per_call)
        assert per_call <= slots and (calls == 1 or smem_bytes(-(-slots // (calls - 1)), 576) >
                                      tpu_blocks.SMEM_SHARE * tpu_blocks.TPU_SMEM)  # the fewest calls
    assert slots_per_call(64, 576) == 64 and slots_per_call(1024, 576) == 342  # 3 calls of 342, 342, 340


def test_the_chips():
    assert [tpu_generation(k) for k in KINDS] == ["v4", "v5e", "v5p", "v6e"]
    assert [scoped_vmem_limit(k) // MiB for k in KINDS] == [16, 16, 16, 32]
    assert scoped_vmem_limit(None) == scoped_vmem_limit("TPU7x") == 16 * MiB  # unknown: the least


def test_the_kernels_own_blocks_overflow_v5p_at_qwen3_small_heads_and_ours_fit():
    """The bug: Qwen3-0.6B's 8 kv heads on one v5p chip, the kernel's own 128 pages x 32 queries = 16.8 MiB
    of 16; halved to 64 pages they fit, and the reason says so."""
    blocks, why = ragged_blocks("TPU v5", q_heads=16, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    assert blocks.default == (128, 32)
    assert vmem_bytes(kv_pages=128, queries=32, page_size=16, q_heads_block=16, kv_heads_block=8, head_dim=128,
                      kv_dtype=jnp.bfloat16) > 16 * MiB
    assert (blocks.kv_pages, blocks.queries) == (64, 32) and blocks.vmem <= 0.9 * 16 * MiB
    assert why == ("blocks of 64 KV pages x 32 queries (the kernel's own 128 x 32 halved to fit): 8.81 MiB of v5p's "
                   "16 MiB scoped VMEM")
    assert blocks.kernel_args() == dict(num_kv_pages_per_block=64, num_queries_per_block=32)
    v6e, _ = ragged_blocks("TPU v6 lite", q_heads=16, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    assert (v6e.kv_pages, v6e.queries) == (128, 32)  # 32 MiB: the kernel's own fit
    # known shapes: at most the slot's pages and the call's queries
    small, _ = ragged_blocks("TPU v5", q_heads=16, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16,
                             queries=8, pages_per_slot=40)
    assert (small.kv_pages, small.queries) == (40, 8)


def test_no_block_fits_or_no_tiling_is_none_with_the_reason():
    blocks, why = ragged_blocks("TPU v5", q_heads=64, kv_heads=64, head_dim=8192, page_size=256, dtype=jnp.float32)
    assert blocks is None and "smallest blocks (1 KV page x 1 query) need" in why and "v5p's 16 MiB" in why
    blocks, why = ragged_blocks("TPU v5", q_heads=6, kv_heads=3, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    assert blocks is None and "cannot tile 3 kv heads" in why


def shipped_heads(path: Path) -> tuple[set, int, str]:
    """A model config's (query heads, kv heads) on a sampler device, at its rollout.tensor_parallel and at 1
    (the whole model on one chip), its head_dim and dtype."""
    cfg = load_config([path], [])
    m, tp = cfg.model, cfg.rollout.tensor_parallel or 1
    return {(m.num_heads // tp, m.num_kv_heads // tp), (m.num_heads, m.num_kv_heads)}, m.head_dim, m.dtype


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_every_shipped_head_shape_gets_blocks_that_fit(path, kind):
    """Every configs/models/*.yaml, its sampler's heads a device (and the whole model's, on one chip), 16-token
    pages, a 9216-token slot, 16 or 342 slots a kernel call or not known yet: blocks within 90% of the scoped
    VMEM, halved from the kernel's own pick no further than they must."""
    shapes, head_dim, dtype = shipped_heads(path)
    for q, kv in shapes:
        for queries in (None, 16, 342):
            blocks, why = ragged_blocks(kind, q_heads=q, kv_heads=kv, head_dim=head_dim, page_size=16, dtype=dtype,
                                        queries=queries, pages_per_slot=None if queries is None else 576)
            assert isinstance(blocks, RaggedBlocks), why
            assert blocks.vmem <= tpu_blocks.VMEM_SHARE * scoped_vmem_limit(kind)
            if (blocks.kv_pages, blocks.queries) != blocks.default:  # one more doubling would not fit
                doubled = vmem_bytes(kv_pages=2 * blocks.kv_pages, queries=blocks.queries, page_size=16,
                                     q_heads_block=blocks.q_heads_block, kv_heads_block=blocks.kv_heads_block,
                                     head_dim=head_dim, kv_dtype=dtype)
                assert doubled > tpu_blocks.VMEM_SHARE * scoped_vmem_limit(kind)
