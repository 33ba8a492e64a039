"""Mixed-precision contraction: the one place where matmul precision is decided."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """y = einsum(spec, x.astype(dtype), w.astype(dtype)) accumulated and returned in float32.

    With dtype=bfloat16 this is bf16 x bf16 -> f32 (the fast path on CPU/TPU/GPU), and so are
    both backward matmuls: the float32 cotangent is cast to bf16 and the input gradients are
    accumulated in float32 and returned in the inputs' own dtypes (autodiff of the plain
    einsum would run the backward as a slow f32 x bf16 matmul and round gradients to bf16).
    With dtype=float32 it is a plain float32 contraction (parity with transformers).
    Every index of an input must appear in the other input or the output (true of all
    matmul-like specs).
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)
    return _mixed_einsum(spec, dtype, jnp.dtype(x.dtype), jnp.dtype(w.dtype))(x, w)


@functools.lru_cache(maxsize=None)
def _mixed_einsum(spec: str, dtype: jnp.dtype, x_dtype: jnp.dtype, w_dtype: jnp.dtype):
    """custom_vjp einsum for one (spec, compute dtype, input dtypes)."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    dx_spec, dw_spec = f"{out},{b}->{a}", f"{a},{out}->{b}"
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    @jax.custom_vjp
    def f(x, w):
        return mm(spec, x.astype(dtype), w.astype(dtype))

    def fwd(x, w):
        xc = x.astype(dtype)
        # Keep w itself (not its cast) as the residual: under lax.scan over stacked layer
        # weights, JAX forwards a residual that is a scanned input instead of stacking a copy.
        return mm(spec, xc, w.astype(dtype)), (xc, w)

    def bwd(residuals, ct):
        xc, w = residuals
        wc = w.astype(dtype)
        ct = ct.astype(dtype)
        return mm(dx_spec, ct, wc).astype(x_dtype), mm(dw_spec, xc, ct).astype(w_dtype)

    f.defvjp(fwd, bwd)
    return f
