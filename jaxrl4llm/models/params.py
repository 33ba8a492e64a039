"""The parameter table: name, shape, logical sharding axes and initialiser of every weight.

One table drives `init_params`, `param_logical_axes` (sharding) and the checkpoint loader's
expected shapes, so the three can never disagree. Per-layer weights are stacked along a
leading `layers` axis [L, ...] and the transformer runs them with `lax.scan` (one compiled
layer body, whatever the depth).

Layout (D = hidden, F = intermediate, H / KVH = heads / kv heads, Dh = head dim, V = vocab):

    embed_tokens          [V, D]           ("vocab", "embed")
    layers/input_norm     [L, D]           ("layers", "norm")
    layers/q_proj         [L, D, H, Dh]    ("layers", "embed", "heads", "head_dim")
    layers/k_proj         [L, D, KVH, Dh]  ("layers", "embed", "kv_heads", "head_dim")
    layers/v_proj         [L, D, KVH, Dh]  ("layers", "embed", "kv_heads", "head_dim")
    layers/q_bias|k_bias|v_bias [L, H|KVH, Dh]   (attention_bias: Qwen2)
    layers/q_norm|k_norm  [L, Dh]          (qk_norm: Qwen3)
    layers/o_proj         [L, H, Dh, D]    ("layers", "heads", "head_dim", "embed")
    layers/o_bias         [L, D]           (o_proj_bias)
    layers/post_attn_norm [L, D]
    layers/gate_proj      [L, D, F]        ("layers", "embed", "mlp")
    layers/up_proj        [L, D, F]
    layers/down_proj      [L, F, D]        ("layers", "mlp", "embed")
    final_norm            [D]              ("norm",)
    lm_head               [D, V]           ("embed", "vocab")   (absent when tied)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.models.config import ModelConfig


class ParamSpec(NamedTuple):
    """Shape, logical axis names and initialiser ("normal" | "ones" | "zeros") of one weight."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str


def param_specs(config: ModelConfig) -> dict:
    """Nested dict of ParamSpec with the same structure as the params pytree."""
    c = config
    L, D, F, H, K, Dh, V = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
                            c.num_kv_heads, c.head_dim, c.vocab_size)
    layers = {
        "input_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "q_proj": ParamSpec((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), "normal"),
        "k_proj": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "v_proj": ParamSpec((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "o_proj": ParamSpec((L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), "normal"),
        "post_attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
        "gate_proj": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "up_proj": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
        "down_proj": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
    }
    if c.attention_bias:
        layers["q_bias"] = ParamSpec((L, H, Dh), ("layers", "heads", "head_dim"), "zeros")
        layers["k_bias"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
        layers["v_bias"] = ParamSpec((L, K, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
    if c.o_proj_bias:
        layers["o_bias"] = ParamSpec((L, D), ("layers", "norm"), "zeros")
    if c.qk_norm:
        layers["q_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
        layers["k_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
    specs = {
        "embed_tokens": ParamSpec((V, D), ("vocab", "embed"), "normal"),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("norm",), "ones"),
    }
    if not c.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_logical_axes(config: ModelConfig) -> dict:
    """Pytree (same structure as params) of logical axis-name tuples, e.g. ("vocab", "embed")."""
    return jax.tree.map(lambda s: s.axes, param_specs(config), is_leaf=_is_spec)


def param_shapes(config: ModelConfig) -> dict:
    """Pytree of jax.ShapeDtypeStruct (param_dtype) — what `init_params` would return."""
    dtype = jnp.dtype(config.param_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(config), is_leaf=_is_spec)


@functools.partial(jax.jit, static_argnames=("config", "std"))
def init_params(config: ModelConfig, rng: jax.Array, *, std: float = 0.02) -> dict:
    """Random parameters: N(0, std^2) matrices, ones for norm scales, zeros for biases.

    Returns a plain nested dict of jax arrays in `config.param_dtype` (see module docstring).
    Jitted; to create it directly sharded, wrap it:
    `jax.jit(init_params, static_argnums=0, out_shardings=param_shardings(config, mesh))(config, rng)`.
    """
    leaves, treedef = jax.tree.flatten(param_specs(config), is_leaf=_is_spec)
    dtype = jnp.dtype(config.param_dtype)
    # One random draw for all matrices, then sliced: a threefry per leaf costs seconds of
    # XLA compile time each on CPU, one draw costs it once.
    sizes = [math.prod(s.shape) if s.init == "normal" else 0 for s in leaves]
    flat = std * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)

    def make(spec: ParamSpec, start: int, size: int) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return flat[start:start + size].reshape(spec.shape).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, o, n) for s, o, n in zip(leaves, offsets, sizes)])
