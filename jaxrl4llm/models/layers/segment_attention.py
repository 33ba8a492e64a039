"""Causal attention within segments, given as ids (never as a [T, T] mask), with one backend per platform.

    out_t = sum_s softmax_s(q_t . k_s / sqrt(Dh) ; s <= t and segment_ids[s] == segment_ids[t]) v_s

One interface for both row layouts of the trainer: packed rows (several sequences per row,
segment ids 1, 2, 3, ... and 0 on the trailing padding; MaxText's `segmentation`) and
left-padded rows (segment_ids = attention_mask: 1 real, 0 padding). A token always sees
itself, so no softmax row is empty: padding tokens produce finite values and gradients.

Backends (`impl`):
- "xla": block-causal flash attention in XLA loops: query block i visits key blocks from the one
  where its queries' segments begin up to i only (the upper triangle of blocks, and in packed
  rows the blocks of earlier sequences, are never computed), each [block, block] mask built
  from the ids, online softmax forward and a recomputing custom backward (one score tile live
  at a time, O(T) residuals). Runs everywhere; the CPU default.
- "splash": `jax.experimental.pallas.ops.tpu.splash_attention` (causal mask + SegmentIds; the
  causally masked blocks skipped), inside a shard_map over the mesh when one is set. The TPU default.
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.attention.mha` (Triton flash attention with
  causal + segment ids). The GPU default.
- "cudnn": cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) does
  not take segment ids, only per-row lengths of right-padded rows: refused with an error.
- "exact": the batch-invariant C++ kernel of `model.numerics=exact` (`kernels.exact.attention`: each
  query's keys in sequence order, the sampler's kernel too; one CPU device).
- "auto": by the platform of the mesh being compiled for (`jax.set_mesh`), else the default backend
  (the rule: `kernels.choice.train_attention_choice`, which `train.layout` resolves for a run).
A Pallas backend forced on a platform that cannot run it natively (splash on CPU) runs the
kernel in Pallas interpret mode: the kernel's own semantics, slowly (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl4llm.kernels import exact as exact_numerics
from jaxrl4llm.kernels.choice import train_attention_choice
from jaxrl4llm.models.sharding import DEFAULT_RULES, logical_to_spec

DEFAULT_BLOCKS = {"xla": 128, "splash": 512, "pallas_gpu": 128}
_MASKED = -1e30  # the score of a masked pair (finite: no inf - inf in the online softmax)
_PAD_SEGMENT = -1  # the segment of the positions a backend pads T with (after every real token)
_SPLASH_LANES = 128  # splash block sizes are multiples of the TPU lane width
GPU_SHARED_MEMORY = 227 * 1024  # bytes of shared memory a thread block may use on an H100 (sm_90)
_GPU_STAGES = 2  # software-pipelining stages of JAX's Triton flash kernels (mha's num_stages; its backward's)
_GPU_MAX_FORWARD_BLOCK = 128  # JAX's default forward block_q = block_k (BlockSizes.get_default)
_GPU_MAX_BACKWARD_BLOCK = 32  # JAX's default backward blocks (BlockSizes.get_default)
_GPU_MIN_BLOCK = 16  # Triton's dot takes operands of at least 16 rows and columns


def compile_platform() -> str:
    """The platform being compiled for: the mesh's (`jax.set_mesh(mesh)`, e.g. a TPU topology
    on this CPU host) when one is set, else `jax.default_backend()` ("cpu", "tpu", "gpu")."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return mesh.abstract_device.platform
    return jax.default_backend()


def resolve_impl(impl: str, numerics: str = "default") -> str:
    """"auto" -> the backend of `compile_platform()` (TPU splash, GPU pallas_gpu, else xla);
    a forced name is returned as is (`kernels.choice.train_attention_choice`: unknown names and
    "cudnn" raise ValueError saying why)."""
    return train_attention_choice(impl, compile_platform(), numerics).kernel


