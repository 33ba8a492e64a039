"""A paged KV cache for the continuous sampler: a page pool, a free-page stack, and attention over live pages.

    pool[l]   [D, pages, page, 2 KVH, Dh] keys and values of layer l, interleaved on the head axis
                                           (key of head h at 2h, its value at 2h + 1: the TPU ragged
                                           paged attention kernel's layout); page 0 is a trash page
    free      [D, pages]                   stack of free page ids: free[d, :top[d]] are free
    table     [D, S, pages_per_slot]       a slot's logical pages: its prompt's full pages, then its own

D is the number of data-parallel shards of the sampler (each shard has its own pool, slots and
prompts, so every page lookup stays on its shard); S the slots of a shard. A prompt's pages are
written once at prefill; its full pages are read in place by the G slots that sample it, its
last, partial page is copied into each slot's first own page, where the slot's tokens continue
(so a slot's tokens are contiguous over its logical pages, the layout of vLLM and of the TPU
ragged paged attention kernel, and shared pages are never written). A slot's own pages are
taken from the stack as its length crosses a page boundary and given back when it finishes.
Writes of idle slots go to the trash page, which no slot ever attends to.

Attention reads each slot's live pages only, C pages at a time: the chunk loops run
ceil(max over live slots of live pages / C) times, bounded by the longest live slot (up to one
chunk of rounding), not by the cache's capacity:

    s = q K^T / sqrt(Dh) chunk by chunk into a float32 row;  p = softmax(s);  out = sum_chunks p_c V_c

(an online softmax would read each page in one pass, but it rounds unnormalised probabilities
to bf16, not the normalised ones the training forward rounds; the score row is small).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.sharding import PartitionSpec as P

from jaxrl4llm.kernels.tpu_blocks import RaggedBlocks, ragged_blocks, slots_per_call
from jaxrl4llm.models.layers.linear import einsum

TRASH_PAGE = 0
_MASKED = -1e30
POOL_AXES = ("batch", None, None, "kv_heads", None)  # [D, pages, page, 2 KVH, Dh]


class FreePages(NamedTuple):
    """stack [D, pages] int32 (free[d, :top[d]] are free page ids); top [D] int32."""

    stack: jax.Array
    top: jax.Array


def empty_free_pages(num_shards: int, num_pages: int) -> FreePages:
    """Every page but the trash page free: stack[d] = [1, 2, ..., pages-1, 0], top = pages - 1."""
    ids = jnp.roll(jnp.arange(num_pages, dtype=jnp.int32), -1)
    return FreePages(jnp.broadcast_to(ids, (num_shards, num_pages)), jnp.full((num_shards,), num_pages - 1, jnp.int32))


def pop_pages(free: FreePages, need: jax.Array) -> tuple[FreePages, jax.Array]:
    """Take one page for every True of need [D, M] (in order): (free', ids [D, M], TRASH_PAGE where not needed).

    The caller sizes the pool so that the stack never runs dry (`pool_pages`)."""
    rank = jnp.cumsum(need, axis=1, dtype=jnp.int32) - 1
    at = jnp.clip(free.top[:, None] - 1 - rank, 0, free.stack.shape[1] - 1)
    ids = jnp.where(need, jnp.take_along_axis(free.stack, at, axis=1), TRASH_PAGE)
    return FreePages(free.stack, free.top - jnp.sum(need, axis=1, dtype=jnp.int32)), ids


def push_pages(free: FreePages, pages: jax.Array, release: jax.Array) -> FreePages:
    """Give back pages [D, M] where release [D, M] is True."""
    size = free.stack.shape[1]
    rank = jnp.cumsum(release, axis=1, dtype=jnp.int32) - 1
    at = jnp.where(release, free.top[:, None] + rank, size)  # out of range: dropped
    stack = jax.vmap(lambda s, i, p: s.at[i].set(p, mode="drop", unique_indices=True))(free.stack, at, pages)  # ranks
    return FreePages(stack, free.top + jnp.sum(release, axis=1, dtype=jnp.int32))


def pool_pages(slots: int, prompts: int, prompt_pages: int, response_pages: int) -> int:
    """Pages of one shard's pool that never run out: the trash page, every slot's response pages
    and the pages of `prompts` prompts (a prompt holds its pages while any of its rows is unfinished)."""
    return 1 + slots * response_pages + prompts * prompt_pages


def as_values(x: jax.Array, dtype) -> jax.Array:
    """Pool data in `dtype`: a uint16 pool holds 16-bit floats as their bit patterns (`empty_pool`)."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def empty_pool(shape: tuple, dtype, *, bits: bool) -> jax.Array:
    """A zeroed pool of `dtype` values; with `bits` (XLA:CPU, 16-bit dtypes) stored as uint16 bit
    patterns: XLA:CPU widens a bf16 scatter or gather to float32 over the whole buffer, so every
    decode step would convert the whole pool (`decode_backends.move_as_bits`); on integers it does not."""
    dtype = jnp.dtype(dtype)
    return jnp.zeros(shape, jnp.uint16 if bits and dtype.itemsize == 2 else dtype)


def write_tokens(pool: jax.Array, pages: jax.Array, offsets: jax.Array, k: jax.Array, v: jax.Array,
                 dtype=None) -> jax.Array:
    """pool[d, pages[d, m], offsets[d, m]] = interleave(k[d, m], v[d, m]). pool [D, P, page, 2 KVH, Dh];
    pages, offsets [D, M] int32; k, v [D, M, KVH, Dh] (any float dtype), cast to `dtype` (the
    pool's values, default its dtype).

    The places are distinct but on the trash page (idle slots), which nothing reads, so the scatter
    says `unique_indices`: without it XLA:GPU writes each 16-bit element with a system-scope atomic
    compare-and-swap, 47% of a Qwen3-0.6B decode step's GPU time on an H100 (docs/gpu.md)."""
    d, m, kvh, dh = k.shape
    new = jnp.stack([k, v], axis=3).reshape(d, m, 2 * kvh, dh).astype(dtype or pool.dtype)
    if pool.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
    return jax.vmap(lambda p, i, o, x: p.at[i, o].set(x, unique_indices=True))(pool, pages, offsets, new)


def gather_pages(pool: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pool [D, P, page, 2 KVH, Dh], pages [D, S, C] -> keys, values [D, S, C, page, KVH, Dh]."""
    x = jax.vmap(lambda p, i: p[i])(pool, pages)
    return x[..., 0::2, :], x[..., 1::2, :]


def copy_pages(pool: jax.Array, dst: jax.Array, src: jax.Array) -> jax.Array:
    """pool[d, dst[d, m]] = pool[d, src[d, m]] (whole pages). dst, src [D, M] int32.

    Written token by token, as `write_tokens` writes (a scatter of [2 KVH, Dh] rows at (page,
    offset)): a whole-page scatter made XLA:TPU keep the pool in a second layout and copy every
    layer's whole pool into it and back at each refill (seen in the v5p compile of Qwen3-8B)."""
    d, m = dst.shape
    page = pool.shape[2]
    rows = jax.vmap(lambda p, j: p[j])(pool, src).reshape((d, m * page) + pool.shape[3:])
    pages = jnp.repeat(dst, page, axis=1)
    offsets = jnp.broadcast_to(jnp.tile(jnp.arange(page, dtype=jnp.int32), m), (d, m * page))
    return jax.vmap(lambda p, i, o, x: p.at[i, o].set(x, unique_indices=True))(pool, pages, offsets, rows)  # as write_tokens


def paged_attention(q: jax.Array, pool: jax.Array, table: jax.Array, counts: jax.Array, num_chunks, *,
                    pages_per_chunk: int, dtype, value_dtype=None) -> jax.Array:
    """One query per slot against its live pages: softmax(q K^T / sqrt(Dh)) V over the valid tokens.

    Two loops over the first num_chunks chunks of pages: scores into a [.., W * page] float32
    buffer, then (after one softmax over the buffer, -1e30 where not valid) probabilities cast to
    `dtype` times V. The same rounding as the static engine and the training forward (both
    round normalised probabilities); each page is read once.

    Args:
      q [D, S, KVH, H/KVH, Dh] float32.
      pool [D, pages, page, 2 KVH, Dh] (`write_tokens`).
      table [D, S, W] int32: each slot's logical pages (W a multiple of pages_per_chunk);
      counts [D, S, W] int32: valid tokens in each logical page (the first counts of its slots).
      num_chunks: int32 scalar, chunks of pages_per_chunk logical pages to read (every valid page
        of a slot must lie in the first num_chunks chunks).
      dtype: matmul input dtype (scores and softmax in float32); value_dtype: the pool's values
        (a uint16 pool holds their bits; default the pool's dtype).
    Returns: [D, S, KVH, H/KVH, Dh] float32.
    """
    value_dtype = value_dtype or pool.dtype
    d, s, kvh, hg, dh = q.shape
    page, width = pool.shape[2], table.shape[2]
    c = pages_per_chunk
    scale = dh**-0.5
    chunk = lambda a, i: jax.lax.dynamic_slice_in_dim(a, i * c, c, axis=2)  # [D, S, W] -> [D, S, C]

    def scores(i, buf):
        valid = jnp.arange(page) < chunk(counts, i)[..., None]  # [D, S, C, page]
        k, _ = gather_pages(pool, chunk(table, i))  # [D, S, C, page, KVH, Dh]
        k = as_values(k, value_dtype)
        sc = jnp.where(valid[:, :, None, None], einsum("dskhe,dscpke->dskhcp", q, k, dtype) * scale, _MASKED)
        return jax.lax.dynamic_update_slice_in_dim(buf, sc.reshape(d, s, kvh, hg, c * page), i * c * page, axis=4)

    buf = jax.lax.fori_loop(0, num_chunks, scores, jnp.full((d, s, kvh, hg, width * page), _MASKED, jnp.float32))
    probs = jax.nn.softmax(buf, axis=-1)

    def values(i, out):
        p = jax.lax.dynamic_slice_in_dim(probs, i * c * page, c * page, axis=4).reshape(d, s, kvh, hg, c, page)
        return out + einsum("dskhcp,dscpke->dskhe", p, as_values(gather_pages(pool, chunk(table, i))[1], value_dtype),
                            dtype)

    return jax.lax.fori_loop(0, num_chunks, values, jnp.zeros((d, s, kvh, hg, dh), jnp.float32))


def per_device(one_device, q, pool, table, kv_len, *, mesh=None, batch_axes=(), tensor_axis=None) -> jax.Array:
    """`one_device(q, pool, table, kv_len)` (a kernel's call on its device's share) on every device:
    under `shard_map` the shards D over `batch_axes` and the kv heads over `tensor_axis` (a device
    holds whole key/value column pairs: POOL_AXES splits the pool's 2 KVH axis); without a mesh,
    called once. Shapes as `kernel_paged_attention`."""
    if mesh is None:
        return one_device(q, pool, table, kv_len)
    rows = batch_axes or None
    return jax.shard_map(one_device, mesh=mesh,
                         in_specs=(P(rows, None, tensor_axis), P(rows, None, None, tensor_axis), P(rows), P(rows)),
                         out_specs=P(rows, None, tensor_axis), check_vma=False)(q, pool, table, kv_len)


def kernel_paged_attention(q: jax.Array, pool: jax.Array, table: jax.Array, kv_len: jax.Array, *, mesh=None,
                           batch_axes: tuple = (), tensor_axis: str | None = None,
                           block_sizes: dict | None = None) -> jax.Array:
    """`paged_attention` with the TPU ragged paged attention kernel
    (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), one query per slot, per shard.

    q [D, S, KVH, H/KVH, Dh] float32; pool [D, pages, page, 2 KVH, Dh]; table [D, S, W] int32 (a
    slot's tokens contiguous over its logical pages); kv_len [D, S] int32 (0 for idle slots, run
    as 1 token of the trash page). With a mesh the kernel runs per device (shard_map): D over
    `batch_axes`, kv heads over `tensor_axis`. block_sizes: the kernel's num_kv_pages_per_block /
    num_queries_per_block / vmem_limit_bytes (default: `kernel_blocks`, the blocks that fit the
    chip's scoped VMEM). A shard's slots go to the kernel in calls of `tpu_blocks.slots_per_call`
    (its page table is prefetched into 1 MiB of SMEM). Returns [D, S, KVH, H/KVH, Dh] float32.
    """
    kind = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).device_kind

    def one_device(q, pool, table, kv_len):
        d, s, kvh, hg, dh = q.shape
        per_call = slots_per_call(s, table.shape[-1])
        sizes = block_sizes if block_sizes is not None else kernel_blocks(
            kind, q_heads=kvh * hg, kv_heads=kvh, head_dim=dh, page_size=pool.shape[2], dtype=pool.dtype,
            queries=per_call, pages_per_slot=table.shape[-1]).kernel_args()
        outs = []
        for i in range(d):  # D is 1 per device under shard_map
            parts = []
            for a in range(0, s, per_call):  # slots a .. b - 1
                b = min(s, a + per_call)
                out = ragged_paged_attention(
                    q[i, a:b].reshape(b - a, kvh * hg, dh).astype(pool.dtype), pool[i], jnp.maximum(kv_len[i, a:b], 1),
                    table[i, a:b], jnp.arange(b - a + 1, dtype=jnp.int32), jnp.full((1,), b - a, jnp.int32),
                    sm_scale=dh**-0.5, **sizes)
                parts.append(out.reshape(b - a, kvh, hg, dh).astype(jnp.float32))
            outs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return jnp.stack(outs)

    return per_device(one_device, q, pool, table, kv_len, mesh=mesh, batch_axes=batch_axes, tensor_axis=tensor_axis)


def kernel_blocks(device_kind: str, **shape) -> RaggedBlocks:
    """The ragged paged attention kernel's blocks on a TPU of `device_kind` (e.g. "TPU v5") at a
    device's head shape (`tpu_blocks.ragged_blocks`: the kernel's own pick, cut to fit the chip's
    scoped VMEM), passed to the kernel on a TPU and when `plan` compiles for one from a CPU host
    (the kernel's own lookup reads the attached device); a ValueError saying why where none fits
    (`kernels.choice` falls back to XLA's path there first)."""
    blocks, why = ragged_blocks(device_kind, **shape)
    if blocks is None:
        raise ValueError(f"{why}; set rollout.decode_attention=xla")
    return blocks
