"""Name and layout map between the parameters of our NNX model and Hugging Face tensors.

Each entry maps one parameter of `CausalLM`'s state (its path, e.g. layers/attn/q_proj/kernel)
to one HF tensor name (per layer for stacked weights) and the pair of layout transforms
between them (numpy arrays, one layer at a time). Shapes and sharding axes are the module's
own (`abstract_model`); this table holds only names and transposes.

    HF Linear weight [out, in] (y = x W^T)  <->  ours [in, ...out dims] (y = x W)

A mixture-of-experts layer's experts are one tensor per (layer, expert) on the Hub
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, the `{e}` template) and one stacked
[L, E, ...] parameter of ours; transformers 5 holds them fused in memory (`mlp.experts.gate_up_proj`
[E, 2I, D], `mlp.experts.down_proj` [E, D, I]), which a loader also accepts (`TensorMap.fused`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from jaxrl4llm.models.config import ModelConfig


class Fused(NamedTuple):
    """Where a per-expert HF tensor also lives: rows [start, stop) of expert e in the [E, rows, cols]
    tensor `hf` ({i} = layer index) of shape `shape`."""

    hf: str
    start: int
    stop: int
    shape: tuple[int, ...]


class TensorMap(NamedTuple):
    """ours: path in the model state ("layers/attn/q_proj/kernel"); hf: name template ({i} = layer index,
    {e} = expert index); to_ours / to_hf: per-layer (per-expert) layout transforms (numpy -> numpy);
    stacked: has a layer axis; hf_shape: shape of the HF tensor (one layer, one expert);
    experts: E when ours has an expert axis after the layer axis (one HF tensor per expert), else 0;
    fused: the fused tensor that also holds it (transformers 5's in-memory layout), or None."""

    ours: str
    hf: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    stacked: bool
    hf_shape: tuple[int, ...]
    experts: int = 0
    fused: Fused | None = None


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every weight of `config`'s params with its HF name and layout transforms."""
    c = config
    D, H, K, Dh, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    ident = lambda w: w
    transpose = lambda w: np.ascontiguousarray(w.T)

    def in_heads(n):  # HF [n*Dh, D] <-> ours [D, n, Dh]
        return (lambda w: np.ascontiguousarray(w.T).reshape(D, n, Dh),
                lambda w: np.ascontiguousarray(w.reshape(D, n * Dh).T))

    def head_bias(n):  # HF [n*Dh] <-> ours [n, Dh]
        return (lambda w: w.reshape(n, Dh), lambda w: w.reshape(n * Dh))

    o_to_ours = lambda w: np.ascontiguousarray(w.T).reshape(H, Dh, D)  # HF [D, H*Dh] -> [H, Dh, D]
    o_to_hf = lambda w: np.ascontiguousarray(w.reshape(H * Dh, D).T)

    pre = "model.layers.{i}."
    attn, mlp = "layers/attn/", "layers/mlp/"
    maps = [
        TensorMap("embed_tokens/embedding", "model.embed_tokens.weight", ident, ident, False, (V, D)),
        TensorMap("layers/input_norm/scale", pre + "input_layernorm.weight", ident, ident, True, (D,)),
        TensorMap(attn + "q_proj/kernel", pre + "self_attn.q_proj.weight", *in_heads(H), True, (H * Dh, D)),
        TensorMap(attn + "k_proj/kernel", pre + "self_attn.k_proj.weight", *in_heads(K), True, (K * Dh, D)),
        TensorMap(attn + "v_proj/kernel", pre + "self_attn.v_proj.weight", *in_heads(K), True, (K * Dh, D)),
        TensorMap(attn + "o_proj/kernel", pre + "self_attn.o_proj.weight", o_to_ours, o_to_hf, True, (D, H * Dh)),
        TensorMap("layers/post_attn_norm/scale", pre + "post_attention_layernorm.weight", ident, ident, True, (D,)),
        *_feed_forward(c, pre, mlp),
        TensorMap("final_norm/scale", "model.norm.weight", ident, ident, False, (D,)),
    ]
    if c.attention_bias:
        maps += [
            TensorMap(attn + "q_proj/bias", pre + "self_attn.q_proj.bias", *head_bias(H), True, (H * Dh,)),
            TensorMap(attn + "k_proj/bias", pre + "self_attn.k_proj.bias", *head_bias(K), True, (K * Dh,)),
            TensorMap(attn + "v_proj/bias", pre + "self_attn.v_proj.bias", *head_bias(K), True, (K * Dh,)),
        ]
    if c.o_proj_bias:
        maps.append(TensorMap(attn + "o_proj/bias", pre + "self_attn.o_proj.bias", ident, ident, True, (D,)))
    if c.qk_norm:
        maps += [
            TensorMap(attn + "q_norm/scale", pre + "self_attn.q_norm.weight", ident, ident, True, (Dh,)),
            TensorMap(attn + "k_norm/scale", pre + "self_attn.k_norm.weight", ident, ident, True, (Dh,)),
        ]
    if not c.tie_word_embeddings:
        maps.append(TensorMap("lm_head/kernel", "lm_head.weight", transpose, transpose, False, (V, D)))
    return maps


def _feed_forward(c: ModelConfig, pre: str, mlp: str) -> list[TensorMap]:
    """The MLP's gate/up/down, or a mixture-of-experts layer's router and per-expert gate/up/down."""
    D, F = c.hidden_size, c.intermediate_size
    transpose = lambda w: np.ascontiguousarray(w.T)
    if not c.num_experts:
        return [
            TensorMap(mlp + "gate_proj/kernel", pre + "mlp.gate_proj.weight", transpose, transpose, True, (F, D)),
            TensorMap(mlp + "up_proj/kernel", pre + "mlp.up_proj.weight", transpose, transpose, True, (F, D)),
            TensorMap(mlp + "down_proj/kernel", pre + "mlp.down_proj.weight", transpose, transpose, True, (D, F)),
        ]
    E, I = c.num_experts, c.moe_intermediate_size
    experts = pre + "mlp.experts."
    gate_up = lambda start: Fused(experts + "gate_up_proj", start, start + I, (E, 2 * I, D))
    return [
        TensorMap(mlp + "router", pre + "mlp.gate.weight", transpose, transpose, True, (E, D)),
        TensorMap(mlp + "gate_proj", experts + "{e}.gate_proj.weight", transpose, transpose, True, (I, D), E,
                  gate_up(0)),
        TensorMap(mlp + "up_proj", experts + "{e}.up_proj.weight", transpose, transpose, True, (I, D), E, gate_up(I)),
        TensorMap(mlp + "down_proj", experts + "{e}.down_proj.weight", transpose, transpose, True, (D, I), E,
                  Fused(experts + "down_proj", 0, D, (E, D, I))),
    ]
