"""How a mixture-of-experts model's routes compare: the sampler's against the trainer's, and how
evenly the experts are loaded. Router replay's metrics (R3, Ma et al. 2025, arXiv 2510.11370: the
share of tokens whose experts differ between inference and training; the expert load of the
switch transformer, Fedus et al. 2021, arXiv 2101.03961).

Routes are expert ids [B, T, L, k] (rows, positions, layers, the k experts a token ran in a layer;
any integer dtype, any order within the k), counted where the mask [B, T] is > 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def route_disagreement(a: Int[Array, "B T L K"], b: Int[Array, "B T L K"], mask: Float[Array, "B T"]
                       ) -> Float[Array, ""]:
    """The share of counted (token, layer) pairs whose k experts differ as sets:
    mean over mask of [sort(a[b, t, l]) != sort(b[b, t, l])]; 0 with nothing counted."""
    differ = jnp.any(jnp.sort(a.astype(jnp.int32), axis=-1) != jnp.sort(b.astype(jnp.int32), axis=-1), axis=-1)
    weight = jnp.broadcast_to((mask > 0)[..., None], differ.shape).astype(jnp.float32)  # [B, T, L]
    return jnp.sum(differ * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def expert_load(routes: Int[Array, "B T L K"], mask: Float[Array, "B T"], num_experts: int) -> Float[Array, "L E"]:
    """load[l, e] = the share of layer l's counted (token, choice) pairs routed to expert e: each
    layer's row sums to 1 (0 with nothing counted); a balanced router gives 1 / E."""
    one_hot = jax.nn.one_hot(routes.astype(jnp.int32), num_experts, dtype=jnp.float32)  # [B, T, L, k, E]
    counts = jnp.einsum("btlke,bt->le", one_hot, (mask > 0).astype(jnp.float32))
    return counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)


def load_imbalance(load: Float[Array, "L E"]) -> Float[Array, ""]:
    """max_e load[l, e] / mean_e load[l, e], averaged over the layers: 1 when every expert gets an
    equal share, E when one expert gets all."""
    return jnp.mean(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-30))
