"""The decoder layer: its math written once, and its nnx.Module.

    x'  = x + W_o attend(rope(qk_norm(q)), rope(qk_norm(k)), v),   (q, k, v) = norm_1(x) (W_q, W_k, W_v)
    x'' = x' + W_down (silu(norm_2(x') W_gate) * norm_2(x') W_up)
    x'' = x' + moe(norm_2(x'))        a mixture-of-experts model's feed-forward (`layers/moe.py`)

`decoder_layer` is that math over any object with the projection methods of `LayerWeights`:
the training forward and the scoring pass run it over a `DecoderLayer` (one Linear per HF
weight, LoRA adapters included), the sampler's prefill and decode step over its fused decode
layout (`models/decode.py`). What differs between them is only `attend`: causal attention over
the sequence, or attention against a KV cache (which `attend` also writes).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl4llm.models.layers.attention import Attention
from jaxrl4llm.models.layers.linear import LoraSettings
from jaxrl4llm.models.layers.mlp import MLP, swiglu_gate
from jaxrl4llm.models.layers.moe import MoE
from jaxrl4llm.models.layers.norm import RMSNorm
from jaxrl4llm.models.layers.rope import apply_rope

# attend(q [B, T, H, Dh], k, v [B, T, KVH, Dh]) -> (out [B, T, H, Dh] float32, aux): aux is what
# the caller keeps of the layer (nothing in training, the written KV cache when decoding).
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


class LayerWeights(Protocol):
    """What `decoder_layer` needs of a layer's weights (all outputs float32)."""

    def input_norm(self, x: jax.Array) -> jax.Array: ...  # [B, T, D] -> [B, T, D]
    def post_attn_norm(self, x: jax.Array) -> jax.Array: ...
    def qkv(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]: ...  # -> [B,T,H,Dh], 2x [B,T,KVH,Dh]
    def qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]: ...
    def out(self, attn: jax.Array) -> jax.Array: ...  # [B, T, H, Dh] -> [B, T, D]
    def gate_up(self, h: jax.Array) -> tuple[jax.Array, jax.Array]: ...  # [B, T, D] -> 2x [B, T, F]
    def down(self, a: jax.Array) -> jax.Array: ...  # [B, T, F] -> [B, T, D]
    # A mixture-of-experts layer also has `moe(h [B, T, D], routes [B, T, k] | None, token_mask=None)
    # -> (y, ids, router stats or None)
    # (`layers.moe.MoE.__call__`); a dense one has no `moe` or `moe` None.


def attention_block(layer: LayerWeights, x: jax.Array, cos: jax.Array, sin: jax.Array,
                    attend: AttendFn) -> tuple[jax.Array, Any]:
    """x' = x + W_o attend(...) (the module docstring's first line): (x' [B, T, D] float32, attend's aux)."""
    q, k, v = checkpoint_name(layer.qkv(layer.input_norm(x)), "qkv_proj")  # names: models/remat.py
    q, k = layer.qk_norm(q, k)
    exact = getattr(layer, "exact", False)  # model.numerics=exact (`rope.apply_rope`)
    attn, aux = attend(apply_rope(q, cos, sin, exact), apply_rope(k, cos, sin, exact), v)
    return x + layer.out(checkpoint_name(attn, "attention")), aux


def decoder_layer(layer: LayerWeights, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: AttendFn,
                  routes: jax.Array | None = None, token_mask: jax.Array | None = None
                  ) -> tuple[jax.Array, Any, jax.Array | None, Any]:
    """One pre-norm decoder layer (formula in the module docstring).

    Args: x [B, T, D] float32 residual stream; cos, sin [B, T, Dh] rotary tables of the T
      positions; attend: attention of the new queries (see AttendFn); routes: expert ids
      [B, T, k] the layer's experts are forced to (a mixture-of-experts layer only; None: its
      router's top k); token_mask [B, T]: a mixture-of-experts layer's router statistics over the
      tokens where it is > 0 (`core.routing.RouterStats`; None: none computed).
    Returns: (x'' [B, T, D] float32, attend's aux, expert ids [B, T, k] int32 or None when dense,
      RouterStats or None).
    """
    x, aux = attention_block(layer, x, cos, sin, attend)
    h = layer.post_attn_norm(x)
    moe = getattr(layer, "moe", None)
    if moe is not None:
        y, ids, stats = moe(h, routes, token_mask=token_mask)
        return x + y, aux, ids, stats
    if routes is not None:
        raise ValueError("routes (expert ids) given to a dense layer; only mixture-of-experts models take them")
    g, u = checkpoint_name(layer.gate_up(h), "mlp_gate_up")
    return x + layer.down(swiglu_gate(g, u)), aux, None, None


class DecoderLayer(nnx.Module):
    """input_norm, attn (q/k/v/o projections, q/k norms), post_attn_norm, mlp (gate/up/down; or
    router and experts, `layers.moe.MoE`, when config.num_experts > 0)."""

    def __init__(self, config, *, rngs: nnx.Rngs, lora: LoraSettings | None = None):
        c = config
        exact = c.numerics == "exact"
        self.exact = exact
        norm = lambda: RMSNorm(c.hidden_size, ("norm",), eps=c.rms_norm_eps, param_dtype=c.param_dtype, exact=exact)
        self.input_norm = norm()
        self.attn = Attention(c, rngs=rngs, lora=lora)
        self.post_attn_norm = norm()
        if c.num_experts:
            if lora is not None and set(lora.targets) & {"gate_proj", "up_proj", "down_proj"}:
                raise ValueError("LoRA on the experts (gate_proj/up_proj/down_proj) of a mixture-of-experts model is "
                                 "not supported; adapt q_proj, k_proj, v_proj, o_proj or lm_head")
            self.mlp = MoE(c, rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs,
                           lora=lora, exact=exact)

    # LayerWeights
    def qkv(self, h):
        return self.attn.qkv(h)

    def qk_norm(self, q, k):
        return self.attn.qk_norm(q, k)

    def out(self, attn):
        return self.attn.out(attn)

    def gate_up(self, h):
        return self.mlp.gate_up(h)

    def down(self, a):
        return self.mlp.down(a)

    @property
    def moe(self) -> MoE | None:
        return self.mlp if isinstance(self.mlp, MoE) else None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: AttendFn,
                 routes: jax.Array | None = None, token_mask: jax.Array | None = None
                 ) -> tuple[jax.Array, Any, jax.Array | None, Any]:
        return decoder_layer(self, x, cos, sin, attend, routes, token_mask)
