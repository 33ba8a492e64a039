"""RMSNorm: the pure function and its nnx.Module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl4llm.kernels import exact as exact_numerics
from jaxrl4llm.models.layers.linear import param


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, exact: bool = False) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * scale, computed in float32.

    Args: x [..., D] (any float dtype), scale [D]; exact: the sum in a fixed order
    (`model.numerics=exact`, `kernels.exact.rms_norm`). Returns [..., D] float32.
    """
    if exact:
        return exact_numerics.rms_norm(x, scale, eps)
    x = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * scale.astype(jnp.float32)


class RMSNorm(nnx.Module):
    """y = rms_norm(x, scale, eps, exact); scale [D] starts at ones."""

    def __init__(self, dim: int, axes: tuple[str, ...], *, eps: float, param_dtype, exact: bool = False):
        self.eps = eps
        self.exact = exact
        self.scale = param(jnp.ones((dim,), param_dtype), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.exact)
