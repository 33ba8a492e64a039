"""Name and layout map between our params pytree and Hugging Face tensors.

Each entry maps one of our weights to one HF tensor name (per layer for stacked weights)
and the pair of layout transforms between them (numpy arrays, one layer at a time):

    HF Linear weight [out, in] (y = x W^T)  <->  ours [in, ...out dims] (y = x W)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from jaxrl4llm.models.config import ModelConfig


class TensorMap(NamedTuple):
    """ours: path in params ("layers/q_proj"); hf: name template ({i} = layer index);
    to_ours / to_hf: per-layer layout transforms (numpy -> numpy); stacked: has a layer axis."""

    ours: str
    hf: str
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    stacked: bool


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every weight of `config`'s params with its HF name and layout transforms."""
    c = config
    D, H, K, Dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
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
    maps = [
        TensorMap("embed_tokens", "model.embed_tokens.weight", ident, ident, False),
        TensorMap("layers/input_norm", pre + "input_layernorm.weight", ident, ident, True),
        TensorMap("layers/q_proj", pre + "self_attn.q_proj.weight", *in_heads(H), True),
        TensorMap("layers/k_proj", pre + "self_attn.k_proj.weight", *in_heads(K), True),
        TensorMap("layers/v_proj", pre + "self_attn.v_proj.weight", *in_heads(K), True),
        TensorMap("layers/o_proj", pre + "self_attn.o_proj.weight", o_to_ours, o_to_hf, True),
        TensorMap("layers/post_attn_norm", pre + "post_attention_layernorm.weight", ident, ident, True),
        TensorMap("layers/gate_proj", pre + "mlp.gate_proj.weight", transpose, transpose, True),
        TensorMap("layers/up_proj", pre + "mlp.up_proj.weight", transpose, transpose, True),
        TensorMap("layers/down_proj", pre + "mlp.down_proj.weight", transpose, transpose, True),
        TensorMap("final_norm", "model.norm.weight", ident, ident, False),
    ]
    if c.attention_bias:
        maps += [
            TensorMap("layers/q_bias", pre + "self_attn.q_proj.bias", *head_bias(H), True),
            TensorMap("layers/k_bias", pre + "self_attn.k_proj.bias", *head_bias(K), True),
            TensorMap("layers/v_bias", pre + "self_attn.v_proj.bias", *head_bias(K), True),
        ]
    if c.o_proj_bias:
        maps.append(TensorMap("layers/o_bias", pre + "self_attn.o_proj.bias", ident, ident, True))
    if c.qk_norm:
        maps += [
            TensorMap("layers/q_norm", pre + "self_attn.q_norm.weight", ident, ident, True),
            TensorMap("layers/k_norm", pre + "self_attn.k_norm.weight", ident, ident, True),
        ]
    if not c.tie_word_embeddings:
        maps.append(TensorMap("lm_head", "lm_head.weight", transpose, transpose, False))
    return maps
