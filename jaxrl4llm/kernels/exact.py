"""`model.numerics: exact`: the batch-invariant operations that make the sampler's log-probs equal
the trainer's bit for bit (docs/objectives.md, "Sampler-trainer agreement").

Every reduction of the forward runs in one fixed order that depends only on the reduced values,
never on the number of rows, a row's place in its batch or packed row, or the thread split
(the C++ kernels of csrc/exact.cc on a CPU device, the Pallas kernels of `kernels.exact_pallas` on a
GPU or TPU: `use_pallas`; one device either way):

    matmul     y[m, n] = fma(x[m, K-1], w[K-1, n], ... fma(x[m, 0], w[0, n], 0))     k ascending
    sums       ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)),  p_l = sum_{k = l mod 8} a_k  (RMSNorm,
               the log-softmax's normaliser; exp, log, sqrt, cos and sin by libm, in C++ too)
    rope       x cos + rotate_half(x) sin with both products rounded before the sum
    attention  out_t = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s),  s_j = (q_t . k_j) / sqrt(Dh),
               j over the keys t sees in sequence order (its prompt's real tokens, then its response)

The prefill, the decode step and the training forward all call these on the same rounded inputs
(matmul inputs rounded to `config.dtype` and back to float32, keys and values to the cache's
dtype), so a token's hidden states, logits and log-prob do not depend on which program computed
them. Products, residual adds and SiLU stay XLA ops: their value is a function of the element alone.
XLA's reductions are not (XLA:CPU sums a row of a batch of fewer than 8 rows in another order than
one of a larger batch), nor its dot, nor its exp and log (the vectorised loop and its scalar
remainder round differently, so a value depends on where it falls in the array), nor a * b + c (one
fma where the product and the sum share a fusion, two roundings where they do not: RoPE).

Backward passes use XLA's ops (`custom_vjp`): gradients need not be bit-exact, only the forward
that the PPO ratio compares with the sampler's log-probs.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.kernels import exact_pallas, native

# Which kernels run exact numerics: the C++ CPU kernels on a CPU device, the Pallas kernels of
# `kernels.exact_pallas` on a GPU or TPU. JAXRL4LLM_EXACT_KERNELS=pallas takes the Pallas kernels on a
# CPU too, in Pallas' interpreter (tests of the GPU / TPU route on CPU).
KERNELS_ENV = "JAXRL4LLM_EXACT_KERNELS"


def use_pallas() -> bool:
    """Whether this process's exact numerics run the Pallas kernels (read at trace time: one device,
    the process's default backend)."""
    return jax.default_backend() != "cpu" or os.environ.get(KERNELS_ENV, "") == "pallas"


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def require(devices=None) -> None:
    """Raise ValueError naming the fix unless exact numerics can run here: one device; on a CPU the
    C++ kernels build and load (`devices`: the program's; None: this process's first)."""
    devices = jax.devices()[:1] if devices is None else list(devices)
    platforms = {d.platform for d in devices}
    if len(devices) != 1:
        raise ValueError(f"model.numerics=exact runs on one device (its kernels are not partitioned); this "
                         f"program runs on {len(devices)} {'/'.join(sorted(platforms))} devices. Use "
                         f"model.numerics=default here, or one device")
    if platforms != {"cpu"} or use_pallas():
        return  # the Pallas kernels (kernels/exact_pallas.py)
    try:
        native.require_kernels()
    except native.KernelBuildError as error:
        raise ValueError(f"model.numerics=exact needs the C++ CPU kernels, which are unavailable: {error}") from None


def _call(name: str, out_shape, out_dtype, *args, outputs: int = 1, **attrs):
    """ffi_call of one of csrc/exact.cc's kernels (`outputs` > 1: a tuple of that many arrays of one
    shape), built and registered on first use (at trace time)."""
    native.require_kernels()
    result = jax.ShapeDtypeStruct(out_shape, out_dtype)
    return jax.ffi.ffi_call(name, result if outputs == 1 else (result,) * outputs)(*args, **attrs)


