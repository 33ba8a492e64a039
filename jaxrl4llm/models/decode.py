"""Fast incremental decoding for the sampler: prefill once per prompt, decode G samples per prompt.

The same math as `transformer.forward_with_cache`, arranged for decode speed on CPU/TPU:

- Weights are unstacked into one dict per layer and cast to the compute dtype once per
  rollout (`decode_weights`), so the decode loop reads each bf16 matrix directly (no
  per-step dynamic slice of the stacked [L, ...] weights, no per-step f32 -> bf16 cast).
- The prompt is prefilled for the P distinct prompts only; its keys/values [P, KVH, T, Dh]
  are shared by the G samples of each prompt: the G*H/KVH queries of a prompt attend to
  them in one matmul (G folded into the M dimension), so prompt KV is read once per prompt.
- Generated keys/values live in fixed-size blocks [N, KVH, blk, Dh] per layer. A decode
  step attends to the prompt plus the blocks filled so far, so step t reads O(t) cache,
  not the whole preallocated cache:

      out = softmax([q K_prompt^T, q K_1^T, ..., q K_j^T] / sqrt(Dh)) [V_prompt; V_1; ...; V_j]

Cache layouts: values [B, KVH, S, Dh]; keys [B, KVH, Dh, S] for the prompt and for full
("sealed") blocks, so both attention matmuls are plain row-major products (q [M, Dh] x K [Dh, S];
p [M, S] x V [S, Dh]). XLA:CPU runs that score matmul faster than one against keys stored
[S, Dh] (48M shape: 3.8 ms against 6.0 ms per step). The block being filled keeps its keys
[B, KVH, S, Dh]: writing one slot there is a contiguous row per head (a strided one-element
write per (row, head, d) costs ~10x more), and `seal_block` transposes them once it is full.

On CPU the sampler can run the matmuls, the attention and top-k as C++ kernels
(`jaxrl4llm.kernels`): `decode_weights(pack=True)` packs the matmul weights for the matmul
kernel, and `prefill` / `seal_block(pair_layout=True)` store bf16 prompt and sealed KV in the
attention kernel's pair layout (`pair_keys`, `pair_values`). The XLA ops here are the reference
the kernels are tested against, and what every other platform runs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl4llm.kernels.decode_attention import decode_attention as kernel_decode_attention
from jaxrl4llm.kernels.decode_attention import supports as kernel_supports
from jaxrl4llm.kernels.matmul import matmul as kernel_matmul
from jaxrl4llm.kernels.matmul import pack_weight, packable
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layers.attention import causal_padding_mask, dot_product_attention
from jaxrl4llm.models.layers.linear import einsum
from jaxrl4llm.models.layers.mlp import swiglu_gate
from jaxrl4llm.models.layers.norm import rms_norm
from jaxrl4llm.models.layers.rope import apply_rope, rope_tables
from jaxrl4llm.models.params import param_logical_axes
from jaxrl4llm.models.sharding import DEFAULT_RULES, logical_to_spec

_MASKED = -1e30
_MATMUL_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED_WEIGHTS = ("qkv_t", "o_t", "gate_up_t", "down_t")  # the decode layout's matmul weights

# Decode sharding: rows data-parallel over (data, fsdp), weights tensor-parallel only (no
# per-step all-gather of FSDP shards), KV cache split over kv heads.
DECODE_RULES = tuple((name, None if name == "embed" else axes) for name, axes in DEFAULT_RULES)
KEY_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")  # keys [B, KVH, Dh, S]
VALUE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")  # values [B, KVH, S, Dh]
KEY_PAIR_AXES = ("batch", "kv_heads", "head_dim", "cache_seq", None)  # pair layout keys [B, KVH, Dh/2, S, 2]
VALUE_PAIR_AXES = ("batch", "kv_heads", "cache_seq", "head_dim", None)  # pair layout values [B, KVH, S/2, Dh, 2]


class PromptKV(NamedTuple):
    """Per-layer prompt keys [P, KVH, Dh, T] and values [P, KVH, T, Dh] (lists of L arrays), mask [P, T] (1 = real)."""

    k: list
    v: list
    mask: jax.Array


class KVBlock(NamedTuple):
    """Per-layer keys and values of `blk` generated slots (lists of L arrays). Values [N, KVH, blk, Dh];
    keys [N, KVH, blk, Dh] while the block is being filled, [N, KVH, Dh, blk] once sealed (`seal_block`)."""

    k: list
    v: list


def _constrain(x: jax.Array, axes: tuple, mesh: Mesh | None, rules) -> jax.Array:
    if mesh is None:
        return x
    spec = logical_to_spec(axes, rules, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def decode_weights(params: dict, config: ModelConfig, *, mesh: Mesh | None = None, rules=DECODE_RULES,
                   pack: bool = False) -> dict:
    """Params pytree -> {"embed", "lm_head" [V, D], "final_norm", "layers": [L dicts]}.

    pack: also pack each matmul weight for the CPU matmul kernel (`kernels.matmul.pack_weight`,
    bf16 only; a weight whose shape the kernel does not take stays 2-D). Single device only.

    Matmul weights are cast to `config.dtype`, fused, and stored as 2-D output-major matrices
    ([out, in]: each output unit's weights contiguous), one pass over the weights per rollout.
    At decode-sized M, XLA:CPU runs `x W^T` with W output-major faster than `x W` (a 10-layer
    48M-shaped chain: 16.7 ms against 20.2 ms per step), and it keeps that layout only for 2-D
    x 2-D products (a higher-rank contraction gets its weight transposed back). Four fused
    matmuls per layer instead of seven:

        qkv_t     [KVH * (H/KVH + 2) * Dh, D]  per kv head: its H/KVH query heads, its key, its value
        o_t       [D, H * Dh]
        gate_up_t [2F, D]                      W_gate^T and W_up^T rows interleaved
        down_t    [D, F]

    Grouping by kv head (and interleaving gate/up) keeps the rows a tensor-parallel shard needs
    together. The embedding used for lookup keeps the params' precision. With `mesh`, every
    weight is resharded on device to the decode layout (`rules`).
    """
    dtype = jnp.dtype(config.dtype)
    axes = param_logical_axes(config)
    kvh, hg, dh = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    layers = []
    for i in range(config.num_layers):
        layer = {name: _constrain(a[i], axes["layers"][name][1:], mesh, rules)
                 for name, a in params["layers"].items() if name not in _MATMUL_WEIGHTS}  # norms, biases
        w = {name: params["layers"][name][i].astype(dtype) for name in _MATMUL_WEIGHTS}
        d = w["q_proj"].shape[0]
        qkv = jnp.concatenate([w["q_proj"].reshape(d, kvh, hg, dh), w["k_proj"][:, :, None], w["v_proj"][:, :, None]],
                              axis=2)
        layer["qkv_t"] = _constrain(qkv.reshape(d, -1).T, ("kv_heads", "embed"), mesh, rules)
        layer["o_t"] = _constrain(w["o_proj"].reshape(-1, d).T, ("embed", "heads"), mesh, rules)
        gate_up = jnp.stack([w["gate_proj"].T, w["up_proj"].T], axis=1)  # [F, 2, D]
        layer["gate_up_t"] = _constrain(gate_up.reshape(-1, d), ("mlp", "embed"), mesh, rules)
        layer["down_t"] = _constrain(w["down_proj"].T, ("embed", "mlp"), mesh, rules)
        layers.append(layer)
    tied = config.tie_word_embeddings
    head = params["embed_tokens"] if tied else params["lm_head"].T
    weights = {
        "embed": _constrain(params["embed_tokens"], axes["embed_tokens"], mesh, rules),
        "lm_head": _constrain(head.astype(dtype), ("vocab", "embed"), mesh, rules),
        "final_norm": params["final_norm"],
        "layers": layers,
    }
    if pack:
        maybe_pack = lambda w: pack_weight(w) if packable(w) else w
        weights["lm_head"] = maybe_pack(weights["lm_head"])
        weights["layers"] = [{name: maybe_pack(a) if name in _FUSED_WEIGHTS else a for name, a in layer.items()}
                             for layer in layers]
    return weights


def _project(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """y = x W^T: x [M, K]; W output-major [N, K], or packed for the CPU kernel. Returns [M, N] float32.

    Always a plain 2-D product: XLA:CPU keeps a 2-D output-major weight as it is, but transposes
    the weight of a higher-rank contraction.
    """
    if w.ndim == 4:
        return kernel_matmul(x, w)
    return einsum("mk,nk->mn", x, w, dtype)


def _move_as_bits(move, *arrays: jax.Array) -> jax.Array:
    """move(*arrays) for a pure data movement (gather, update-slice), done on the arrays' uint16
    bit patterns when they are 16-bit floats, and viewed back in their dtype.

    XLA:CPU treats 16-bit float data movement as float32 arithmetic: it widens a bf16
    dynamic-update-slice to float32 (converting the whole buffer there and back), and moves a
    float32 conversion in front of a gather (converting the whole gathered-from table). On
    integers it does neither. Inference only: the integer view carries no gradient.
    """
    dtype = arrays[0].dtype
    if dtype.itemsize != 2:
        return move(*arrays)
    return jax.lax.bitcast_convert_type(move(*(jax.lax.bitcast_convert_type(a, jnp.uint16) for a in arrays)), dtype)


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """x = table[tokens] as float32. table [V, D]; tokens [...] int32 -> [..., D].

    A 16-bit table is gathered as bits (`_move_as_bits`): otherwise, the table being
    loop-invariant, XLA:CPU converts all of it to float32 once per call (a float32 copy of the
    embedding: 2.5 GB for a 151936 x 4096 vocabulary, 50-170 ms per call at 100M parameters).
    """
    return _move_as_bits(lambda t: jnp.take(t, tokens, axis=0), table).astype(jnp.float32)


def _qkv(x, p, config: ModelConfig, cos, sin):
    """x [B, T, D] residual -> q [B, T, H, Dh], k, v [B, T, KVH, Dh] float32 (normed, biased, rotated)."""
    dtype = jnp.dtype(config.dtype)
    h = rms_norm(x, p["input_norm"], config.rms_norm_eps)
    b, t = x.shape[:2]
    hg = config.num_heads // config.num_kv_heads
    qkv = _project(h.reshape(b * t, -1), p["qkv_t"], dtype).reshape(b, t, config.num_kv_heads, hg + 2, config.head_dim)
    q = qkv[:, :, :, :hg].reshape(b, t, config.num_heads, config.head_dim)
    k, v = qkv[:, :, :, hg], qkv[:, :, :, hg + 1]
    if config.attention_bias:
        q = q + p["q_bias"].astype(jnp.float32)
        k = k + p["k_bias"].astype(jnp.float32)
        v = v + p["v_bias"].astype(jnp.float32)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _mlp_residual(x, attn, p, config: ModelConfig):
    """x' = x + attn W_o (+ b_o); return x' + MLP(norm(x')). x [B, T, D], attn [B, T, H, Dh]."""
    dtype = jnp.dtype(config.dtype)
    b, t = attn.shape[:2]
    out = _project(attn.reshape(b * t, -1), p["o_t"], dtype).reshape(b, t, -1)
    if config.o_proj_bias:
        out = out + p["o_bias"].astype(jnp.float32)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"], config.rms_norm_eps)
    # gate and up in one matmul (rows interleaved: unit f's gate at 2f, its up at 2f + 1)
    gate_up = _project(h.reshape(b * t, -1), p["gate_up_t"], dtype).reshape(b * t, -1, 2)
    return x + _project(swiglu_gate(gate_up[..., 0], gate_up[..., 1]), p["down_t"], dtype).reshape(b, t, -1)


def _lm_head(weights, config: ModelConfig, h):
    """logits = norm(h) W_head. h [B, D] -> [B, V] float32."""
    dtype = jnp.dtype(config.dtype)
    h = rms_norm(h, weights["final_norm"], config.rms_norm_eps)
    return _project(h, weights["lm_head"], dtype)


def prefill(weights: dict, config: ModelConfig, tokens: jax.Array, mask: jax.Array, *,
            cache_dtype=None, mesh: Mesh | None = None, rules=DECODE_RULES,
            pair_layout: bool = False) -> tuple[jax.Array, PromptKV]:
    """Run left-padded prompts once: next-token logits at the last slot and the prompt KV.

    pos = cumsum(mask) - 1 (a prompt's first real token has position 0).
    Args: weights from `decode_weights`; tokens [P, T] int32 left-padded; mask [P, T] (1 = real).
    Returns: (logits [P, V] float32 at slot T-1, PromptKV (k [P, KVH, Dh, T], v [P, KVH, T, Dh]) in cache_dtype).
    pair_layout: the PromptKV in the CPU kernel's pair layout (k [P, KVH, Dh/2, T', 2], v [P, KVH,
    T'/2, Dh, 2], T' = T rounded up to even, the extra slot masked).
    """
    cache_dtype = jnp.dtype(cache_dtype or config.dtype)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    cos, sin = rope_tables(config, positions)
    attend = causal_padding_mask(mask)
    x = embed_lookup(weights["embed"], tokens)
    ks, vs = [], []
    for p in weights["layers"]:
        q, k, v = _qkv(x, p, config, cos, sin)
        k = k.astype(cache_dtype)
        v = v.astype(cache_dtype)
        attn = dot_product_attention(q, k, v, attend, jnp.dtype(config.dtype))
        x = _mlp_residual(x, attn, p, config)
        if pair_layout:
            k, v = (jnp.pad(a, ((0, 0), (0, a.shape[1] % 2), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for a in (k, v))
            ks.append(_constrain(pair_keys(k), KEY_PAIR_AXES, mesh, rules))
            vs.append(_constrain(pair_values(v), VALUE_PAIR_AXES, mesh, rules))
        else:
            ks.append(_constrain(k.transpose(0, 2, 3, 1), KEY_AXES, mesh, rules))
            vs.append(_constrain(v.transpose(0, 2, 1, 3), VALUE_AXES, mesh, rules))
    if pair_layout:
        mask = jnp.pad(mask, ((0, 0), (0, mask.shape[1] % 2)))
    return _lm_head(weights, config, x[:, -1]), PromptKV(ks, vs, mask)


def empty_block(config: ModelConfig, rows: int, block_size: int, *, cache_dtype=None, mesh: Mesh | None = None,
                rules=DECODE_RULES) -> KVBlock:
    """Zeroed KVBlock to fill: L keys and L values [rows, KVH, block_size, Dh]."""
    cache_dtype = jnp.dtype(cache_dtype or config.dtype)
    shape = (rows, config.num_kv_heads, block_size, config.head_dim)
    zeros = lambda: _constrain(jnp.zeros(shape, cache_dtype), VALUE_AXES, mesh, rules)
    return KVBlock([zeros() for _ in range(config.num_layers)], [zeros() for _ in range(config.num_layers)])


def pair_keys(k: jax.Array) -> jax.Array:
    """Keys [B, KVH, S, Dh] -> the CPU kernel's pair layout [B, KVH, Dh/2, S, 2] (pairs of d side by side)."""
    b, h, s, d = k.shape
    return k.reshape(b, h, s, d // 2, 2).transpose(0, 1, 3, 2, 4)


def pair_values(v: jax.Array) -> jax.Array:
    """Values [B, KVH, S, Dh] -> the CPU kernel's pair layout [B, KVH, S/2, Dh, 2] (pairs of slots side by side)."""
    b, h, s, d = v.shape
    return v.reshape(b, h, s // 2, 2, d).transpose(0, 1, 2, 4, 3)


def seal_block(block: KVBlock, *, mesh: Mesh | None = None, rules=DECODE_RULES, pair_layout: bool = False) -> KVBlock:
    """A full block's keys [N, KVH, blk, Dh] -> [N, KVH, Dh, blk] (the score-matmul layout); values as they are.

    pair_layout: keys and values to the CPU kernel's pair layout instead (`pair_keys`, `pair_values`).
    """
    if pair_layout:
        return KVBlock([_constrain(pair_keys(k), KEY_PAIR_AXES, mesh, rules) for k in block.k],
                       [_constrain(pair_values(v), VALUE_PAIR_AXES, mesh, rules) for v in block.v])
    return KVBlock([_constrain(k.transpose(0, 1, 3, 2), KEY_AXES, mesh, rules) for k in block.k], block.v)


def write_slot(cache: jax.Array, new: jax.Array, slot) -> jax.Array:
    """cache[:, :, slot] = new. cache [B, KVH, S, Dh]; new [B, KVH, 1, Dh] (any float dtype).

    A 16-bit float cache is updated as bits (`_move_as_bits`): otherwise XLA:CPU converts the
    whole block to float32 and back, fused with the computation of `new` (measured at the demo
    size: 81 us per block write, 24 us as bits).
    """
    zero = jnp.zeros((), jnp.int32)
    index = (zero, zero, jnp.asarray(slot, jnp.int32), zero)
    return _move_as_bits(lambda c, n: jax.lax.dynamic_update_slice(c, n, index), cache, new.astype(cache.dtype))


def _decode_attention(q, prompt_k, prompt_v, prompt_mask, done_k: list, done_v: list, cur_k, cur_v, slot,
                      dtype, use_kernel: bool = False) -> jax.Array:
    """One query per row against the prompt KV (shared by a prompt's G rows) and the generated KV.

    With `use_kernel` (CPU only) the CPU kernel `kernels.decode_attention` computes the same
    result in one call; this function's XLA ops are the reference it is tested against.

    Args: q [N, H, Dh] float32 (N = P*G, rows of a prompt adjacent); prompt_k [P, KVH, Dh, T],
    prompt_v [P, KVH, T, Dh]; prompt_mask [P, T]; done_k/v: sealed blocks (keys [N, KVH, Dh, blk],
    values [N, KVH, blk, Dh]); cur_k/v [N, KVH, blk, Dh]: the block being filled, visible up to
    index `slot`.
    Returns [N, H, Dh] float32.
    """
    if use_kernel and kernel_supports(cur_k.dtype, dtype):
        return kernel_decode_attention(q, prompt_k, prompt_v, prompt_mask, done_k, done_v, cur_k, cur_v, slot)
    n, h, dh = q.shape
    num_prompts, kvh = prompt_k.shape[:2]
    g, hg = n // num_prompts, h // kvh
    qn = q.reshape(n, kvh, hg, dh)
    # prompt part: the G*H/KVH queries of a prompt form the M dimension of one matmul per (prompt, kv head)
    qp = qn.reshape(num_prompts, g, kvh, hg, dh).transpose(0, 2, 1, 3, 4).reshape(num_prompts, kvh, g * hg, dh)
    scale = dh**-0.5
    prompt_scores = einsum("pkmd,pkds->pkms", qp, prompt_k, dtype) * scale
    prompt_scores = jnp.where(prompt_mask[:, None, None, :] > 0, prompt_scores, _MASKED)
    to_rows = lambda s: s.reshape(num_prompts, kvh, g, hg, -1).transpose(0, 2, 1, 3, 4).reshape(n, kvh, hg, -1)
    scores = [to_rows(prompt_scores)]
    scores += [einsum("nkhd,nkds->nkhs", qn, k, dtype) * scale for k in done_k]
    current = einsum("nkhd,nksd->nkhs", qn, cur_k, dtype) * scale
    scores.append(jnp.where(jnp.arange(current.shape[-1]) <= slot, current, _MASKED))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [N, KVH, H/KVH, S_total]
    parts = jnp.split(probs, np.cumsum([s.shape[-1] for s in scores[:-1]]).tolist(), axis=-1)
    prompt_probs = parts[0].reshape(num_prompts, g, kvh, hg, -1).transpose(0, 2, 1, 3, 4)
    prompt_out = einsum("pkms,pksd->pkmd", prompt_probs.reshape(num_prompts, kvh, g * hg, -1), prompt_v, dtype)
    out = prompt_out.reshape(num_prompts, kvh, g, hg, dh).transpose(0, 2, 1, 3, 4).reshape(n, kvh, hg, dh)
    for part, v in zip(parts[1:], done_v + [cur_v]):
        out = out + einsum("nkhs,nksd->nkhd", part, v, dtype)
    return out.reshape(n, h, dh)


def decode_step(weights: dict, config: ModelConfig, tokens: jax.Array, rope: tuple[jax.Array, jax.Array],
                prompt: PromptKV, done_blocks: list[KVBlock], block: KVBlock, slot, *,
                use_kernels: bool = False) -> tuple[jax.Array, KVBlock]:
    """Next-token logits for one new token per row; its keys/values are written at `slot` of `block`.

    Args:
      tokens [N] int32 (N = P*G rows, the G rows of a prompt adjacent);
      rope: (cos, sin) [N, 1, Dh] at the tokens' positions, `rope_tables(config, positions[:, None])`
        (the decode loop computes all steps' tables before the loop: no cos/sin inside it);
      prompt: PromptKV of the P prompts; done_blocks: sealed KVBlocks of earlier generated slots;
      block: the KVBlock being filled; slot: int32 scalar index in `block`.
      use_kernels: attend with the CPU kernel (`jaxrl4llm.kernels`; CPU programs only).
    Returns: (logits [N, V] float32, updated block).
    """
    dtype = jnp.dtype(config.dtype)
    slot = jnp.asarray(slot, jnp.int32)
    cos, sin = rope
    x = embed_lookup(weights["embed"], tokens[:, None])  # [N, 1, D]
    new_k, new_v = [], []
    for i, p in enumerate(weights["layers"]):
        q, k, v = _qkv(x, p, config, cos, sin)
        new_k.append(write_slot(block.k[i], k.transpose(0, 2, 1, 3), slot))
        new_v.append(write_slot(block.v[i], v.transpose(0, 2, 1, 3), slot))
        attn = _decode_attention(q[:, 0], prompt.k[i], prompt.v[i], prompt.mask, [b.k[i] for b in done_blocks],
                                 [b.v[i] for b in done_blocks], new_k[i], new_v[i], slot, dtype, use_kernels)
        x = _mlp_residual(x, attn[:, None], p, config)
    return _lm_head(weights, config, x[:, 0]), KVBlock(new_k, new_v)
