"""The TPU ragged paged attention kernel's blocks: what they hold in a core's scoped VMEM and SMEM,
and the largest that fit (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`).

The kernel attends `num_queries_per_block` queries (one a slot when decoding) of a block of query
heads at a time against `num_kv_pages_per_block` KV pages, copied from HBM into two buffers (one
read while the next is fetched). What it allocates in a core's scoped VMEM, bytes:

    KV buffers     2 x kv_pages x page x 2 KVHb x Dh x kv itemsize     (keys and values interleaved)
    accumulator    queries x QHb x Dh x 4                               (float32)
    l and m        2 x KVHb x queries x QHb / KVHb x 128 x 4           (float32, a 128-lane row each)
    the rest       VMEM_SLACK                                           (semaphores, Mosaic's own)

QHb / KVHb: the query / kv heads of a block (`heads_per_block`: the kernel's
`get_min_heads_per_blk`, 16 combined KV heads of bfloat16 on a chip that holds more). Calibrated
on XLA's TPU compiler (libtpu 0.0.42.1, CPU compile for v5p, v5e, v6e, v4): its E1001
"Scoped allocation with size" is this count to within 64 KiB at every block tried (the q and
output blocks do not count against the limit). And in SMEM (1 MiB a core on every generation)
the kernel prefetches the slots' page table, its rows padded to 128 lanes, and two length vectors:

    4 x (slots x ceil128(pages a slot) + 2 x ceil128(slots + 1)) + SMEM_RESERVE

The kernel's own pick (its tuned table for the TPU generation, else 128 pages x 32 queries; 32 x
32 on v4) overflows 16 MiB of scoped VMEM at 16 combined bfloat16 KV heads of 128 and 16-token
pages (2 x 128 x 16 x 16 x 128 x 2 bytes = 16 MiB of KV buffers alone: Qwen3-0.6B and 1.7B with
their 8 KV heads on one chip); `ragged_blocks` halves the KV pages, then the queries, of that pick
until the count fits VMEM_SHARE of the chip's scoped VMEM, and `slots_per_call` splits the slots
into kernel calls whose page tables fit SMEM_SHARE of SMEM. Pure functions of the head shape,
the page size, the dtypes and the chip; `kernels.choice` falls back to XLA's paged attention (the
reason saying so) where no block fits, and `sampling.paged_cache.kernel_paged_attention` calls the
kernel with these blocks, on a TPU and when `plan` compiles for one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged_kernel
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

MiB = 2**20
# A TensorCore's scoped VMEM limit, the default XLA's TPU compiler gives a Pallas kernel that sets
# none (E1001 CompileTimeScopedVmemOom "limit 16.00M" on v5p and v5e, 32.00M on v6e; "would exceed
# memory (size=16777216)" on v4), by generation.
TPU_SCOPED_VMEM = {"v4": 16 * MiB, "v5e": 16 * MiB, "v5p": 16 * MiB, "v6e": 32 * MiB}
TPU_SMEM = 1 * MiB  # a TensorCore's scalar memory ("would exceed memory (size=1048576)", every generation above)
UNKNOWN_SCOPED_VMEM = 16 * MiB  # another TPU (or a device with no kind): the least of the generations above
VMEM_SHARE = 0.9  # the blocks fill at most this share of the scoped VMEM (headroom for another libtpu's count)
SMEM_SHARE = 0.9
VMEM_SLACK = 64 * 2**10
SMEM_RESERVE = 16 * 2**10  # measured: 406 slots x 640 lanes overflow SMEM by 2.1K, 400 fit
# device_kind -> generation (`jax.Device.device_kind`; v5p reports "TPU v5", v5e "TPU v5 lite")
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
             "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def tpu_generation(device_kind: str | None) -> str | None:
    """The TPU generation of a `device_kind` ("TPU v5" -> "v5p", "TPU v5 lite" -> "v5e"); None if unknown."""
    return TPU_KINDS.get(" ".join((device_kind or "").split()))


def scoped_vmem_limit(device_kind: str | None) -> int:
    """Bytes of scoped VMEM a Pallas kernel gets on a chip of `device_kind` (`TPU_SCOPED_VMEM`)."""
    return TPU_SCOPED_VMEM.get(tpu_generation(device_kind), UNKNOWN_SCOPED_VMEM)


def heads_per_block(q_heads: int, kv_heads: int, q_dtype, kv_dtype) -> tuple[int, int]:
    """(query heads, kv heads) the kernel attends in one block (its `get_min_heads_per_blk`);
    a ValueError where the kernel cannot tile the kv heads (it says "Not implemented")."""
    q_block, combined = ragged_kernel.get_min_heads_per_blk(q_heads, 2 * kv_heads, jnp.dtype(q_dtype),
                                                            jnp.dtype(kv_dtype))
    return q_block, combined // 2


def vmem_bytes(*, kv_pages: int, queries: int, page_size: int, q_heads_block: int, kv_heads_block: int,
               head_dim: int, kv_dtype) -> int:
    """Scoped VMEM bytes the kernel allocates at these blocks (the module docstring's count)."""
    kv = 2 * kv_pages * page_size * 2 * kv_heads_block * head_dim * jnp.dtype(kv_dtype).itemsize
    acc = queries * q_heads_block * head_dim * 4
    lm = 2 * kv_heads_block * queries * (q_heads_block // kv_heads_block) * 128 * 4
    return kv + acc + lm + VMEM_SLACK


def smem_bytes(slots: int, pages_per_slot: int) -> int:
    """SMEM bytes the kernel's prefetched page table and lengths take for `slots` slots in one call."""
    lanes = lambda n: -(-n // 128) * 128
    return 4 * (slots * lanes(pages_per_slot) + 2 * lanes(slots + 1)) + SMEM_RESERVE


def slots_per_call(slots: int, pages_per_slot: int) -> int:
    """The most slots of a shard one kernel call takes with its page table in SMEM_SHARE of SMEM,
    spread evenly: ceil(slots / calls) for the fewest calls that fit (at least 1 slot)."""
    fits = lambda n: smem_bytes(n, pages_per_slot) <= SMEM_SHARE * TPU_SMEM
    lo, hi = 1, max(slots, 1)  # the most that fit, by bisection (smem_bytes grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    calls = -(-slots // lo)
    return -(-slots // calls)


class RaggedBlocks(NamedTuple):
    """The kernel's blocks on a chip: `kv_pages` (num_kv_pages_per_block), `queries`
    (num_queries_per_block), the VMEM they take and the chip's scoped limit, the heads of a block,
    the kernel's own pick they were cut from, and the chip ("v5p"; "this TPU" if unknown)."""

    kv_pages: int
    queries: int
    vmem: int
    vmem_limit: int
    q_heads_block: int
    kv_heads_block: int
    default: tuple[int, int]
    chip: str

    def kernel_args(self) -> dict:
        """The kernel's keyword arguments (`ragged_paged_attention(**blocks.kernel_args())`)."""
        return dict(num_kv_pages_per_block=self.kv_pages, num_queries_per_block=self.queries)

    def describe(self) -> str:
        """E.g. "blocks of 64 KV pages x 32 queries (the kernel's own 128 x 32 halved to fit): 8.81 MiB of
        v5p's 16 MiB scoped VMEM"."""
        cut = "" if (self.kv_pages, self.queries) == self.default else \
            f" (the kernel's own {self.default[0]} x {self.default[1]} halved to fit)"
        return (f"blocks of {self.kv_pages} KV pages x {self.queries} queries{cut}: {self.vmem / MiB:.2f} MiB of "
                f"{self.chip}'s {self.vmem_limit / MiB:.0f} MiB scoped VMEM")


def kernel_default_blocks(device_kind: str | None, *, q_heads_block: int, kv_heads_block: int, head_dim: int,
                          page_size: int, dtype, queries: int | None, pages_per_slot: int | None) -> tuple[int, int]:
    """(kv pages, queries) the kernel picks on its own on a chip of `device_kind` (its tuned table,
    keyed by the shapes, else 128 x 32; 32 x 32 on v4), which reads the attached chip: compiling
    for a TPU topology on a CPU host needs them passed."""
    name = jnp.dtype(dtype).name
    key = tuned_block_sizes.simplify_key((name, name, q_heads_block, kv_heads_block, head_dim, page_size,
                                          queries or 1, pages_per_slot or 1))
    table = tuned_block_sizes.TUNED_BLOCK_SIZES.get(" ".join((device_kind or "").split()[:2]), {})
    kv_pages, q = table.get(key, (128, 32)) if queries and pages_per_slot else (128, 32)
    if tpu_generation(device_kind) == "v4":
        kv_pages, q = 32, 32  # the kernel's untuned v4 default
    return min(kv_pages, pages_per_slot or kv_pages), min(q, queries or q)


def ragged_blocks(device_kind: str | None, *, q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype,
                  queries: int | None = None, pages_per_slot: int | None = None) -> tuple[RaggedBlocks | None, str]:
    """The kernel's blocks for a chip of `device_kind` attending `q_heads` query heads over
    `kv_heads` kv heads of `head_dim` (a device's share), KV pages of `page_size` tokens of `dtype`
    (the queries are cast to it), at most `queries` queries and `pages_per_slot` pages a slot (None:
    not known yet, the blocks' most): the kernel's own pick, its KV pages halved, then its queries,
    until `vmem_bytes` fits VMEM_SHARE of the chip's scoped VMEM. (blocks, why) or (None, why not)."""
    limit = scoped_vmem_limit(device_kind)
    chip = tpu_generation(device_kind) or "this TPU"
    try:
        qb, kvb = heads_per_block(q_heads, kv_heads, dtype, dtype)
    except (ValueError, AssertionError) as e:
        return None, (f"the TPU ragged paged attention kernel cannot tile {kv_heads} kv heads of {jnp.dtype(dtype).name} "
                      f"({str(e).splitlines()[0] if str(e) else 'an assertion'})")
    default = kernel_default_blocks(device_kind, q_heads_block=qb, kv_heads_block=kvb, head_dim=head_dim,
                                    page_size=page_size, dtype=dtype, queries=queries, pages_per_slot=pages_per_slot)
    need = lambda p, q: vmem_bytes(kv_pages=p, queries=q, page_size=page_size, q_heads_block=qb, kv_heads_block=kvb,
                                   head_dim=head_dim, kv_dtype=dtype)
    pages, q = default
    while need(pages, q) > VMEM_SHARE * limit and (pages > 1 or q > 1):
        pages, q = (pages // 2, q) if pages > 1 else (pages, q // 2)
    if need(pages, q) > VMEM_SHARE * limit:
        return None, (f"the TPU ragged paged attention kernel's smallest blocks (1 KV page x 1 query) need "
                      f"{need(1, 1) / MiB:.2f} MiB of VMEM, over {100 * VMEM_SHARE:.0f}% of {chip}'s "
                      f"{limit / MiB:.0f} MiB scoped VMEM ({qb} query and {kvb} kv heads of {head_dim} a block, "
                      f"{page_size}-token pages of {jnp.dtype(dtype).name})")
    blocks = RaggedBlocks(pages, q, need(pages, q), limit, qb, kvb, default, chip)
    return blocks, blocks.describe()