def rounded(x: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype` and held as float32 (what a `dtype` matmul input holds)."""
    return x.astype(dtype).astype(jnp.float32)


# ---------------------------------------------------------------------------- matmul
@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """y = x w: x [M, K], w [K, N] float32 -> [M, N] float32, each y[m, n] one fma chain over k ascending."""
    if use_pallas():
        return exact_pallas.matmul(x, w, interpret=_interpret())
    return _call("jaxrl4llm_exact_matmul", (x.shape[0], w.shape[1]), jnp.float32, x, w)


def _matmul_fwd(x, w):
    return matmul(x, w), (x, w)


def _matmul_bwd(residuals, ct):
    x, w = residuals
    hi = jax.lax.Precision.HIGHEST
    return jnp.matmul(ct, w.T, precision=hi), jnp.matmul(x.T, ct, precision=hi)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.lru_cache(maxsize=None)
def _einsum_plan(spec: str) -> tuple[str, str, int, tuple[int, ...]]:
    """(x's order [free..., contracted...], w's [contracted..., free...], contracted indices, y -> out permutation)."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    contracted = "".join(c for c in a if c in b and c not in out)
    x_free, w_free = "".join(c for c in a if c not in contracted), "".join(c for c in b if c not in contracted)
    if set(x_free) & set(w_free) or sorted(x_free + w_free) != sorted(out):
        raise ValueError(f"exact einsum {spec!r}: only contractions without batch indices (x [free, K], w [K, free])")
    computed = x_free + w_free
    return x_free + contracted, contracted + w_free, len(contracted), tuple(computed.index(c) for c in out)


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """`layers.linear.einsum` in exact numerics: y = einsum(spec, x, w) with inputs rounded to `dtype`,
    float32 out, as one batch-invariant `matmul` ([rows of x, contracted] x [contracted, columns of w])."""
    a, b = spec.replace(" ", "").split("->")[0].split(",")
    x_order, w_order, contracted, to_out = _einsum_plan(spec)
    xt = jnp.transpose(x, [a.index(c) for c in x_order])
    wt = jnp.transpose(w, [b.index(c) for c in w_order])
    rows_shape, cols_shape = xt.shape[:xt.ndim - contracted], wt.shape[contracted:]
    y = matmul(rounded(xt, dtype).reshape(int(np.prod(rows_shape)), -1),
               rounded(wt, dtype).reshape(-1, int(np.prod(cols_shape))))
    return jnp.transpose(y.reshape(*rows_shape, *cols_shape), to_out)


# ---------------------------------------------------------------------------- reductions
def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _rms_inverse_reference(x, eps):
    return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_inverse(x: jax.Array, eps: float) -> jax.Array:
    """1 / sqrt(mean(x^2, -1) + eps): x [..., D] float32 -> [...], the sum in the fixed order."""
    if use_pallas():
        return exact_pallas.rms_inverse(_rows(x), float(eps), interpret=_interpret()).reshape(x.shape[:-1])
    out = _call("jaxrl4llm_exact_rms_inverse", (_rows(x).shape[0],), jnp.float32, _rows(x), eps=np.float32(eps))
    return out.reshape(x.shape[:-1])


def _rms_inverse_bwd(eps, x, ct):
    return (jax.vjp(lambda x: _rms_inverse_reference(x, eps), x)[1](ct)[0],)


rms_inverse.defvjp(lambda x, eps: (rms_inverse(x, eps), x), _rms_inverse_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """`layers.norm.rms_norm` in exact numerics: y = x * rms_inverse(x) * scale, [..., D] float32."""
    x = x.astype(jnp.float32)
    return x * rms_inverse(x, float(eps))[..., None] * scale.astype(jnp.float32)


@jax.custom_vjp
def _token_logprob(z, tokens):
    if use_pallas():
        return exact_pallas.token_logprob(z, tokens, interpret=_interpret())
    return _call("jaxrl4llm_exact_token_logprob", (z.shape[0],), jnp.float32, z, tokens)


def _token_logprob_bwd(residuals, ct):
    z, tokens = residuals
    grad = jax.nn.one_hot(tokens, z.shape[-1], dtype=jnp.float32) - jax.nn.softmax(z, axis=-1)
    return ct[:, None] * grad, np.zeros(tokens.shape, jax.dtypes.float0)


_token_logprob.defvjp(lambda z, tokens: (_token_logprob(z, tokens), (z, tokens)), _token_logprob_bwd)


def token_logprobs(z: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(z)[token] = (z_tok - max z) - log sum_v exp(z_v - max z), all in C++ (the sum in the
    fixed order): z [..., V] float32 (logits already divided by the temperature), tokens [...] -> [...].
    Tokens outside [0, V) are clipped."""
    flat = _token_logprob(_rows(z), jnp.clip(tokens.reshape(-1), 0, z.shape[-1] - 1).astype(jnp.int32))
    return flat.reshape(tokens.shape)


# ---------------------------------------------------------------------------- rotary embedding
def rope_tables(positions: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """`layers.rope.rope_tables` in C++: cos, sin of float(position) * inv_freq, halves duplicated.
    positions [...] int; inv_freq [Dh/2] float32 -> (cos, sin) [..., Dh] float32."""
    flat = positions.reshape(-1).astype(jnp.int32)
    dh = 2 * len(inv_freq)
    if use_pallas():  # element-wise on a GPU or TPU: every element's cos and sin by one code path
        angles = flat.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None]
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles).reshape(*positions.shape, dh), jnp.sin(angles).reshape(*positions.shape, dh)
    cos, sin = _call("jaxrl4llm_exact_rope_tables", (flat.shape[0], dh), jnp.float32, flat,
                     jnp.asarray(inv_freq, jnp.float32), outputs=2)
    return cos.reshape(*positions.shape, dh), sin.reshape(*positions.shape, dh)


def _apply_rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


@jax.custom_vjp
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`layers.rope.apply_rope` in C++, each product rounded before the sum: x [B, T, N, Dh] float32;
    cos, sin [B, T, Dh] -> [B, T, N, Dh]."""
    b, t, n, dh = x.shape
    if use_pallas():
        return exact_pallas.apply_rope(x.reshape(b * t, n, dh), cos.reshape(b * t, dh), sin.reshape(b * t, dh),
                                       interpret=_interpret()).reshape(x.shape)
    out = _call("jaxrl4llm_exact_apply_rope", (b * t, n, dh), jnp.float32, x.reshape(b * t, n, dh),
                cos.reshape(b * t, dh), sin.reshape(b * t, dh))
    return out.reshape(x.shape)


def _apply_rope_bwd(residuals, ct):
    x, cos, sin = residuals
    _, pullback = jax.vjp(_apply_rope_reference, x, cos, sin)
    return pullback(ct)


apply_rope.defvjp(lambda x, cos, sin: (apply_rope(x, cos, sin), (x, cos, sin)), _apply_rope_bwd)


# ---------------------------------------------------------------------------- attention
def segment_ranges(segment_ids: jax.Array) -> jax.Array:
    """The keys each position sees under segment-causal attention, as `attention`'s ranges: position t
    of row b sees [start of its run of equal ids, t] (packed segments, and left-padded rows with the
    attention mask as ids). segment_ids [B, T] -> ranges [B, T, 4] int32 (start, t + 1, 0, 0)."""
    b, t = segment_ids.shape
    index = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    zero = jnp.zeros_like(start)
    return jnp.stack([start, jnp.broadcast_to(index + 1, start.shape), zero, zero], axis=-1)


def ranges_mask(ranges: jax.Array, num_keys: int) -> jax.Array:
    """ranges [B, T, 4] -> the "may attend" mask [B, T, S] they describe."""
    s = jnp.arange(num_keys, dtype=jnp.int32)
    inside = lambda lo, hi: (s >= ranges[..., lo, None]) & (s < ranges[..., hi, None])
    return inside(0, 1) | inside(2, 3)


@jax.custom_vjp
def _attention(q, k, v, ranges):
    if use_pallas():
        return exact_pallas.attention(q, k, v, ranges, interpret=_interpret())
    scale = np.float32(q.shape[-1] ** -0.5)
    return _call("jaxrl4llm_exact_attention", q.shape, jnp.float32, q, k, v, ranges, scale=scale)


def _reference(q, k, v, ranges):
    """`_attention` in XLA ops (float32, [B, H, T, S] scores): what the backward differentiates."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision=hi) * np.float32(q.shape[-1] ** -0.5)
    scores = jnp.where(ranges_mask(ranges, k.shape[1])[:, None], scores, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v, precision=hi)


def _attention_bwd(residuals, ct):
    q, k, v, ranges = residuals
    _, pullback = jax.vjp(lambda q, k, v: _reference(q, k, v, ranges), q, k, v)
    return (*pullback(ct), np.zeros(ranges.shape, jax.dtypes.float0))


_attention.defvjp(lambda q, k, v, ranges: (_attention(q, k, v, ranges), (q, k, v, ranges)), _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, ranges: jax.Array, *, dtype, kv_dtype=None) -> jax.Array:
    """out[b, t] = softmax_j(q[b, t] . k[b, j] / sqrt(Dh)) v[b, j] over the keys j of ranges[b, t] =
    (a0, a1, b0, b1): [a0, a1) then [b0, b1), in that order (module docstring).

    Args: q [B, T, H, Dh]; k, v [B, S, KVH, Dh] (H a multiple of KVH); ranges [B, T, 4] int32; q is
      rounded to `dtype`, k and v to `kv_dtype` (default `dtype`: the KV cache's). Returns [B, T, H, Dh]
      float32; a position with no key gets zeros.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return _attention(rounded(q, dtype), rounded(k, kv_dtype), rounded(v, kv_dtype), ranges.astype(jnp.int32))
