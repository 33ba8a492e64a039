"""Rematerialisation policies of the decoder layers: what the backward pass keeps from the
forward, and what it computes again.

With `ModelConfig.remat` each layer of the scan is a `jax.checkpoint`: the forward keeps the
layer's input [B, T, D]; the backward reruns the layer, except the values the policy saves.
The decoder layer names three of its values (`jax.ad_checkpoint.checkpoint_name`):

    "qkv_proj"   q [B, T, H, Dh], k, v [B, T, KVH, Dh]     after the projections, before the norms
    "attention"  softmax(q k^T) v [B, T, H, Dh]            the input of W_o
    "mlp_gate_up" x W_gate, x W_up [B, T, F] each          the MLP's two input projections

Policies (the names MaxText's `remat_policy` uses for the same trade):

    full            nothing saved: backward = 2 forwards + the gradient matmuls (~4x a forward)
    save_attention  qkv_proj + attention saved: the backward skips the q/k/v projections and the
                    attention's p v product; recomputes the scores and softmax (their gradient
                    needs them), W_o and the MLP
    save_dots       every weight matmul output the backward needs saved (q, k, v, o, gate, up;
                    `dots_with_no_batch_dims_saveable`): only norms, RoPE, SwiGLU and attention
                    are recomputed (~3x a forward), at the highest memory

On a TPU or GPU the trade is HBM for FLOPs: `jaxrl4llm plan` counts the saved bytes per chip.
"""

from __future__ import annotations

import jax

# name -> (the jax.checkpoint policy, floats kept per token beyond the layer input, from the
# per-chip widths q = H Dh, kv = KVH Dh, D, F). save_dots: W_down's output is never needed again.
_POLICIES = {
    "full": (lambda: jax.checkpoint_policies.nothing_saveable, lambda q, kv, d, f: 0),
    "save_attention": (lambda: jax.checkpoint_policies.save_only_these_names("qkv_proj", "attention"),
                       lambda q, kv, d, f: 2 * q + 2 * kv),
    "save_dots": (lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  lambda q, kv, d, f: q + 2 * kv + d + 2 * f),
}
REMAT_POLICIES = tuple(_POLICIES)


def _entry(name: str):
    if name not in _POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)}")
    return _POLICIES[name]


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a REMAT_POLICIES name."""
    return _entry(name)[0]()


def saved_floats_per_token(name: str, *, hidden: int, intermediate: int, heads: int, kv_heads: int,
                           head_dim: int, tensor: int = 1) -> int:
    """float32 values a layer keeps per token beyond its input under policy `name` (per chip
    with `tensor`-way tensor parallelism: heads and the MLP width split, the residual not)."""
    q, kv = heads * head_dim // tensor, kv_heads * head_dim // max(min(tensor, kv_heads), 1)
    return _entry(name)[1](q, kv, hidden, intermediate // tensor)
