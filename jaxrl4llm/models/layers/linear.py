"""Linear layers: the one place where matmul precision is decided, and the LoRA adapter.

    y = x W                       W [in..., out...] (y = einsum(spec, x, W)), float32 out
    y = x W + (alpha / r) x A B   with LoRA: A [in..., r], B [r, out...] (Hu et al. 2021, arXiv 2106.09685)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl4llm.kernels import exact as exact_numerics


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype: jnp.dtype, exact: bool = False) -> jax.Array:
    """y = einsum(spec, x.astype(dtype), w.astype(dtype)) accumulated and returned in float32.

    exact: `model.numerics=exact`, the batch-invariant matmul (`kernels.exact.einsum`): a row's
    result does not depend on the other rows, the sampler's and the trainer's the same bits.

    With dtype=bfloat16 this is bf16 x bf16 -> f32 (the fast path on CPU/TPU/GPU), and so are
    both backward matmuls: the float32 cotangent is cast to bf16 and the input gradients are
    accumulated in float32 and returned in the inputs' own dtypes (autodiff of the plain
    einsum would run the backward as a slow f32 x bf16 matmul and round gradients to bf16).
    With dtype=float32 it is a plain float32 contraction (parity with transformers).
    Every index of an input must appear in the other input or the output (true of all
    matmul-like specs).
    """
    dtype = jnp.dtype(dtype)
    if exact:
        return exact_numerics.einsum(spec, x, w, dtype)
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
        return (summed_to_primal_axes(mm(dx_spec, ct, wc), xc).astype(x_dtype),
                summed_to_primal_axes(mm(dw_spec, xc, ct), w).astype(w_dtype))

    f.defvjp(fwd, bwd)
    return f


def summed_to_primal_axes(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom backward's cotangent of `primal`, summed over the mesh axes it varies over and the
    primal does not: inside a `jax.shard_map` (checked), an input the same on every shard (a weight
    entering whole) gets per-shard gradients, and autodiff's transpose of its implicit broadcast is
    this psum. Outside a shard_map nothing varies: the cotangent as is."""
    varying = lambda a: jax.typeof(a).manual_axis_type.varying
    extra = tuple(sorted(varying(cotangent) - varying(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (Hu et al. 2021): y = x W + (alpha / rank) x A B, W frozen, A and B trained.

    rank: r. alpha: scale numerator (scale = alpha / rank). targets: names of the linears that
    get adapters ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "lm_head"). dropout: probability of zeroing an input of A (inverted dropout, as PEFT's
    lora_dropout) in the forwards run under `lora_dropout(key)` (the trainer's update); scoring
    and sampling never drop. A starts N(0, 1/in), B at zero, so an adapted model starts equal to its base.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora.targets {list(self.targets)}: unknown {unknown}; valid: {', '.join(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


_DROPOUT = threading.local()


@contextlib.contextmanager
def lora_dropout(key: jax.Array | None):
    """Within this context (at trace time), LoRA adapters with dropout > 0 drop inputs of A,
    keyed by `key` folded with the adapter's name (and by the caller with the layer index)."""
    previous = getattr(_DROPOUT, "key", None)
    _DROPOUT.key = key
    try:
        yield
    finally:
        _DROPOUT.key = previous


def current_dropout_key() -> jax.Array | None:
    """The key of the innermost `lora_dropout` context, or None (no dropout)."""
    return getattr(_DROPOUT, "key", None)


def param(value: jax.Array, axes: tuple[str | None, ...], kind=nnx.Param) -> nnx.Variable:
    """A parameter carrying its logical sharding axes as metadata (`out_sharding`).

    The names are logical ("embed", "heads", ...); `models.sharding` maps them to mesh axes,
    so they are never placed eagerly (eager_sharding=False).
    """
    return kind(value, out_sharding=tuple(axes), eager_sharding=False)


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = einsum(spec, x, W) (+ b) (+ LoRA), float32 out, matmul inputs in `dtype`.

    Args:
      spec: the contraction, e.g. "btd,dhk->bthk" (x [B, T, D], W [D, H, Dh] -> [B, T, H, Dh]).
      shape, axes: W's shape and logical axis names. `in_ndim` leading dims of W are contracted.
      bias_axes: adds b [out...] (None: no bias). lora: LoRA settings (None: no adapter).
      name: the HF name of the linear ("q_proj"): keys its adapter's dropout.
      exact: the batch-invariant matmul (`model.numerics=exact`; `einsum`).
    """

    def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *, dtype, param_dtype,
                 rngs: nnx.Rngs, in_ndim: int = 1, bias_axes: tuple[str, ...] | None = None,
                 lora: LoraSettings | None = None, std: float = 0.02, name: str = "", exact: bool = False):
        if exact and lora is not None:
            raise ValueError(f"{name or spec}: model.numerics=exact has no LoRA adapters (the sampler decodes with "
                             f"them merged into W, which rounds differently); drop model.lora or use numerics=default")
        self.spec = spec
        self.exact = exact
        self.dtype = jnp.dtype(dtype)
        self.kernel = param(normal_init(rngs, shape, param_dtype, std), axes)
        self.bias = None if bias_axes is None else param(jnp.zeros(shape[in_ndim:], param_dtype), bias_axes)
        self.lora = None if lora is None else LoraAdapter(spec, shape, axes, in_ndim=in_ndim, settings=lora,
                                                          dtype=dtype, param_dtype=param_dtype, rngs=rngs, name=name)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = einsum(self.spec, x, self.kernel[...], self.dtype, self.exact)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        if self.lora is not None:
            y = y + self.lora(x)
        return y


class LoraAdapter(nnx.Module):
    """delta(x) = (alpha / r) * einsum(spec, dropout(x) A, B); A [in..., r], B [r, out...] as nnx.LoRAParam."""

    def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *, in_ndim: int,
                 settings: LoraSettings, dtype, param_dtype, rngs: nnx.Rngs, name: str = ""):
        inputs, out = spec.replace(" ", "").split("->")
        x_idx, w_idx = inputs.split(",")
        w_in, w_out = w_idx[:in_ndim], w_idx[in_ndim:]
        self.down_spec = f"{x_idx},{w_in}r->{out[:len(out) - len(w_out)]}r"
        self.up_spec = f"{out[:len(out) - len(w_out)]}r,r{w_out}->{out}"
        fan_in = 1
        for n in shape[:in_ndim]:
            fan_in *= n
        r = settings.rank
        self.scale = settings.scale
        self.dropout = settings.dropout
        self.salt = zlib.crc32(name.encode())
        self.dtype = jnp.dtype(dtype)
        self.lora_a = param(normal_init(rngs, (*shape[:in_ndim], r), param_dtype, fan_in ** -0.5),
                            (*axes[:in_ndim], None), nnx.LoRAParam)
        self.lora_b = param(jnp.zeros((r, *shape[in_ndim:]), param_dtype), (None, *axes[in_ndim:]), nnx.LoRAParam)

    def __call__(self, x: jax.Array) -> jax.Array:
        key = current_dropout_key()
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.salt), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0.0)
        h = einsum(self.down_spec, x, self.lora_a[...], self.dtype)
        return self.scale * einsum(self.up_spec, h, self.lora_b[...], self.dtype)

    def delta_kernel(self, kernel_ndim: int) -> jax.Array:
        """(alpha / r) A B in W's shape (W of rank `kernel_ndim`, with any leading stacked-layer
        axes A and B share), float32: the change of W that merging the adapter makes."""
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        product = lambda a, b: jnp.tensordot(a, b, axes=1)
        for _ in range(a.ndim + b.ndim - 2 - kernel_ndim):  # the stacked axes
            product = jax.vmap(product)
        return self.scale * product(a, b)