def segment_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                             dtype: jnp.dtype, impl: str = "auto", block: int | None = None,
                             numerics: str = "default") -> jax.Array:
    """out_t = softmax_s(q_t . k_s / sqrt(Dh) ; s <= t, segment_ids[s] == segment_ids[t]) v_s.

    Args:
      q [B, T, H, Dh]; k, v [B, T, KVH, Dh] (RoPE applied; H a multiple of KVH: grouped-query).
      segment_ids [B, T] int: tokens attend within their segment (packed: 1, 2, ... and 0 on
        padding; left-padded: the attention mask).
      dtype: matmul input dtype (bf16 x bf16 -> f32 accumulation); scores and softmax are float32.
      impl: "auto" | "xla" | "splash" | "pallas_gpu" | "cudnn" (module docstring).
      block: query/key block size of the "xla" path and the largest kernel block; None: the
        backend's default (`DEFAULT_BLOCKS`: xla 128, the fastest measured on CPU by
        benchmarks/segment_attention.py; splash 512, MaxText's; pallas_gpu 128).
      numerics: `model.numerics`; "exact" runs the "exact" backend whatever `impl` says.
    Returns [B, T, H, Dh] float32. No [B, T, T] array is built by any backend.
    """
    b, t, h, dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != dh or h % k.shape[2]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q [B, T, H, Dh] and k, v [B, T, KVH, Dh] "
                         f"with H a multiple of KVH")
    if segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {(b, t)}")
    dtype = jnp.dtype(dtype)
    segment_ids = segment_ids.astype(jnp.int32)
    impl = resolve_impl(impl, numerics)
    if impl == "exact":
        return exact_numerics.attention(q, k, v, exact_numerics.segment_ranges(segment_ids), dtype=dtype)
    block = block or DEFAULT_BLOCKS.get(impl, 128)
    if impl == "xla":
        return block_causal_attention(q, k, v, segment_ids, dtype=dtype, block=block)
    if impl == "splash":
        return _on_mesh(functools.partial(_splash_attention, dtype=dtype, block=block,
                                          interpret=compile_platform() != "tpu"), q, k, v, segment_ids)
    if impl == "pallas_gpu":
        return _on_mesh(functools.partial(_pallas_gpu_attention, dtype=dtype, block=block,
                                          interpret=compile_platform() not in ("gpu", "cuda", "rocm")),
                        q, k, v, segment_ids)
    raise AssertionError(impl)  # resolve_impl names one of the three


