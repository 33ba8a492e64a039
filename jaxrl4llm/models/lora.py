"""LoRA on the model's linears: add adapters to a base model, split trainable from frozen, merge.

    W_eff = W + (alpha / r) A B        (Hu et al. 2021, arXiv 2106.09685; PEFT's `lora_alpha / r`)

The adapters are `nnx.LoRAParam` variables inside the adapted `Linear`s (`models/layers/linear.py`),
so a model state splits by variable type: `nnx.split(model, nnx.LoRAParam, nnx.Param)` gives
(graphdef, adapters, base). The trainer differentiates and optimises the adapters only
(`train/step.py`: `TrainState.params` = adapters, `TrainState.frozen` = base), checkpoints hold
the adapters only, and the sampler and the HF export run `merge_lora` first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl4llm.models.causal_lm import CausalLM, abstract_model, merge, model_class
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layers.linear import Linear, LoraSettings


@functools.partial(jax.jit, static_argnames=("config", "settings"))
def _init_adapters(config: ModelConfig, rng: jax.Array, settings: LoraSettings) -> nnx.State:
    # Only the adapters leave the program: XLA drops the base weights' random init.
    model = model_class(config)(config, rngs=nnx.Rngs(params=rng), lora=settings)
    return nnx.state(model, nnx.LoRAParam)


def add_lora(config: ModelConfig, settings: LoraSettings, rng: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef of the adapted model, fresh adapters): A ~ N(0, 1/fan_in), B = 0.

    The base state of the same config completes it: `nnx.merge(graphdef, adapters, base)`,
    or `forward(graphdef, (adapters, base), ...)`. At init the adapted model equals its base.
    """
    graphdef, _ = abstract_model(config, lora=settings)
    return graphdef, _init_adapters(config, rng, settings)


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of an adapted model's state; (all params, empty) without adapters."""
    adapters, base = nnx.split_state(state, nnx.LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        return base, adapters
    return adapters, base


def merge_lora(graphdef: nnx.GraphDef, state) -> tuple[nnx.GraphDef, nnx.State]:
    """A model with adapters -> the plain model (no adapters) with W <- W + (alpha / r) A B.

    `state` is the adapted model's state (or a tuple (adapters, base)). Returns (graphdef,
    state) of the un-adapted model of the same config; unchanged when there are no adapters.
    Pure (the merged module is only read): jit it (the sampler's weight program and the HF
    export call it).
    """
    model = merge(graphdef, state)
    if not isinstance(model, CausalLM) or model.lora_settings is None:
        return graphdef, nnx.state(model)
    merged = {}  # state path of an adapted kernel -> W + delta
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.lora is not None:
            kernel = node.kernel[...]
            merged[(*path, "kernel")] = (kernel.astype(jnp.float32) + node.lora.delta_kernel(kernel.ndim)
                                         ).astype(kernel.dtype)
    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    flat = [(path, v.replace(merged[path]) if path in merged else v) for path, v in nnx.to_flat_state(base)]
    assert len(merged) == sum(path in merged for path, _ in flat), "every adapted kernel is in the base state"
    return plain_graphdef(model.config), nnx.from_flat_state(flat)


@functools.cache
def plain_graphdef(config: ModelConfig) -> nnx.GraphDef:
    """The graphdef of `config`'s model without adapters (what `merge_lora` returns), built once per
    config. flax cannot build an abstract model under a mesh context whose axes are not the model's
    logical names: a caller that merges under `jax.set_mesh` (plan's sampler weights) asks for it first."""
    return abstract_model(config)[0]
