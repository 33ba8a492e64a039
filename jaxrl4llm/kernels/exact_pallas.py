"""The batch-invariant kernels of `model.numerics: exact` as Pallas kernels, for GPU and TPU.

The same contract as the C++ kernels of `kernels.exact` (csrc/exact.cc): an output element's value
depends only on its own inputs, never on how many rows the call has, where its row sits in a block
or a batch, or how the grid is split. Each kernel fixes its tiles (module constants, whatever the
shapes), and every sum that a token's value depends on runs in one order:

    matmul          y[m, n] = sum over K blocks, ascending, of dot(x[m, kb], w[kb, n])   tiles BLOCK_M x BLOCK_N x BLOCK_K
    attention       the keys of a query in sequence order: s_j = q . k_j / sqrt(Dh), one max over all
                    of them (order-free), then l += p_j, acc += p_j v_j key by key (a masked key adds
                    exact zeros), out = acc / l
    rms_inverse     1 / sqrt(sum_d x_d^2 / D + eps), d ascending
    token_logprob   (z_tok - max z) - log sum_v exp(z_v - max z), v ascending
    apply_rope      x cos + rotate_half(x) sin in one kernel body

A dot inside a fixed tile (the MXU's or the tensor cores' order for that tile shape) gives every row
of the tile the same arithmetic, so a decode step's few rows and a training batch's many get the
same bits. The values differ from the C++ kernels' (other exp, other dot hardware): exactness holds
between the sampler and the trainer on one platform.

`interpret=True` runs a kernel in Pallas' interpreter (tests on CPU: tests/kernels/test_exact_pallas.py
holds each kernel's invariance there). `kernels.exact` calls them off the CPU (`exact.use_pallas`), so
`model.numerics: exact` runs on one GPU or TPU; tests/kernels/test_exact.py runs the sampler-trainer
bit-equality test through them in the interpreter. `scripts/gpu_check --phases exact` runs the
invariance checks natively on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 128  # matmul tiles (TPU: multiples of 8 x 128; Triton: >= 16)
BLOCK_Q, BLOCK_KEYS = 16, 128  # attention: queries per program, keys per block
BLOCK_ROWS = 16  # rows per program of the row kernels (rms_inverse, token_logprob, apply_rope)
BLOCK_VOCAB = 128  # token_logprob: vocabulary columns per block


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# ---------------------------------------------------------------------------- matmul
def _matmul_kernel(x_ref, w_ref, o_ref, *, blocks_k: int):
    def add_block(kb, acc):
        xb = x_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
        wb = w_ref[pl.ds(kb * BLOCK_K, BLOCK_K), :]
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)

    o_ref[...] = jax.lax.fori_loop(0, blocks_k, add_block, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def matmul(x: jax.Array, w: jax.Array, *, interpret: bool = False) -> jax.Array:
    """y = x w: x [M, K], w [K, N] float32 -> [M, N] float32, K blocks summed in ascending order
    (zero padding to whole tiles adds exact zeros)."""
    m, n = x.shape[0], w.shape[1]
    xp = _pad_to(_pad_to(x.astype(jnp.float32), 0, BLOCK_M), 1, BLOCK_K)
    wp = _pad_to(_pad_to(w.astype(jnp.float32), 0, BLOCK_K), 1, BLOCK_N)
    k = xp.shape[1]
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, blocks_k=k // BLOCK_K),
        grid=(xp.shape[0] // BLOCK_M, wp.shape[1] // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)), pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], wp.shape[1]), jnp.float32),
        interpret=interpret,
    )(xp, wp)
    return out[:m, :n]


# ---------------------------------------------------------------------------- attention
def _attention_kernel(q_ref, k_ref, v_ref, r_ref, o_ref, *, blocks: int, scale: float):
    q = q_ref[0, 0]  # [BLOCK_Q, Dh]
    # the four bounds [BLOCK_Q, 1] each, loaded from the ref (Triton lowers no slice of a loaded value)
    a0, a1, b0, b1 = (r_ref[0, :, pl.ds(c, 1)] for c in range(4))

    def scores(j):  # [BLOCK_Q, BLOCK_KEYS], -inf where the query does not see the key
        keys = k_ref[0, 0, pl.ds(j * BLOCK_KEYS, BLOCK_KEYS), :]
        s = jnp.dot(q, keys.T, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST) * scale
        pos = j * BLOCK_KEYS + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        seen = ((pos >= a0) & (pos < a1)) | ((pos >= b0) & (pos < b1))
        return jnp.where(seen, s, -jnp.inf)

    top = jax.lax.fori_loop(0, blocks, lambda j, m: jnp.maximum(m, jnp.max(scores(j), axis=1)),
                            jnp.full((q.shape[0],), -jnp.inf, jnp.float32))
    top = jnp.where(top > -jnp.inf, top, 0.0)  # a query that sees no key: all p are 0

    column = jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], BLOCK_KEYS), 1)

    def add_block(j, carry):
        p = jnp.exp(scores(j) - top[:, None])

        def add_key(i, carry):  # key by key: the sum's order is the keys' order, each step the same code
            total, acc = carry
            p_i = jnp.sum(jnp.where(column == i, p, 0.0), axis=1)  # one value and exact zeros
            value = v_ref[0, 0, pl.ds(j * BLOCK_KEYS + i, 1), :]  # [1, Dh]
            return total + p_i, acc + p_i[:, None] * value

        return jax.lax.fori_loop(0, BLOCK_KEYS, add_key, carry)

    total, acc = jax.lax.fori_loop(0, blocks, add_block, (jnp.zeros((q.shape[0],), jnp.float32),
                                                          jnp.zeros(q.shape, jnp.float32)))
    o_ref[0, 0] = jnp.where(total[:, None] > 0, acc / jnp.where(total > 0, total, 1.0)[:, None], 0.0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, ranges: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`kernels.exact.attention`'s contract: q [B, T, H, Dh], k, v [B, S, KVH, Dh] float32 (already
    rounded), ranges [B, T, 4] int32 (a0, a1, b0, b1): query t sees keys [a0, a1) then [b0, b1) of
    its row. Returns [B, T, H, Dh] float32; a query that sees no key gets zeros."""
    b, t, h, dh = q.shape
    kvh = k.shape[2]
    group = h // kvh
    qh = _pad_to(q.astype(jnp.float32).transpose(0, 2, 1, 3), 2, BLOCK_Q)  # [B, H, T', Dh]
    kh = _pad_to(k.astype(jnp.float32).transpose(0, 2, 1, 3), 2, BLOCK_KEYS)  # [B, KVH, S', Dh]
    vh = _pad_to(v.astype(jnp.float32).transpose(0, 2, 1, 3), 2, BLOCK_KEYS)
    rp = _pad_to(ranges.astype(jnp.int32), 1, BLOCK_Q)  # padded queries see nothing
    s = kh.shape[2]
    out = pl.pallas_call(
        functools.partial(_attention_kernel, blocks=s // BLOCK_KEYS, scale=float(dh ** -0.5)),
        grid=(b, h, qh.shape[2] // BLOCK_Q),
        in_specs=[pl.BlockSpec((1, 1, BLOCK_Q, dh), lambda i, j, c: (i, j, c, 0)),
                  pl.BlockSpec((1, 1, s, dh), lambda i, j, c: (i, j // group, 0, 0)),
                  pl.BlockSpec((1, 1, s, dh), lambda i, j, c: (i, j // group, 0, 0)),
                  pl.BlockSpec((1, BLOCK_Q, 4), lambda i, j, c: (i, c, 0))],
        out_specs=pl.BlockSpec((1, 1, BLOCK_Q, dh), lambda i, j, c: (i, j, c, 0)),
        out_shape=jax.ShapeDtypeStruct(qh.shape, jnp.float32),
        interpret=interpret,
    )(qh, kh, vh, rp)
    return out[:, :, :t].transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------- rows
def _row_call(kernel, x: jax.Array, extra: list, out_width: int, interpret: bool) -> jax.Array:
    """kernel over blocks of BLOCK_ROWS rows of x [M, D] (and of each [M, ...] in `extra`) -> [M, out_width]."""
    m = x.shape[0]
    arrays = [_pad_to(a, 0, BLOCK_ROWS) for a in [x, *extra]]
    rows = arrays[0].shape[0]
    spec = lambda a: pl.BlockSpec((BLOCK_ROWS, *a.shape[1:]), lambda i: (i,) + (0,) * (a.ndim - 1))
    out = pl.pallas_call(kernel, grid=(rows // BLOCK_ROWS,), in_specs=[spec(a) for a in arrays],
                         out_specs=pl.BlockSpec((BLOCK_ROWS, out_width), lambda i: (i, 0)),
                         out_shape=jax.ShapeDtypeStruct((rows, out_width), jnp.float32), interpret=interpret)(*arrays)
    return out[:m]


def _ascending_sum(term, width: int, rows: int) -> jax.Array:
    """sum_{d < width} term(d) [rows, 1] for d ascending; one loop body for every d (XLA:CPU, in the
    interpreter, may contract a * b + c into an fma at some unrolled steps and not others)."""
    return jax.lax.fori_loop(0, width, lambda d, total: total + term(d), jnp.zeros((rows, 1), jnp.float32))


def _rms_kernel(x_ref, o_ref, *, eps: float):
    rows, width = x_ref.shape

    def square(d):
        column = x_ref[:, pl.ds(d, 1)]
        return column * column

    total = _ascending_sum(square, width, rows)
    o_ref[...] = 1.0 / jnp.sqrt(total / np.float32(width) + np.float32(eps))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_inverse(x: jax.Array, eps: float, *, interpret: bool = False) -> jax.Array:
    """1 / sqrt(mean(x^2, -1) + eps), the squares summed in ascending order: x [M, D] float32 -> [M]."""
    return _row_call(functools.partial(_rms_kernel, eps=eps), x.astype(jnp.float32), [], 1, interpret)[:, 0]


def _logprob_kernel(z_ref, t_ref, o_ref):
    """z [R, V'] (V' a multiple of BLOCK_VOCAB, padded with -inf: exp of a pad adds an exact 0), read
    in BLOCK_VOCAB-wide blocks or one column at a time (Triton takes power-of-two tiles only)."""
    rows, width = z_ref.shape
    block = lambda j: z_ref[:, pl.ds(j * BLOCK_VOCAB, BLOCK_VOCAB)]  # [R, BLOCK_VOCAB]
    column = jax.lax.broadcasted_iota(jnp.int32, (rows, BLOCK_VOCAB), 1)
    blocks = width // BLOCK_VOCAB
    top = jax.lax.fori_loop(0, blocks, lambda j, m: jnp.maximum(m, jnp.max(block(j), axis=1, keepdims=True)),
                            jnp.full((rows, 1), -jnp.inf, jnp.float32))
    total = _ascending_sum(lambda v: jnp.exp(z_ref[:, pl.ds(v, 1)] - top), width, rows)
    picked = jax.lax.fori_loop(  # one value and exact zeros
        0, blocks, lambda j, p: p + jnp.sum(jnp.where(j * BLOCK_VOCAB + column == t_ref[...], block(j), 0.0), axis=1,
                                            keepdims=True), jnp.zeros((rows, 1), jnp.float32))
    o_ref[...] = (picked - top) - jnp.log(total)


@functools.partial(jax.jit, static_argnames=("interpret",))
def token_logprob(z: jax.Array, tokens: jax.Array, *, interpret: bool = False) -> jax.Array:
    """(z_tok - max z) - log sum_v exp(z_v - max z), v ascending: z [M, V] float32, tokens [M] -> [M].
    (The pick is a sum of one value and exact zeros; V is padded with -inf to whole BLOCK_VOCAB blocks.)"""
    zp = _pad_to(z.astype(jnp.float32), 1, BLOCK_VOCAB, value=-jnp.inf)
    return _row_call(_logprob_kernel, zp, [tokens.astype(jnp.int32)[:, None]], 1, interpret)[:, 0]


def _rope_kernel(x_ref, c_ref, s_ref, o_ref):
    """x [R, N*Dh], cos, sin [R, Dh]: each half-head loaded from its ref (Triton lowers no slice of a
    loaded value)."""
    dh = c_ref.shape[1]
    half = dh // 2
    c_lo, c_hi = c_ref[:, pl.ds(0, half)], c_ref[:, pl.ds(half, half)]
    s_lo, s_hi = s_ref[:, pl.ds(0, half)], s_ref[:, pl.ds(half, half)]
    for head in range(x_ref.shape[1] // dh):
        a, b = x_ref[:, pl.ds(head * dh, half)], x_ref[:, pl.ds(head * dh + half, half)]
        o_ref[:, pl.ds(head * dh, half)] = a * c_lo - b * s_lo
        o_ref[:, pl.ds(head * dh + half, half)] = b * c_hi + a * s_hi


@functools.partial(jax.jit, static_argnames=("interpret",))
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interpret: bool = False) -> jax.Array:
    """x cos + rotate_half(x) sin in one kernel body: x [M, N, Dh], cos, sin [M, Dh] -> [M, N, Dh]."""
    m, n, dh = x.shape
    out = _row_call(_rope_kernel, x.reshape(m, n * dh).astype(jnp.float32), [cos, sin], n * dh, interpret)
    return out.reshape(m, n, dh)