def block_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                           dtype: jnp.dtype, block: int = 128) -> jax.Array:
    """The "xla" backend: flash attention in XLA loops over the blocks on and below the diagonal.

    q [B, T, H, Dh]; k, v [B, T, KVH, Dh]; segment_ids [B, T]. Returns [B, T, H, Dh] float32.
    T is padded up to n blocks of `block` (padded positions form their own segment after every
    real token). For query block i a loop runs over key blocks j = first_key_blocks[i]..i only:
    neither the upper triangle of blocks nor the blocks before the segments of block i's queries
    begin are computed (packed rows of short sequences skip most of the triangle). Each
    [block, block] mask is built from the ids, with the online softmax of FlashAttention
    (Dao et al. 2022, arXiv 2205.14135):
        m' = max(m, rowmax S_ij), l' = l e^(m - m') + rowsum e^(S_ij - m'),
        acc' = acc e^(m - m') + e^(S_ij - m') V_j,  O_i = acc / l,  LSE_i = m + log l.
    The backward (a custom VJP) recomputes P_ij = e^(S_ij - LSE_i) block by block:
        dS = P (dO V^T - rowsum(dO O)),  dQ_i += dS K_j,  dK_j += dS^T Q_i,  dV_j += P^T dO_i.
    Loops, not unrolled blocks, so one [B, H, block, block] score tile is live at a time (XLA may
    schedule unrolled blocks all at once), and only O(T) residuals (q, k, v, O, LSE) are kept.
    The G = H / KVH query heads of a kv head share its key tiles ([B, KVH, G, block, Dh]).
    """
    b, t, h, dh = q.shape
    kvh = k.shape[2]
    block = min(block, t)
    n = -(-t // block)
    pad = n * block - t
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT)
    qb = widen(q).reshape(b, n, block, kvh, h // kvh, dh).transpose(1, 0, 3, 4, 2, 5)  # [n, B, KVH, G, blk, Dh]
    kb, vb = (widen(x).reshape(b, n, block, kvh, dh).transpose(1, 0, 3, 2, 4) for x in (k, v))  # [n, B, KVH, blk, Dh]
    sb = segment_ids.reshape(b, n, block).transpose(1, 0, 2)  # [n, B, blk]
    out = _flash(qb, kb, vb, sb, first_key_blocks(segment_ids, block), jnp.dtype(dtype))  # [n, B, KVH, G, blk, Dh]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * block, h, dh)[:, :t]


def first_key_blocks(segment_ids: jax.Array, block: int) -> jax.Array:
    """first[i] = min over rows b and queries t of block i of (first position of segment_ids[b, t]
    in row b) // block: no query of block i sees a key before block first[i].

    segment_ids [B, T] (T a multiple of `block`) -> [T / block] int32. Exact for any layout (a
    segment id may recur anywhere in its row): the first position of each token's id comes from a
    stable sort of the row's ids.
    """
    b, t = segment_ids.shape
    order = jnp.argsort(segment_ids, axis=1, stable=True)  # positions grouped by id, ascending within an id
    ids = jnp.take_along_axis(segment_ids, order, axis=1)
    new_id = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    group_start = jax.lax.cummax(jnp.where(new_id, jnp.arange(t), 0), axis=1)
    first_sorted = jnp.take_along_axis(order, group_start, axis=1)  # the smallest position of each id
    first = jnp.take_along_axis(first_sorted, jnp.argsort(order, axis=1), axis=1)  # [B, T], back in row order
    return (first.reshape(b, t // block, block).min(axis=(0, 2)) // block).astype(jnp.int32)


def _mm(spec: str, x: jax.Array, y: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """einsum of x and y cast to `dtype`, accumulated and returned in float32 (as linear.einsum)."""
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jnp.einsum(spec, x.astype(dtype), y.astype(dtype), preferred_element_type=jnp.float32, precision=precision)


def _tile_mask(sb: jax.Array, i, j) -> jax.Array:
    """May query block i see key block j: [B, 1, 1, blk, blk] (same segment, key position <= query position)."""
    blk = sb.shape[-1]
    causal = (i * blk + jnp.arange(blk))[:, None] >= (j * blk + jnp.arange(blk))[None, :]
    return (causal[None] & (sb[i][:, :, None] == sb[j][:, None, :]))[:, None, None]


def _flash_forward(qb, kb, vb, sb, first, dtype):
    """(O [n, B, KVH, G, blk, Dh], LSE [n, B, KVH, G, blk]) of `block_causal_attention`."""
    scale = qb.shape[-1] ** -0.5

    def query_block(i):
        q_i = qb[i]

        def key_block(j, carry):
            m, l, acc = carry
            allowed = _tile_mask(sb, i, j)
            s = jnp.where(allowed, _mm("bkgqd,bksd->bkgqs", q_i, kb[j], dtype) * scale, _MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            return m_new, l * correction + p.sum(-1), acc * correction[..., None] + _mm("bkgqs,bksd->bkgqd", p, vb[j],
                                                                                        dtype)

        m0 = jnp.full(q_i.shape[:-1], _MASKED, jnp.float32)
        m, l, acc = jax.lax.fori_loop(first[i], i + 1, key_block,
                                      (m0, jnp.zeros_like(m0), jnp.zeros(q_i.shape, jnp.float32)))
        return acc / l[..., None], m + jnp.log(l)  # l >= 1: a token always sees itself

    return jax.lax.map(query_block, jnp.arange(qb.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(qb, kb, vb, sb, first, dtype):
    return _flash_forward(qb, kb, vb, sb, first, dtype)[0]


def _flash_fwd(qb, kb, vb, sb, first, dtype):
    out, lse = _flash_forward(qb, kb, vb, sb, first, dtype)
    return out, (qb, kb, vb, sb, first, out, lse)


def _flash_bwd(dtype, residuals, d_out):
    qb, kb, vb, sb, first, out, lse = residuals
    scale = qb.shape[-1] ** -0.5
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO O) [n, B, KVH, G, blk]

    def query_block(carry, i):
        q_i, do_i, lse_i, delta_i = qb[i], d_out[i], lse[i], delta[i]

        def key_block(j, c):
            dq_i, dk, dv = c
            s = _mm("bkgqd,bksd->bkgqs", q_i, kb[j], dtype) * scale
            p = jnp.where(_tile_mask(sb, i, j), jnp.exp(s - lse_i[..., None]), 0.0)
            ds = p * (_mm("bkgqd,bksd->bkgqs", do_i, vb[j], dtype) - delta_i[..., None])
            dq_i = dq_i + _mm("bkgqs,bksd->bkgqd", ds, kb[j], dtype) * scale
            dk = dk.at[j].add(_mm("bkgqs,bkgqd->bksd", ds, q_i, dtype) * scale)
            dv = dv.at[j].add(_mm("bkgqs,bkgqd->bksd", p, do_i, dtype))
            return dq_i, dk, dv

        dq_i, dk, dv = jax.lax.fori_loop(first[i], i + 1, key_block, (jnp.zeros(q_i.shape, jnp.float32), *carry))
        return (dk, dv), dq_i

    zeros = jnp.zeros(kb.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(qb.shape[0]))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def kernel_attention_flops(batch: int, seq: int, heads: int, head_dim: int, *, block: int = 512,
                           backward: bool = False, impl: str = "splash") -> int:
    """FLOPs of the causal kernels (splash, pallas_gpu) that XLA's cost analysis cannot see (a
    custom call counts as no FLOPs): the n (n + 1) / 2 query x key blocks of n = ceil(T / block)
    on and below the diagonal, 2 FLOPs a multiply-add, 2 matmuls of block^2 Dh each per block and
    query head (S = Q K^T, O = P V):

        forward = B H n (n + 1) / 2 * 4 block^2 Dh
        splash backward = 2.5 forward (scores recomputed, then dP = dO V^T, dV = P^T dO,
          dQ = dS K, dK = dS^T Q: 5 matmuls against 2)
        pallas_gpu backward = B H m (m + 1) / 2 * 14 b^2 Dh over its own blocks b (m = T' / b):
          the fused kernel recomputes S in each of its two phases (dK/dV: S, dP, dV, dK; dQ: S, dP, dQ).
    The blocks are the kernel's own (`_splash_block`, `pallas_gpu_blocks` of `block`). Segment
    ids mask inside the blocks and skip none of them.
    """
    if impl == "pallas_gpu":
        blocks = pallas_gpu_blocks(seq, head_dim, block)
        triangle = lambda b: (blocks.padded // b) * (blocks.padded // b + 1) // 2 * b * b
        if backward:
            return batch * heads * triangle(blocks.backward) * 14 * head_dim
        return batch * heads * triangle(blocks.forward) * 4 * head_dim
    block = _splash_block(seq, block)
    n = -(-seq // block)
    forward = batch * heads * n * (n + 1) // 2 * 4 * block * block * head_dim
    return int(forward * 2.5) if backward else forward


class GpuFlashBlocks(NamedTuple):
    """The Triton flash attention's blocks for rows of T (`pallas_gpu_blocks`)."""

    forward: int  # block_q = block_k of the forward kernel
    backward: int  # block_q_dkv = block_kv_dkv = block_q_dq = block_kv_dq of the fused backward kernel
    padded: int  # T padded up to a multiple of both


def pallas_gpu_shared_memory(block: int, head_dim: int, *, backward: bool, itemsize: int = 2) -> int:
    """Bytes of shared memory a program of JAX's Triton flash kernel stages (an upper estimate),
    blocks of `block` rows, Dh padded to a power of two (as the kernel pads it), e = itemsize:

        forward  = e (b Dh + stages 2 b Dh + b^2)     Q held; K, V pipelined; P (input dtype) for P V
        backward = e (2 b Dh + stages 2 b Dh + 2 b^2)  two tiles held (K, V; then Q, dO), two
                   pipelined (Q, dO; then K, V); P^T and dS^T for the transposed matmuls
    """
    dh = 1 << max(head_dim - 1, 0).bit_length()
    held = 2 if backward else 1
    return itemsize * (held * block * dh + _GPU_STAGES * 2 * block * dh + held * block * block)


def pallas_gpu_blocks(t: int, head_dim: int, block: int = 128, *, itemsize: int = 2) -> GpuFlashBlocks:
    """The blocks of the "pallas_gpu" backend for rows of T positions; the one rule the kernel call,
    `kernel_attention_flops` and `plan` read.

    Triton blocks are powers of two of at least 16 rows (its dot's minimum). The forward block is
    the largest power of two <= min(`block`, 128 (JAX's default), T rounded up to a power of two)
    whose `pallas_gpu_shared_memory` fits `GPU_SHARED_MEMORY` (H100: 227 KB): 128 up to Dh 128,
    64 at Dh 256 in bf16. The backward blocks are JAX's default 32 (`BlockSizes.get_default`; at
    most the forward's, and halved while over the budget): its fused kernel holds two float32
    accumulators [b, Dh] (dK and dV) in registers besides its tiles, 32 KB at b = 32 and Dh 128
    (64 registers a thread at the 4 warps JAX runs it with); b = 64 would take 128 (256 at Dh 256)
    and spill. The estimate bounds what XLA's Triton compiler for sm_90 asks (compile-only, jax
    0.10.2): forward b = 128 at Dh 256 asks 328192 bytes (estimate 360448), backward b = 128 at
    Dh 256 427520 (estimate 458752); both refused (232448 available). T is padded to a multiple of
    the forward block (so of the backward one too: the fused backward needs the same count of query
    and key blocks, both powers of two dividing T').

    Args: t: positions of a row; head_dim: Dh; block: the largest forward block wanted
      (`DEFAULT_BLOCKS["pallas_gpu"]`); itemsize: bytes of the matmul inputs (bf16: 2).
    """
    pow2_floor = lambda n: 1 << (max(int(n), 1).bit_length() - 1)
    pow2_ceil = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    fits = lambda b, backward: pallas_gpu_shared_memory(b, head_dim, backward=backward,
                                                        itemsize=itemsize) <= GPU_SHARED_MEMORY
    forward = max(min(pow2_floor(block), _GPU_MAX_FORWARD_BLOCK, pow2_ceil(t)), _GPU_MIN_BLOCK)
    while forward > _GPU_MIN_BLOCK and not fits(forward, False):
        forward //= 2
    backward = min(forward, _GPU_MAX_BACKWARD_BLOCK)
    while backward > _GPU_MIN_BLOCK and not fits(backward, True):
        backward //= 2
    return GpuFlashBlocks(forward, backward, -(-t // forward) * forward)


def _on_mesh(kernel, q, k, v, segment_ids):
    """Run a per-device kernel(q, k, v, segment_ids) on the current mesh (`jax.set_mesh`): a
    shard_map with the batch over the "batch" rule's axes and the heads over "tensor" (the kv
    heads repeated to H when "tensor" divides H but not KVH). Without a mesh, or already inside
    a shard_map, the kernel runs directly."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return kernel(q, k, v, segment_ids)
    b, t, h, _ = q.shape
    kvh = k.shape[2]
    heads = logical_to_spec(("heads",), DEFAULT_RULES, shape=(h,), mesh=mesh)[0]
    if heads is not None and logical_to_spec(("kv_heads",), DEFAULT_RULES, shape=(kvh,), mesh=mesh)[0] != heads:
        k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)
    batch = logical_to_spec(("batch",), DEFAULT_RULES, shape=(b,), mesh=mesh)[0]
    qkv_spec = PartitionSpec(batch, None, heads, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, PartitionSpec(batch, None)),
                         out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids)


def _pad_sequence(q, k, v, segment_ids, multiple: int):
    """Pad T up to a multiple of `multiple` (padded positions: their own segment, after all real ones)."""
    t = q.shape[1]
    pad = -(-t // multiple) * multiple - t
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return widen(q), widen(k), widen(v), jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT)


def _splash_block(t: int, block: int) -> int:
    """The splash block size for rows of T: `block` rounded down to the lane width (128), at most T
    rounded up to it."""
    return min(max(block // _SPLASH_LANES, 1) * _SPLASH_LANES, -(-t // _SPLASH_LANES) * _SPLASH_LANES)


def _splash_attention(q, k, v, segment_ids, *, dtype, block: int, interpret: bool):
    """The "splash" backend on one device's shard: q [B, T, H, Dh], k, v [B, T, KVH, Dh].

    The kernel takes [H, T, Dh] / [KVH, T, Dh] per row (grouped-query heads natively), applies
    no 1/sqrt(Dh) (q is scaled first) and needs T a multiple of its blocks (padded here).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, h, dh = q.shape
    blk = _splash_block(t, block)
    q = (q * dh**-0.5).astype(dtype)
    q, k, v, segment_ids = _pad_sequence(q, k.astype(dtype), v.astype(dtype), segment_ids, blk)
    tp = q.shape[1]
    mask = splash.MultiHeadMask([splash.CausalMask((tp, tp)) for _ in range(h)])
    sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                              block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    heads_major = lambda x: x.transpose(0, 2, 1, 3)
    out = jax.vmap(kernel)(heads_major(q), heads_major(k), heads_major(v),
                           splash.SegmentIds(q=segment_ids, kv=segment_ids))  # [B, H, T, Dh]
    return heads_major(out)[:, :t].astype(jnp.float32)


def _pallas_gpu_attention(q, k, v, segment_ids, *, dtype, block: int, interpret: bool):
    """The "pallas_gpu" backend on one device's shard: Pallas/Triton flash attention (`mha`,
    causal + segment ids), kv heads repeated to H (the kernel has no grouped-query heads), T padded
    to the blocks of `pallas_gpu_blocks`."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    b, t, h, dh = q.shape
    g = h // k.shape[2]
    blocks = pallas_gpu_blocks(t, dh, block, itemsize=jnp.dtype(dtype).itemsize)
    q, k, v, segment_ids = _pad_sequence(q.astype(dtype), jnp.repeat(k, g, axis=2).astype(dtype),
                                         jnp.repeat(v, g, axis=2).astype(dtype), segment_ids, blocks.forward)
    fwd, bwd = blocks.forward, blocks.backward
    sizes = gpu_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd,
                                     block_kv_dq=bwd)
    out = gpu_attention.mha(q, k, v, segment_ids, sm_scale=dh**-0.5, causal=True, block_sizes=sizes,
                            interpret=interpret)
    return out[:, :t].astype(jnp.float32)
