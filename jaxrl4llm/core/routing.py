"""How a mixture-of-experts model's routes compare: the sampler's against the trainer's, and how
evenly the experts are loaded. Router replay's metrics (R3, Ma et al. 2025, arXiv 2510.11370: the
share of tokens whose experts differ between inference and training; the expert load of the
switch transformer, Fedus et al. 2021, arXiv 2101.03961).

The routers' own statistics (`RouterStats`, gathered by the layer scan when asked): the
load-balancing loss (`trainer.router_aux_loss_coef`) and the router entropy.

Routes are expert ids [B, T, L, k] (rows, positions, layers, the k experts a token ran in a layer;
any integer dtype, any order within the k), counted where the mask [B, T] is > 0.
"""

from __future__ import annotations

from typing import NamedTuple

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


class RouterStats(NamedTuple):
    """A router's statistics over the counted tokens, as sums (so layers, micro-batches and batch
    shards add): per layer, or stacked [L, ...] by the layer scan.

        tokens   []    counted tokens N
        load     [E]   (token, choice) pairs routed to expert e (the experts that ran)
        probs    [E]   sum_n p[n, e] of the router's softmax p
        entropy  []    sum_n H(p[n]) = sum_n -sum_e p[n, e] log p[n, e]
    """

    tokens: Float[Array, "..."]
    load: Float[Array, "... E"]
    probs: Float[Array, "... E"]
    entropy: Float[Array, "..."]


def router_stats(probs: Float[Array, "N E"], expert_ids: Int[Array, "N K"], mask: Float[Array, "N"]) -> RouterStats:
    """`RouterStats` of one layer's router softmax p [N, E] and the ids e [N, k] its experts ran on,
    over the tokens where mask [N] > 0."""
    real = (mask > 0).astype(jnp.float32)
    probs = probs.astype(jnp.float32)
    load = jnp.einsum("nke,n->e", jax.nn.one_hot(expert_ids.astype(jnp.int32), probs.shape[-1], dtype=jnp.float32),
                      real)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [N]; 0 log 0 = 0
    return RouterStats(tokens=jnp.sum(real), load=load, probs=jnp.einsum("ne,n->e", probs, real),
                       entropy=jnp.sum(entropy * real))


def load_balancing_loss(stats: RouterStats) -> Float[Array, ""]:
    """The switch transformer's load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, eq. 4) as
    transformers' `load_balancing_loss_func` computes it for Qwen3-MoE / Mixtral, the layers pooled:

        aux = E * sum_e f_e P_e,  f_e = load_e / (L N),  P_e = probs_e / (L N)

    load_e, probs_e, N summed over the L layers of `stats` ([L, ...] or one layer's); f sums to k
    over e, so a uniform router gives aux = k. 0 with nothing counted."""
    count = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    load = jnp.sum(stats.load.reshape(-1, stats.load.shape[-1]), axis=0) / count
    probs = jnp.sum(stats.probs.reshape(-1, stats.probs.shape[-1]), axis=0) / count
    return stats.load.shape[-1] * jnp.sum(load * probs)


def router_entropy(stats: RouterStats) -> Float[Array, ""]:
    """The mean over counted tokens and layers of the router softmax's entropy (nats; log E when
    uniform, 0 when one expert takes all): sum entropy / sum tokens of `stats`."""
    return jnp.sum(stats.entropy) / jnp.maximum(jnp.sum(stats.tokens), 1.0)
