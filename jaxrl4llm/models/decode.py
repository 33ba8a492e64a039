"""Incremental decoding for the sampler: prefill once per prompt, decode G samples per prompt.

The layer math is `layers.decoder.decoder_layer`, the same function the training forward
runs; here it runs over a decode layout of the weights and an `attend` that reads and writes
the KV cache:

- Weights are unstacked into one dict per layer and cast to the compute dtype once per
  rollout (`decode_weights`), so the decode loop reads each matrix directly (no per-step
  dynamic slice of the stacked [L, ...] weights, no per-step cast), and fused into four
  output-major matmuls per layer (`FusedLayer`).
- The prompt is prefilled for the P distinct prompts only; its keys/values are shared by the
  G samples of each prompt: the G*H/KVH queries of a prompt attend to them in one matmul (G
  folded into the M dimension), so prompt KV is read once per prompt.
- Generated keys/values live in fixed-size blocks [N, KVH, blk, Dh] per layer. A decode
  step attends to the prompt plus the blocks filled so far, so step t reads O(t) cache:

      out = softmax([q K_prompt^T, q K_1^T, ..., q K_j^T] / sqrt(Dh)) [V_prompt; V_1; ...; V_j]

Cache layouts (`DecodeBackend`): values [B, KVH, S, Dh]; keys [B, KVH, Dh, S] for the prompt
and for full ("sealed") blocks, so both attention matmuls are plain row-major products. The
block being filled keeps its keys [B, KVH, S, Dh]: one slot is a contiguous row per head.

`DecodeBackend` is the one hook where a platform changes how the decode step's primitive
operations run (weight layout, matmul, embedding gather, cache writes and layouts, attention);
this module is platform-neutral, and `jaxrl4llm.sampling.decode_backends` holds the CPU backends (C++
kernels, pair layouts, 16-bit moves). The XLA ops here are the reference they are tested against.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl4llm.kernels import exact
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layers.attention import causal_padding_mask, dot_product_attention
from jaxrl4llm.models.layers.decoder import decoder_layer
from jaxrl4llm.models.layers.linear import einsum
from jaxrl4llm.models.layers.moe import Experts, moe_ffn
from jaxrl4llm.models.layers.norm import rms_norm
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.models.sharding import DEFAULT_RULES, flat_state, logical_axes, logical_to_spec

_MASKED = -1e30

# Decode sharding: rows data-parallel over (data, fsdp), weights tensor-parallel only (no
# per-step all-gather of FSDP shards), KV cache split over kv heads.
DECODE_RULES = tuple((name, None if name == "embed" else axes) for name, axes in DEFAULT_RULES)
KEY_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")  # keys [B, KVH, Dh, S]
VALUE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")  # values [B, KVH, S, Dh]


class PromptKV(NamedTuple):
    """Per-layer prompt keys and values (lists of L arrays in the backend's layout; XLA: keys
    [P, KVH, Dh, T], values [P, KVH, T, Dh]), mask [P, T'] (1 = real)."""

    k: list
    v: list
    mask: jax.Array


class KVBlock(NamedTuple):
    """Per-layer keys and values of `blk` generated slots (lists of L arrays). Values [N, KVH, blk, Dh];
    keys [N, KVH, blk, Dh] while the block is being filled; sealed: the backend's layout (`seal`)."""

    k: list
    v: list


@dataclasses.dataclass(frozen=True)
class DecodeBackend:
    """How the decode step's primitives run: plain XLA ops, for every platform.

    Subclass and override to change a layout or a primitive for one platform
    (`jaxrl4llm.sampling.decode_backends.CpuBackend`). Hashable: a jit static argument.
    mesh, rules: shard the decode arrays on `mesh` by the logical `rules` (None: one device).
    """

    mesh: Mesh | None = None
    rules: tuple = DECODE_RULES
    # One qkv matmul (per kv head: its query heads, key, value) and gate/up rows interleaved, or
    # separate q / k / v and a stacked [2, F, D] gate/up. XLA:CPU runs fewer, wider matmuls
    # faster at decode sizes; XLA:TPU copies such fused weights to another layout before its
    # dots (seen in the compiled decode program: a copy of every gate_up and qkv weight, about
    # the decode weights' size in temporaries), so the neutral layout keeps them apart.
    fused_projections: bool = False

    def constrain(self, x: jax.Array, axes: tuple) -> jax.Array:
        if self.mesh is None:
            return x
        spec = logical_to_spec(axes, self.rules, shape=x.shape, mesh=self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def prepare_weight(self, w: jax.Array) -> jax.Array:
        """A fused output-major weight [N, K] in compute dtype -> what `matmul` takes."""
        return w

    def matmul(self, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
        """y = x W^T: x [M, K], W [N, K] (as `prepare_weight` returned it) -> [M, N] float32.

        Output-major 2-D weights: at decode-sized M XLA:CPU runs `x W^T` faster than `x W`
        and keeps that layout only for 2-D x 2-D products."""
        return einsum("mk,nk->mn", x, w, dtype)

    def split_matmul(self, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
        """`matmul` for a weight whose input dim is split over the mesh's tensor axis (o_proj,
        down_proj): each chip's partial product is rounded to `dtype` (bf16) before XLA sums the
        partials across chips, so the activation all-reduce moves bf16, half of float32's bytes
        (as Megatron-style tensor parallel decoders do). Without a split, or in float32, `matmul`."""
        split = self.mesh is not None and self.mesh.shape.get(dict(self.rules).get("heads") or "", 1) > 1
        if not split or jnp.dtype(dtype) == jnp.float32:
            return self.matmul(x, w, dtype)
        return jnp.einsum("mk,nk->mn", x.astype(dtype), w.astype(dtype), preferred_element_type=dtype
                          ).astype(jnp.float32)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """x = table[tokens] as float32. table [V, D]; tokens [...] int32 -> [..., D]."""
        return jnp.take(table, tokens, axis=0).astype(jnp.float32)

    def write_slot(self, cache: jax.Array, new: jax.Array, slot) -> jax.Array:
        """cache[:, :, slot] = new. cache [B, KVH, S, Dh]; new [B, KVH, 1, Dh] (any float dtype)."""
        zero = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (zero, zero, jnp.asarray(slot, jnp.int32),
                                                                           zero))

    def store_prompt(self, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Prompt k, v [P, T, KVH, Dh] (cache dtype), mask [P, T] -> the cached (keys, values, mask)."""
        return (self.constrain(k.transpose(0, 2, 3, 1), KEY_AXES), self.constrain(v.transpose(0, 2, 1, 3), VALUE_AXES),
                mask)

    def seal(self, block: KVBlock) -> KVBlock:
        """A full block's keys [N, KVH, blk, Dh] -> [N, KVH, Dh, blk] (the score-matmul layout); values as they are."""
        return KVBlock([self.constrain(k.transpose(0, 1, 3, 2), KEY_AXES) for k in block.k], block.v)

    def attend(self, q, prompt_k, prompt_v, prompt_mask, done_k: list, done_v: list, cur_k, cur_v, slot,
               dtype) -> jax.Array:
        """One query per row against the prompt KV (shared by a prompt's G rows) and the generated KV.

        Args: q [N, H, Dh] float32 (N = P*G, rows of a prompt adjacent); prompt_k [P, KVH, Dh, T],
        prompt_v [P, KVH, T, Dh]; prompt_mask [P, T]; done_k/v: sealed blocks (keys [N, KVH, Dh, blk],
        values [N, KVH, blk, Dh]); cur_k/v [N, KVH, blk, Dh]: the block being filled, visible up to
        index `slot`. Returns [N, H, Dh] float32.
        """
        return xla_decode_attention(q, prompt_k, prompt_v, prompt_mask, done_k, done_v, cur_k, cur_v, slot, dtype)


def xla_decode_attention(q, prompt_k, prompt_v, prompt_mask, done_k: list, done_v: list, cur_k, cur_v, slot,
                         dtype) -> jax.Array:
    """`DecodeBackend.attend` in XLA ops (the reference of the CPU kernel; shapes there)."""
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


# ---------------------------------------------------------------------------- weights
_NORMS_AND_BIASES = {  # decode-layout name -> state path (under layers/)
    "input_norm": "input_norm/scale", "post_attn_norm": "post_attn_norm/scale",
    "q_norm": "attn/q_norm/scale", "k_norm": "attn/k_norm/scale",
    "q_bias": "attn/q_proj/bias", "k_bias": "attn/k_proj/bias", "v_bias": "attn/v_proj/bias",
    "o_bias": "attn/o_proj/bias",
}

# a mixture-of-experts layer's router (the state's dtype, as the training forward reads it) and
# experts (cast to the compute dtype): decode-layout name -> state path (under layers/), in the
# state's layout ([D, E]; [E, D, I], [E, D, I], [E, I, D]) and logical axes
_EXPERTS = {"router": "mlp/router", "expert_gate": "mlp/gate_proj", "expert_up": "mlp/up_proj",
            "expert_down": "mlp/down_proj"}


# logical axes of the decode layout's matmul weights (output-major [out, in])
MATMUL_AXES = {"qkv_t": ("kv_heads", "embed"), "q_t": ("heads", "embed"), "k_t": ("kv_heads", "embed"),
               "v_t": ("kv_heads", "embed"), "gate_up_t": ("mlp", "embed"), "gate_up": (None, "mlp", "embed"),
               "o_t": ("embed", "heads"), "down_t": ("embed", "mlp"), "lm_head": ("vocab", "embed")}


def decode_weights(state, config: ModelConfig, backend: DecodeBackend = DecodeBackend()) -> dict:
    """State of a `CausalLM` without adapters (`lora.merge_lora` first) -> the decode layout:
    {"embed", "lm_head" [V, D], "final_norm", "layers": [L dicts]}.

    Matmul weights are cast to `config.dtype`, fused, and stored as 2-D output-major matrices
    ([out, in]), then handed to `backend.prepare_weight`, one pass over the weights per rollout:

        qkv_t     [KVH * (H/KVH + 2) * Dh, D]  per kv head: its H/KVH query heads, its key, its value
                                               (backend.fused_projections; else q_t [H * Dh, D],
                                               k_t, v_t [KVH * Dh, D])
        o_t       [D, H * Dh]
        gate_up_t [2F, D]                      W_gate^T and W_up^T rows interleaved
                                               (fused_projections; else gate_up [2, F, D])

        down_t    [D, F]

    Grouping by kv head (and interleaving gate/up) keeps the rows a tensor-parallel shard needs
    together. A mixture-of-experts layer has, instead of gate_up and down_t, its router [D, E] (the
    state's dtype) and experts expert_gate, expert_up [E, D, I], expert_down [E, I, D] as the state
    lays them out (`layers.moe.moe_ffn` runs them in XLA ops on every backend, the C++ CPU kernels'
    included). The embedding used for lookup keeps the state's precision. Every weight is
    constrained to the backend's decode sharding.
    """
    dtype = jnp.dtype(config.dtype)
    flat = {key: v.get_value() for key, v in flat_state(state).items()}
    axes = {key: tuple(v.get_value()) for key, v in flat_state(logical_axes(state)).items()}
    kvh, hg, dh = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    b = backend
    layers, dense = [], not config.num_experts
    for i in range(config.num_layers):
        layer = {name: b.constrain(flat["layers/" + path][i], axes["layers/" + path][1:])
                 for name, path in _NORMS_AND_BIASES.items() if "layers/" + path in flat}
        w = lambda path: flat["layers/" + path + "/kernel"][i].astype(dtype)
        q, k, v = w("attn/q_proj"), w("attn/k_proj"), w("attn/v_proj")
        d = q.shape[0]
        if b.fused_projections:
            qkv = jnp.concatenate([q.reshape(d, kvh, hg, dh), k[:, :, None], v[:, :, None]], axis=2)
            layer["qkv_t"] = b.prepare_weight(b.constrain(qkv.reshape(d, -1).T, MATMUL_AXES["qkv_t"]))
            if dense:
                gate_up = jnp.stack([w("mlp/gate_proj").T, w("mlp/up_proj").T], axis=1)  # [F, 2, D]
                layer["gate_up_t"] = b.prepare_weight(b.constrain(gate_up.reshape(-1, d), MATMUL_AXES["gate_up_t"]))
        else:
            layer["q_t"] = b.prepare_weight(b.constrain(q.reshape(d, -1).T, MATMUL_AXES["q_t"]))
            layer["k_t"] = b.prepare_weight(b.constrain(k.reshape(d, -1).T, MATMUL_AXES["k_t"]))
            layer["v_t"] = b.prepare_weight(b.constrain(v.reshape(d, -1).T, MATMUL_AXES["v_t"]))
            if dense:
                gate_up = jnp.stack([w("mlp/gate_proj").T, w("mlp/up_proj").T])  # [2, F, D]
                layer["gate_up"] = b.constrain(gate_up, MATMUL_AXES["gate_up"])
        layer["o_t"] = b.prepare_weight(b.constrain(w("attn/o_proj").reshape(-1, d).T, MATMUL_AXES["o_t"]))
        if dense:
            layer["down_t"] = b.prepare_weight(b.constrain(w("mlp/down_proj").T, MATMUL_AXES["down_t"]))
        else:
            for name, path in _EXPERTS.items():
                weight = flat["layers/" + path][i]
                layer[name] = b.constrain(weight if name == "router" else weight.astype(dtype),
                                          axes["layers/" + path][1:])
        layers.append(layer)
    embed = flat["embed_tokens/embedding"]
    head = embed if config.tie_word_embeddings else flat["lm_head/kernel"].T
    return {
        "embed": b.constrain(embed, axes["embed_tokens/embedding"]),
        "lm_head": b.prepare_weight(b.constrain(head.astype(dtype), MATMUL_AXES["lm_head"])),
        "final_norm": b.constrain(flat["final_norm/scale"], axes["final_norm/scale"]),
        "layers": layers,
    }


def decode_weight_shardings(state, config: ModelConfig, backend: DecodeBackend):
    """NamedShardings of `decode_weights(state, config, backend)` on `backend.mesh` (same tree),
    or None without a mesh. A jit that builds the decode weights passes them as out_shardings:
    a sharding constraint on another mesh than its arguments' (the sampler's own mesh,
    `sampling.decode_mesh`) does not carry over to the outputs (seen on v5p: replicated).

    state: the plain model state (no adapters; arrays or ShapeDtypeStructs)."""
    if backend.mesh is None:
        return None
    shapes = jax.eval_shape(lambda s: decode_weights(s, config, backend), state)
    axes = {key: tuple(v.get_value()) for key, v in flat_state(logical_axes(state)).items()}
    named = lambda leaf, names: NamedSharding(backend.mesh, logical_to_spec(names, backend.rules, shape=leaf.shape,
                                                                            mesh=backend.mesh))

    def layer_axes(name: str) -> tuple:
        if name in MATMUL_AXES:
            return MATMUL_AXES[name]
        return axes["layers/" + (_EXPERTS.get(name) or _NORMS_AND_BIASES[name])][1:]

    return {
        "embed": named(shapes["embed"], axes["embed_tokens/embedding"]),
        "lm_head": named(shapes["lm_head"], MATMUL_AXES["lm_head"]),
        "final_norm": named(shapes["final_norm"], axes["final_norm/scale"]),
        "layers": [{name: named(leaf, layer_axes(name)) for name, leaf in layer.items()} for layer in shapes["layers"]],
    }


class FusedLayer:
    """`layers.decoder.LayerWeights` over one layer of `decode_weights` (fused or separate projections).
    phase: "prefill" or "decode", the program a mixture-of-experts layer's expert form is chosen for
    (`kernels.choice.expert_form_for`)."""

    def __init__(self, weights: dict, config: ModelConfig, backend: DecodeBackend, phase: str = "decode"):
        self.w, self.c, self.backend, self.phase = weights, config, backend, phase
        self.dtype = jnp.dtype(config.dtype)
        self.exact = config.numerics == "exact"  # the norms' fixed-order sums (`kernels.exact`)

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        """x [B, T, K] -> x W^T [B, T, N] float32 (one 2-D matmul over B*T rows)."""
        b, t = x.shape[:2]
        return self.backend.matmul(x.reshape(b * t, -1), self.w[name], self.dtype).reshape(b, t, -1)

    def input_norm(self, x):
        return rms_norm(x, self.w["input_norm"], self.c.rms_norm_eps, self.exact)

    def post_attn_norm(self, x):
        return rms_norm(x, self.w["post_attn_norm"], self.c.rms_norm_eps, self.exact)

    def qkv(self, h):
        c = self.c
        b, t = h.shape[:2]
        hg = c.num_heads // c.num_kv_heads
        if "qkv_t" in self.w:
            qkv = self._project(h, "qkv_t").reshape(b, t, c.num_kv_heads, hg + 2, c.head_dim)
            q = qkv[:, :, :, :hg].reshape(b, t, c.num_heads, c.head_dim)
            k, v = qkv[:, :, :, hg], qkv[:, :, :, hg + 1]
        else:
            q = self._project(h, "q_t").reshape(b, t, c.num_heads, c.head_dim)
            k = self._project(h, "k_t").reshape(b, t, c.num_kv_heads, c.head_dim)
            v = self._project(h, "v_t").reshape(b, t, c.num_kv_heads, c.head_dim)
        if "q_bias" in self.w:
            q = q + self.w["q_bias"].astype(jnp.float32)
            k = k + self.w["k_bias"].astype(jnp.float32)
            v = v + self.w["v_bias"].astype(jnp.float32)
        return q, k, v

    def qk_norm(self, q, k):
        if "q_norm" not in self.w:
            return q, k
        eps = self.c.rms_norm_eps
        return rms_norm(q, self.w["q_norm"], eps, self.exact), rms_norm(k, self.w["k_norm"], eps, self.exact)

    def out(self, attn):
        b, t = attn.shape[:2]
        y = self.backend.split_matmul(attn.reshape(b * t, -1), self.w["o_t"], self.dtype).reshape(b, t, -1)
        return y + self.w["o_bias"].astype(jnp.float32) if "o_bias" in self.w else y

    def gate_up(self, h):
        b, t = h.shape[:2]
        if "gate_up_t" in self.w:
            gu = self._project(h, "gate_up_t").reshape(b, t, -1, 2)  # unit f's gate at 2f, its up at 2f + 1
            return gu[..., 0], gu[..., 1]
        gu = einsum("mk,gnk->gmn", h.reshape(b * t, -1), self.w["gate_up"], self.dtype).reshape(2, b, t, -1)
        return gu[0], gu[1]

    def down(self, a):
        b, t = a.shape[:2]
        return self.backend.split_matmul(a.reshape(b * t, -1), self.w["down_t"], self.dtype).reshape(b, t, -1)

    @property
    def moe(self):
        """A mixture-of-experts layer's feed-forward (`decoder.LayerWeights`), None for a dense layer."""
        return self._moe if "router" in self.w else None

    def _moe(self, h, routes=None, token_mask=None):
        c, w = self.c, self.w
        experts = Experts(w["expert_gate"], w["expert_up"], w["expert_down"])
        return moe_ffn(h, w["router"], experts, k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                       form=c.expert_form, dtype=self.dtype, routes=routes, phase=self.phase,
                       mesh=self.backend.mesh, token_mask=token_mask)


def lm_head(weights, config: ModelConfig, backend: DecodeBackend, h):
    """The decoder's head on the last hidden states: logits = rms_norm(h) W_head.

    weights from `decode_weights`; h [B, D] float32 -> logits [B, V] float32 (the matmul in
    `config.dtype`, on `backend`). The prefill, the static decode step and the continuous
    engine's step (`sampling.continuous.decode_step`) all end here."""
    h = rms_norm(h, weights["final_norm"], config.rms_norm_eps, config.numerics == "exact")
    return backend.matmul(h, weights["lm_head"], jnp.dtype(config.dtype))


def prefill(weights: dict, config: ModelConfig, tokens: jax.Array, mask: jax.Array, *,
            backend: DecodeBackend = DecodeBackend(), cache_dtype=None) -> tuple[jax.Array, PromptKV]:
    """Run left-padded prompts once: next-token logits at the last slot and the prompt KV.

    pos = cumsum(mask) - 1 (a prompt's first real token has position 0).
    Args: weights from `decode_weights`; tokens [P, T] int32 left-padded; mask [P, T] (1 = real).
    Returns: (logits [P, V] float32 at slot T-1, PromptKV in cache_dtype and the backend's layout).
    """
    logits, ks, vs, _ = prefill_kv(weights, config, tokens, mask, backend=backend, cache_dtype=cache_dtype)
    stored = [backend.store_prompt(k, v, mask) for k, v in zip(ks, vs)]
    return logits, PromptKV([s[0] for s in stored], [s[1] for s in stored], stored[-1][2] if stored else mask)


def prefill_kv(weights: dict, config: ModelConfig, tokens: jax.Array, mask: jax.Array, *,
               backend: DecodeBackend = DecodeBackend(), cache_dtype=None) -> tuple[jax.Array, list, list,
                                                                                     jax.Array | None]:
    """`prefill` before the backend stores the cache: (logits [P, V] float32 at slot T-1, L keys and
    L values [P, T, KVH, Dh] in cache_dtype, left-padded as the tokens, the expert ids the layers ran
    [P, T, L, k] int32 (a mixture-of-experts model; None when dense)). The paged engine
    (`sampling.continuous`) scatters the keys and values into its page pool."""
    cache_dtype = jnp.dtype(cache_dtype or config.dtype)
    dtype = jnp.dtype(config.dtype)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
    cos, sin = rope_tables(config, positions)
    allowed = causal_padding_mask(mask)

    ranges = exact.segment_ranges(mask.astype(jnp.int32)) if config.numerics == "exact" else None

    def attend(q, k, v):  # the prompt attends to itself through the cache-dtype KV it stores
        if ranges is not None:  # the training forward's kernel, over the same keys in the same order
            out = exact.attention(q, k, v, ranges, dtype=dtype, kv_dtype=cache_dtype)
            return out, (k.astype(cache_dtype), v.astype(cache_dtype))
        k, v = k.astype(cache_dtype), v.astype(cache_dtype)
        return dot_product_attention(q, k, v, allowed, dtype), (k, v)

    x = backend.embed(weights["embed"], tokens)
    ks, vs, routes = [], [], []
    for p in weights["layers"]:
        x, (k, v), ids, _ = decoder_layer(FusedLayer(p, config, backend, "prefill"), x, cos, sin, attend)
        # each layer's output whole: without the barrier XLA sinks the head's slice x[:, -1] through
        # the residual adds, re-summing every layer's attention and MLP outputs at the last token,
        # and so keeps all of them ([P, T, D] float32, two a layer) alive to the end of the prefill
        # (XLA:TPU, Qwen3-8B shapes: 13.5 GiB of temporaries for 8 prompts of 1024 tokens)
        x = jax.lax.optimization_barrier(x)
        ks.append(k)
        vs.append(v)
        routes.append(ids)
    routes = jnp.stack(routes, axis=2) if config.num_experts else None
    return lm_head(weights, config, backend, x[:, -1]), ks, vs, routes


def empty_block(config: ModelConfig, rows: int, block_size: int, *, backend: DecodeBackend = DecodeBackend(),
                cache_dtype=None) -> KVBlock:
    """Zeroed KVBlock to fill: L keys and L values [rows, KVH, block_size, Dh]."""
    cache_dtype = jnp.dtype(cache_dtype or config.dtype)
    shape = (rows, config.num_kv_heads, block_size, config.head_dim)
    zeros = lambda: backend.constrain(jnp.zeros(shape, cache_dtype), VALUE_AXES)
    return KVBlock([zeros() for _ in range(config.num_layers)], [zeros() for _ in range(config.num_layers)])


def decode_step(weights: dict, config: ModelConfig, tokens: jax.Array, rope: tuple[jax.Array, jax.Array],
                prompt: PromptKV, done_blocks: list[KVBlock], block: KVBlock, slot, *,
                backend: DecodeBackend = DecodeBackend()) -> tuple[jax.Array, KVBlock]:
    """Next-token logits for one new token per row; its keys/values are written at `slot` of `block`.

    Args:
      tokens [N] int32 (N = P*G rows, the G rows of a prompt adjacent);
      rope: (cos, sin) [N, 1, Dh] at the tokens' positions, `rope_tables(config, positions[:, None])`
        (the decode loop computes all steps' tables before the loop: no cos/sin inside it);
      prompt: PromptKV of the P prompts; done_blocks: sealed KVBlocks of earlier generated slots;
      block: the KVBlock being filled; slot: int32 scalar index in `block`.
    Returns: (logits [N, V] float32, updated block).
    """
    dtype = jnp.dtype(config.dtype)
    slot = jnp.asarray(slot, jnp.int32)
    cos, sin = rope
    x = backend.embed(weights["embed"], tokens[:, None])  # [N, 1, D]
    new_k, new_v = [], []
    for i, p in enumerate(weights["layers"]):
        def attend(q, k, v, i=i):
            ck = backend.write_slot(block.k[i], k.transpose(0, 2, 1, 3), slot)
            cv = backend.write_slot(block.v[i], v.transpose(0, 2, 1, 3), slot)
            out = backend.attend(q[:, 0], prompt.k[i], prompt.v[i], prompt.mask, [b.k[i] for b in done_blocks],
                                 [b.v[i] for b in done_blocks], ck, cv, slot, dtype)
            return out[:, None], (ck, cv)

        x, (ck, cv), _, _ = decoder_layer(FusedLayer(p, config, backend), x, cos, sin, attend)
        new_k.append(ck)
        new_v.append(cv)
    return lm_head(weights, config, backend, x[:, 0]), KVBlock(new_k, new_v)
