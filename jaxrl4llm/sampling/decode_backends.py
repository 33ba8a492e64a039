"""The sampler's decode backends beyond the platform-neutral one: where the CPU-only layouts and
kernels (`jaxrl4llm.kernels`) plug into decoding, and the exact-numerics backend.

`models.decode.DecodeBackend` is the platform-neutral hook; `CpuBackend` overrides it on CPU:

- 16-bit data movement (embedding gather, KV slot writes) on the uint16 bit patterns
  (`move_as_bits`): XLA:CPU otherwise widens a bf16 gather or update-slice to float32
  arithmetic, converting the whole table or cache block there and back.
- with `kernels=True`: decode attention (`kernels.decode_attention`); on the AVX512-BF16
  paths (bf16 on a CPU that has them) also the matmul kernel on packed weights (`packed=True`,
  `kernels.matmul.pack_weight`) and prompt / sealed KV in the attention kernel's pair layout
  (`pairs=True`, `pair_keys`, `pair_values`).

`ExactBackend` (`model.numerics=exact`, any platform) runs every matmul as `kernels.exact.matmul`.
`sampling.decode_loop.decode_backend` picks one per sampler call. The backends live in the sampler, above
both the protocol they implement (`models`) and the kernels they call (`kernels`, which imports no `models`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl4llm.kernels import exact
from jaxrl4llm.kernels.decode_attention import decode_attention as kernel_decode_attention
from jaxrl4llm.kernels.decode_attention import supports as kernel_supports
from jaxrl4llm.kernels.matmul import matmul as kernel_matmul
from jaxrl4llm.kernels.matmul import pack_weight, packable
from jaxrl4llm.models.decode import DecodeBackend, KVBlock

KEY_PAIR_AXES = ("batch", "kv_heads", "head_dim", "cache_seq", None)  # pair layout keys [B, KVH, Dh/2, S, 2]
VALUE_PAIR_AXES = ("batch", "kv_heads", "cache_seq", "head_dim", None)  # pair layout values [B, KVH, S/2, Dh, 2]


def move_as_bits(move, *arrays: jax.Array) -> jax.Array:
    """move(*arrays) for a pure data movement (gather, update-slice), done on the arrays' uint16
    bit patterns when they are 16-bit floats, and viewed back in their dtype.

    XLA:CPU treats 16-bit float data movement as float32 arithmetic: it widens a bf16
    dynamic-update-slice to float32 (converting the whole buffer there and back), and moves a
    float32 conversion in front of a gather (converting the whole gathered-from table; 2.5 GB
    for a 151936 x 4096 vocabulary). On integers it does neither. Inference only: the integer
    view carries no gradient.
    """
    dtype = arrays[0].dtype
    if dtype.itemsize != 2:
        return move(*arrays)
    return jax.lax.bitcast_convert_type(move(*(jax.lax.bitcast_convert_type(a, jnp.uint16) for a in arrays)), dtype)


def pair_keys(k: jax.Array) -> jax.Array:
    """Keys [B, KVH, S, Dh] -> the CPU kernel's pair layout [B, KVH, Dh/2, S, 2] (pairs of d side by side)."""
    b, h, s, d = k.shape
    return k.reshape(b, h, s, d // 2, 2).transpose(0, 1, 3, 2, 4)


def pair_values(v: jax.Array) -> jax.Array:
    """Values [B, KVH, S, Dh] -> the CPU kernel's pair layout [B, KVH, S/2, Dh, 2] (pairs of slots side by side)."""
    b, h, s, d = v.shape
    return v.reshape(b, h, s // 2, 2, d).transpose(0, 1, 2, 4, 3)


@dataclasses.dataclass(frozen=True)
class CpuBackend(DecodeBackend):
    """DecodeBackend for XLA:CPU. kernels: attention with the C++ kernel (the caller checked that
    they load and that the program runs on one CPU device). packed: matmuls with the kernel on
    packed weights; pairs: prompt / sealed KV in the pair layout. Both are the AVX512-BF16 paths
    (kernels, a bf16 model, `native.bf16_pairs()`); pairs also needs an even head_dim and KV block."""

    kernels: bool = False
    packed: bool = False
    pairs: bool = False
    fused_projections: bool = True  # XLA:CPU: four wide matmuls per layer beat seven narrow ones

    def prepare_weight(self, w):
        return pack_weight(w) if self.packed and packable(w) else w

    def matmul(self, x, w, dtype):
        if w.ndim == 4:  # packed by prepare_weight
            return kernel_matmul(x, w)
        return super().matmul(x, w, dtype)

    def embed(self, table, tokens):
        return move_as_bits(lambda t: jnp.take(t, tokens, axis=0), table).astype(jnp.float32)

    def write_slot(self, cache, new, slot):
        zero = jnp.zeros((), jnp.int32)
        index = (zero, zero, jnp.asarray(slot, jnp.int32), zero)
        return move_as_bits(lambda c, n: jax.lax.dynamic_update_slice(c, n, index), cache, new.astype(cache.dtype))

    def store_prompt(self, k, v, mask):
        if not self.pairs:
            return super().store_prompt(k, v, mask)
        # T rounded up to even (the extra slot masked): [P, KVH, Dh/2, T', 2] and [P, KVH, T'/2, Dh, 2]
        k, v = (jnp.pad(a, ((0, 0), (0, a.shape[1] % 2), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for a in (k, v))
        return (self.constrain(pair_keys(k), KEY_PAIR_AXES), self.constrain(pair_values(v), VALUE_PAIR_AXES),
                jnp.pad(mask, ((0, 0), (0, mask.shape[1] % 2))))

    def seal(self, block: KVBlock) -> KVBlock:
        if not self.pairs:
            return super().seal(block)
        return KVBlock([self.constrain(pair_keys(k), KEY_PAIR_AXES) for k in block.k],
                       [self.constrain(pair_values(v), VALUE_PAIR_AXES) for v in block.v])

    def attend(self, q, prompt_k, prompt_v, prompt_mask, done_k, done_v, cur_k, cur_v, slot, dtype):
        if self.kernels and kernel_supports(cur_k.dtype, dtype):
            return kernel_decode_attention(q, prompt_k, prompt_v, prompt_mask, done_k, done_v, cur_k, cur_v, slot)
        return super().attend(q, prompt_k, prompt_v, prompt_mask, done_k, done_v, cur_k, cur_v, slot, dtype)


@dataclasses.dataclass(frozen=True)
class ExactBackend(CpuBackend):
    """The decode backend of `model.numerics=exact`: every matmul is `kernels.exact.matmul` (each
    output one fma chain, whatever the number of rows), so a token's projections equal the training
    forward's bits. Weights are stored once per rollout as [K, N] float32 of the compute-dtype values
    (the trainer rounds its weights the same way); fused projections give the same bits as separate
    ones (a column does not depend on the others)."""

    def prepare_weight(self, w):
        return w.astype(jnp.float32).T

    def matmul(self, x, w, dtype):
        return exact.matmul(exact.rounded(x, dtype), w)

    def split_matmul(self, x, w, dtype):
        return self.matmul(x, w, dtype)
