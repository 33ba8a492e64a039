"""The continuous sampler's decode attention on NVIDIA GPUs: a Pallas (Triton) paged attention
kernel reading our page pool in place.

Our pool keeps a layer's keys and values interleaved on the head axis, [pages, page, 2 KVH, Dh]
per shard (`paged_cache`, the TPU kernel's layout); JAX's GPU paged attention wants k_pages and
v_pages [KVH, pages, page, Dh], which would be a transpose (a copy of the whole pool) every layer
of every step. So the kernel body here (`partition_kernel`, the algorithm of JAX's
`pallas.ops.gpu.paged_attention`, which jax 0.12 deprecates, generalised to several kv heads a
program) runs under our own `pallas_call`, whose block specs view the pool as [pages, page, KVH,
k|v, Dh] and pick the keys or the values: the kernel addresses the pool through its strides,
nothing is copied. Each program reads only the pages below its slot's length, `pages_per_block`
at a time, with an online softmax:

    o_k = sum_t exp(s_t - m_k) V_t,  l_k = sum_t exp(s_t - m_k)  over partition k,  s = q K^T / sqrt(Dh)
    out = sum_k exp(m_k - m) o_k / sum_k exp(m_k - m) l_k,  m = max_k m_k      (flash decoding)

Two layouts of the grid (`LAYOUTS`):
- "per_kv_head": a program per (slot, kv head, block of 16 query heads, partition of the slot's
  pages), JAX's: a GQA group of 2 or 4 query heads is padded to Triton's 16 dot rows, and each
  program writes 16 rows of float32 partials.
- "per_slot": a program per (slot, partition) computes every query head of the slot against every
  kv head's keys, a loop step's keys [pages x page x KVH, Dh] read as the pool holds them (each
  token's heads contiguous); a query row's scores outside its own kv head's columns are masked
  (block-diagonal attention): KVH times the dot work (tensor-core FLOPs decode does not lack), KVH
  times fewer programs, and no padded rows at Qwen3's 16:8.
Which is faster on a chip is measured by `scripts/gpu_check --phases attention` (docs/gpu.md).

How a slot's pages are cut into the grid's K partitions (`SPLIT_RULES`; K is static, a row's cut is
an int32 input, so one compiled program serves every mix of lengths):
- "table": every slot's partitions are the table's width / K pages: a short row fills the first
  ones and the rest are empty (a row under width / K pages runs unsplit);
- "length": a slot's partitions are its own live pages / K, rounded up to whole loop steps (as
  SGLang's per-request `num_kv_splits`): a row's longest partition is about its own length / K,
  so a batch of short rows is split as finely as a batch of long ones.
And which partials a program writes (`STORES`): "all" (every program, every row; an empty partition
writes o = l = 0) or "live" (masked stores: only non-empty partitions, only real query rows: at
Qwen3's 16:8 the per_kv_head layout's 2 real rows of 16). The combine reads a partition only where
the rule says it was written, so an unwritten buffer (which may hold NaN) never reaches the output.

It rounds unnormalised probabilities to the pool's dtype before the V matmul (as the TPU kernel
does), so it equals `paged_cache.paged_attention` (which rounds normalised ones, as the training
forward) to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrl4llm.kernels.choice import NO_TRITON, pallas_triton
from jaxrl4llm.sampling.paged_cache import per_device

BLOCK_H = 16  # Triton's fewest dot rows: a program's query rows are padded up to a power of two >= this
LAYOUTS = ("per_kv_head", "per_slot")
# The layout, blocks, split and warps: the fastest of 16 configurations of the per_kv_head layout at a
# Qwen3-0.6B rollout's kv lengths on an H200 (`scripts/gpu_check --phases attention`, docs/gpu.md,
# 2026-11-28): 1.22x the kernel's previous 4 warps and 1024-program grid alone, the rollout 2.04 s ->
# 1.96 s. The per_slot layout has not yet run on a chip.
LAYOUT = "per_kv_head"
PAGES_PER_BLOCK = 4  # pages one loop step of a per_kv_head program reads (64 tokens at 16-token pages)
SLOT_PAGES_PER_BLOCK = 1  # of a per_slot program (a page holds every kv head: 16 tokens x 8 heads = 128 key rows)
GRID_TARGET = 2048  # programs worth launching: the k-split parallelises long slots when slots are few
K_SPLITS = None  # partitions of a slot's pages; None: the GRID_TARGET rule (`kernel_blocks`)
NUM_WARPS, NUM_STAGES = 8, 2  # Triton's launch parameters of a program
SPLIT_RULES = ("table", "length")  # how a slot's pages are cut into the K partitions (the module's docstring)
SPLIT_RULE = "table"  # the rule that ran on the H200 (2026-11-28); "length" has not yet run on a chip
STORES = ("all", "live")  # which partials a program writes (the module's docstring)
STORE = "all"  # as on the H200 (2026-11-28); "live" has not yet run on a chip
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # a logit past the slot's length: finite, so no inf - inf


def triton_params(**params):
    """Pallas' Triton compiler parameters; a ValueError naming the fix on a jax without the backend
    (the layout picks XLA's attention there: `kernels.choice.platform_decode_kernel`)."""
    if pallas_triton is None:
        raise ValueError(f"rollout.decode_attention=gpu_triton: {NO_TRITON}")
    return pallas_triton.CompilerParams(**params)


def partition_kernel(q_ref, k_ref, v_ref, table_ref, length_ref, split_ref, o_ref, l_ref, m_ref, *,
                     pages_per_block: int, group: int, live_rows: tuple[int, int] | None = None):
    """One program: its query rows against partition k = program_id(2) of its slot's pages, the
    slot's pages [k P, (k + 1) P) with P = split_ref[0] (`partition_pages`):

        o_k = sum_t exp(s_t - m_k) V_t,  l_k = sum_t exp(s_t - m_k),  m_k = max_t s_t,  s = q K^T

    over the partition's tokens below the slot's length and, for query row r, the keys of kv head
    r // group alone (with one kv head a program, group = the rows: every row reads it),
    `pages_per_block` pages a loop step with an online softmax (exp as exp2 of log2(e) x, the GPU's
    fast exponential); probabilities are rounded to the pool's dtype for the V matmul.

    live_rows None (STORE "all"): a partition past the length writes o = l = 0, m = the float32
    minimum, and rows past the last kv head's group (padding) write garbage, sliced off by the caller.
    live_rows (heads, blocks) (STORE "live"): an empty partition writes nothing, and a program writes
    only its real query rows, the first min(R, heads - (program_id(1) % blocks) R) (masked stores).

    Refs: q [R, Dh] (pre-scaled by 1/sqrt(Dh), the pool's dtype); k, v [pages, page, KVH, Dh] (the
    program's kv heads' keys or values in the pool); table [padded pages] int32 (the slot's, whole);
    length, split [1] int32. Outputs: o [R, Dh], l, m [R] float32.
    """
    rows, dh = q_ref.shape
    page, kv_heads = k_ref.shape[1], k_ref.shape[2]
    per_partition = split_ref[0]
    block_k = pages_per_block * page * kv_heads  # a loop step's key rows: (token, kv head), token-major
    log2e = math.log2(math.e)
    first_page = pl.program_id(2) * per_partition
    last_page = jnp.minimum(pl.cdiv(length_ref[0], page), first_page + per_partition)

    start = (jnp.zeros((rows, dh), jnp.float32), jnp.full((rows,), jnp.finfo(jnp.float32).min),
             jnp.zeros((rows,), jnp.float32))  # (o, m, l) of no token: what an empty partition keeps

    def partition():
        q = q_ref[...]
        column = jnp.arange(block_k)

        def step(i, carry):
            o, m, l = carry
            pages = table_ref[pl.ds(first_page + i * pages_per_block, pages_per_block)]
            k = k_ref[pages].reshape(block_k, dh)
            v = v_ref[pages].reshape(block_k, dh)
            token = (first_page + i * pages_per_block) * page + column // kv_heads
            visible = (token < length_ref[0])[None, :]
            if kv_heads > 1:  # block-diagonal: row r reads kv head r // group
                visible = visible & ((jnp.arange(rows) // group)[:, None] == (column % kv_heads)[None, :])
            s = jnp.where(visible, pallas_triton.dot(q, k.T), MASK_VALUE)  # [R, block_k]
            m_next = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp2((m - m_next) * log2e)
            p = jnp.exp2((s - m_next[:, None]) * log2e)
            o = correction[:, None] * o + pallas_triton.dot(p.astype(v.dtype), v)
            return o, m_next, correction * l + p.sum(axis=-1)

        return jax.lax.fori_loop(0, pl.cdiv(last_page - first_page, pages_per_block), step, start)

    if live_rows is None:
        o, m, l = jax.lax.cond(first_page >= last_page, lambda: start, partition)
        o_ref[...], l_ref[...], m_ref[...] = o, l, m
        return
    heads, blocks = live_rows
    real = jnp.arange(rows) < jnp.minimum(rows, heads - (pl.program_id(1) % blocks) * rows)

    @pl.when(first_page < last_page)
    def store_live_rows():
        o, m, l = partition()
        pallas_triton.store(o_ref, o, mask=real[:, None])
        pallas_triton.store(l_ref, l, mask=real)
        pallas_triton.store(m_ref, m, mask=real)


def kernel_layout(kv_heads: int, group: int, layout: str | None = None) -> str:
    """The layout a call runs (`LAYOUTS`; None: `LAYOUT`). per_slot needs a power-of-two count of kv
    heads (its key rows are Triton blocks) and at most 128 query rows a slot; otherwise per_kv_head
    runs, which takes any."""
    layout = layout or LAYOUT
    if layout not in LAYOUTS:
        raise ValueError(f"paged attention layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if layout == "per_slot" and (kv_heads & (kv_heads - 1) or kv_heads * group > 128):
        return "per_kv_head"
    return layout


def program_shape(kv_heads: int, group: int, layout: str | None = None) -> tuple[int, int]:
    """(programs a slot's partition runs, query rows a program computes) in `kernel_layout`'s layout:
    per_kv_head: KVH x ceil(group / 16) programs of 16 rows; per_slot: 1 program of the slot's KVH x
    group query heads padded to a power of two >= 16."""
    if kernel_layout(kv_heads, group, layout) == "per_slot":
        return 1, max(BLOCK_H, 1 << (kv_heads * group - 1).bit_length())
    return kv_heads * -(-group // BLOCK_H), BLOCK_H


def default_pages_per_block(layout: str) -> int:
    """Pages a loop step reads unless a call says: `SLOT_PAGES_PER_BLOCK` for per_slot, else
    `PAGES_PER_BLOCK` (module constants, read when a call traces)."""
    return SLOT_PAGES_PER_BLOCK if layout == "per_slot" else PAGES_PER_BLOCK


def dot_rows(kv_heads: int, group: int, layout: str | None = None) -> int:
    """Query rows (padding included) each kv token of a slot meets in the kernel's dots, summed over
    the slot's programs: q K^T and P V cost 4 x this x Dh FLOPs a token (`plan`'s count). per_kv_head:
    a program's rows meet its kv head's tokens; per_slot: every row meets every kv head's."""
    programs, rows = program_shape(kv_heads, group, layout)
    return programs * rows * (kv_heads if kernel_layout(kv_heads, group, layout) == "per_slot" else 1)


def kernel_blocks(pages: int, slots: int, head_programs: int, pages_per_block: int | None = None,
                  k_splits: int | None = None) -> tuple[int, int, int]:
    """(pages_per_block, k_splits, padded_pages) for slots of `pages` logical pages, `head_programs`
    programs a slot's partition (`program_shape`): a program reads `pages_per_block` pages a loop step
    (default `PAGES_PER_BLOCK`; a power of two, Triton's blocks: at most the largest one <= `pages`);
    a slot's pages split into `k_splits` partitions, one program each (default: as many as bring the
    grid near `GRID_TARGET` programs, at most one per block); the page table is padded to
    `padded_pages`, a multiple of both, with pages no slot's length reaches (a partition past a slot's
    length does no work)."""
    block = pages_per_block or PAGES_PER_BLOCK
    if block < 1 or block & (block - 1):
        raise ValueError(f"pages_per_block={block}: a power of two (Triton's blocks), e.g. 1, 2, 4 or 8")
    block = min(block, 1 << (max(pages, 1).bit_length() - 1))  # a 3-page table reads 2 a step, not 3
    blocks = -(-pages // block)
    if k_splits is None:
        k_splits = min(blocks, max(1, GRID_TARGET // max(1, slots * head_programs)))
    if k_splits < 1:
        raise ValueError(f"k_splits={k_splits}: at least 1 partition of a slot's pages")
    return block, k_splits, -(-pages // (block * k_splits)) * block * k_splits


def call_blocks(width: int, slots: int, kv_heads: int, group: int, layout: str | None = None,
                pages_per_block: int | None = None, k_splits: int | None = None) -> tuple[str, int, int, int]:
    """(layout, pages_per_block, k_splits, padded_pages) a call over `slots` slots of `width`-page
    tables runs (`kernel_layout`, `kernel_blocks`); None: this module's constants (the layout's pages
    a loop step, K_SPLITS). The kernel's call and the meter's count (`written_partitions`) both read it."""
    layout = kernel_layout(kv_heads, group, layout)
    blocks = kernel_blocks(width, slots, program_shape(kv_heads, group, layout)[0],
                           pages_per_block or default_pages_per_block(layout), K_SPLITS if k_splits is None else k_splits)
    return (layout, *blocks)


def partition_pages(kv_len: jax.Array, page: int, padded_pages: int, pages_per_block: int, k_splits: int,
                    rule: str) -> jax.Array:
    """[S] int32: pages in each partition of each slot (`SPLIT_RULES`), P_s with partition k = pages
    [k P_s, (k + 1) P_s) of slot s:
        table:  P_s = padded_pages / K                         (the same for every slot)
        length: P_s = b ceil(ceil(ceil(kv_len_s / page) / K) / b),  b = pages_per_block, at least b
    Either covers a slot's live pages in K partitions, and every loop step reads table entries below
    `padded_pages` (a partition starts at a whole loop step; `kernel_blocks` pads to whole steps)."""
    if rule not in SPLIT_RULES:
        raise ValueError(f"paged attention split rule {rule!r}: one of {', '.join(SPLIT_RULES)}")
    kv_len = kv_len.astype("int32")  # a jax array in the kernel's call, a numpy one in the meter's (`written_partitions`)
    if rule == "table":
        return kv_len * 0 + padded_pages // k_splits
    live = -(-kv_len // page)
    steps = -(-live // (k_splits * pages_per_block))  # loop steps a partition: ceil(ceil(live / K) / b)
    return (steps + (steps == 0)) * pages_per_block  # at least one


def written_partitions(live_pages, width: int, slots: int, kv_heads: int, group: int):
    """Partitions whose float32 partials the kernel writes for each slot of `live_pages` pages (0: an
    idle slot), in a call over `slots` slots of `width`-page tables, under this module's constants
    (LAYOUT, the pages a loop step, K_SPLITS, SPLIT_RULE, STORE: what a call traces with): STORE "all":
    K for every slot, idle ones too; "live": those that hold a live page, ceil(live / P_s)
    (`partition_pages`). numpy in and out: the meter's count (`plan.decode_work`)."""
    _, block, splits, padded = call_blocks(width, slots, kv_heads, group)
    live_pages = np.asarray(live_pages, np.int64)
    if STORE == "all":
        return np.full(live_pages.shape, splits, np.int64)
    per = np.asarray(partition_pages(live_pages, 1, padded, block, splits, SPLIT_RULE), np.int64)
    return -(-live_pages // per)


def partial_bytes(kv_heads: int, group: int, head_dim: int) -> int:
    """Bytes of float32 partials (o [Dh], l, m a query row) one written partition of a slot stores,
    under this module's constants: STORE "all": every program's rows, padding included
    (`program_shape`); "live": the slot's KVH x group query heads."""
    layout = kernel_layout(kv_heads, group)
    programs, rows = program_shape(kv_heads, group, layout)
    return (programs * rows if STORE == "all" else kv_heads * group) * (head_dim + 2) * 4


def combine_partitions(o: jax.Array, l: jax.Array, m: jax.Array, written: jax.Array) -> jax.Array:
    """The flash-decoding combine of K partitions' partials, reading a partition only where it was
    written (an unwritten buffer may hold anything, NaN included):

        out = sum_k w_k o_k / sum_k w_k l_k,  w_k = exp(m_k - max_j m_j) over the written k (0 if none)

    o [K, ..., Dh], l, m [K, ...] float32; written [K, ...] bool. Returns [..., Dh] float32 (0 where
    nothing was written: an idle slot)."""
    m = jnp.where(written, m, -jnp.inf)
    top = jnp.max(m, axis=0)
    w = jnp.where(written, jnp.exp(m - top), 0.0)  # [K, ...]: each partition's share of the softmax
    total = jnp.sum(jnp.where(written, w * l, 0.0), axis=0)
    out = jnp.sum(jnp.where(written[..., None], w[..., None] * o, 0.0), axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def heads_by_program(q: jax.Array, programs: int, rows: int, per_slot: bool) -> jax.Array:
    """q [S, KVH, group, Dh] as the kernel's [S, programs, R, Dh], padded rows of zeros (`program_shape`);
    `rows_by_head` undoes it. per_slot: row r = kv head r // group; else program g = kv head g // blocks,
    its block g % blocks of R query heads."""
    s, kv_heads, group, dh = q.shape
    if per_slot:
        return jnp.pad(q.reshape(s, 1, kv_heads * group, dh), ((0, 0), (0, 0), (0, rows - kv_heads * group), (0, 0)))
    heads = programs // kv_heads * rows
    return jnp.pad(q, ((0, 0), (0, 0), (0, heads - group), (0, 0))).reshape(s, programs, rows, dh)


def rows_by_head(x: jax.Array, kv_heads: int, group: int, per_slot: bool) -> jax.Array:
    """A kernel output [K, S, programs, R, ...] as [K, S, KVH, group, ...], the padded rows dropped
    (`heads_by_program`'s inverse)."""
    k, s, _, rows, *trailing = x.shape
    if per_slot:  # one program: row r = kv head r // group
        return x.reshape(k, s, rows, *trailing)[:, :, :kv_heads * group].reshape(k, s, kv_heads, group, *trailing)
    return x.reshape(k, s, kv_heads, -1, *trailing)[:, :, :, :group]  # program g = kv head g // blocks


def gpu_paged_attention_one_shard(q: jax.Array, pool: jax.Array, table: jax.Array, kv_len: jax.Array, *,
                                  layout: str | None = None, pages_per_block: int | None = None,
                                  k_splits: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, split_rule: str | None = None,
                                  store: str | None = None, interpret: bool = False) -> jax.Array:
    """softmax(q K^T / sqrt(Dh)) V over each slot's first kv_len tokens, K and V read in place.

    Args:
      q [S, KVH, H/KVH, Dh] (any float dtype; cast to the pool's).
      pool [pages, page, 2 KVH, Dh] bf16/f16: key of head h at column 2h, its value at 2h + 1.
      table [S, W] int32: a slot's logical pages (its tokens contiguous over them).
      kv_len [S] int32: valid tokens of each slot (0: an idle slot, whose output is 0).
      layout: the grid's (`LAYOUTS`, `kernel_layout`); pages_per_block: pages a program reads per
        loop step; k_splits: partitions of a slot's pages run as separate programs (`kernel_blocks`);
        num_warps, num_stages: Triton's; split_rule: how a slot's pages are cut into those partitions
        (`SPLIT_RULES`); store: which partials the programs write (`STORES`). None: this module's
        constants (LAYOUT, PAGES_PER_BLOCK or SLOT_PAGES_PER_BLOCK, K_SPLITS, NUM_WARPS, NUM_STAGES,
        SPLIT_RULE, STORE), read when the call traces.
      interpret: run the kernel in Pallas' interpreter (any backend; for tests on CPU).
    Returns: [S, KVH, H/KVH, Dh] float32.
    """
    s, kvh, hg, dh = q.shape
    pages, page, two_kvh, _ = pool.shape
    width = table.shape[1]
    if two_kvh != 2 * kvh:
        raise ValueError(f"pool [pages, page, 2 KVH, Dh] has {two_kvh} head columns for {kvh} kv heads of q")
    store = store or STORE
    if store not in STORES:
        raise ValueError(f"paged attention store {store!r}: one of {', '.join(STORES)}")
    layout, block, splits, padded = call_blocks(width, s, kvh, hg, layout, pages_per_block, k_splits)
    head_programs, rows = program_shape(kvh, hg, layout)
    per_slot = layout == "per_slot"
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, padded - width)))  # page 0: read past the length only
    kv_len = kv_len.astype(jnp.int32)
    split = partition_pages(kv_len, page, padded, block, splits, split_rule or SPLIT_RULE)
    q = heads_by_program((q * dh**-0.5).astype(pool.dtype), head_programs, rows, per_slot)
    kv_block = kvh if per_slot else 1  # kv heads a program reads
    head = lambda g: 0 if per_slot else g // (head_programs // kvh)  # a program's first kv head (in blocks of kv_block)
    live_rows = None if store == "all" else (kvh * hg, 1) if per_slot else (hg, head_programs // kvh)
    kernel = functools.partial(partition_kernel, pages_per_block=block, group=hg if per_slot else rows,
                               live_rows=live_rows)
    pool = pool.reshape(pages, page, kvh, 2, dh)  # free: keys at [..., h, 0, :], values at [..., h, 1, :]
    # grid (slot, head program, partition): the kernel reads its partition as program_id(2)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(s, head_programs, splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, dh), lambda b, g, k: (b, g, 0, 0)),  # q
            pl.BlockSpec((pages, page, kv_block, None, dh), lambda b, g, k: (0, 0, head(g), 0, 0)),  # keys
            pl.BlockSpec((pages, page, kv_block, None, dh), lambda b, g, k: (0, 0, head(g), 1, 0)),  # values
            pl.BlockSpec((None, padded), lambda b, g, k: (b, 0)),  # the slot's pages
            pl.BlockSpec((1,), lambda b, g, k: (b,)),  # the slot's length
            pl.BlockSpec((1,), lambda b, g, k: (b,)),  # the slot's pages a partition
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dh), lambda b, g, k: (k, b, g, 0, 0)),  # o_k
            pl.BlockSpec((None, None, None, rows), lambda b, g, k: (k, b, g, 0)),  # l_k
            pl.BlockSpec((None, None, None, rows), lambda b, g, k: (k, b, g, 0)),  # m_k
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, s, head_programs, rows, dh), jnp.float32),
                   jax.ShapeDtypeStruct((splits, s, head_programs, rows), jnp.float32),
                   jax.ShapeDtypeStruct((splits, s, head_programs, rows), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES),
        name="jaxrl4llm_paged_attention",
    )(q, pool, pool, table, kv_len, split)
    o, l, m = (rows_by_head(x, kvh, hg, per_slot) for x in (o, l, m))  # the padded rows dropped
    written = jnp.arange(splits)[:, None] * split[None] < -(-kv_len // page)[None]  # [K, S]: a live partition
    return combine_partitions(o, l, m, written[:, :, None, None])


def gpu_paged_attention(q: jax.Array, pool: jax.Array, table: jax.Array, kv_len: jax.Array, *, mesh=None,
                        batch_axes: tuple = (), tensor_axis: str | None = None, interpret: bool = False,
                        **blocks) -> jax.Array:
    """`gpu_paged_attention_one_shard` for every shard: q [D, S, KVH, H/KVH, Dh], pool [D, pages,
    page, 2 KVH, Dh], table [D, S, W], kv_len [D, S] -> [D, S, KVH, H/KVH, Dh] float32. With a mesh
    the kernel runs per GPU (`paged_cache.per_device`): D over `batch_axes`, kv heads over `tensor_axis` (a GPU
    holds whole key/value column pairs: `paged_cache.POOL_AXES` splits the 2 KVH axis)."""

    def one_device(q, pool, table, kv_len):
        one = functools.partial(gpu_paged_attention_one_shard, interpret=interpret, **blocks)
        if q.shape[0] == 1:  # a shard per device: [1, ...] -> [...] is free
            return one(q[0], pool[0], table[0], kv_len[0])[None]
        return jnp.stack([one(q[i], pool[i], table[i], kv_len[i]) for i in range(q.shape[0])])

    return per_device(one_device, q, pool, table, kv_len, mesh=mesh, batch_axes=batch_axes, tensor_axis=tensor_axis)
