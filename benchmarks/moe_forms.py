"""The mixture-of-experts expert forms timed against each other on this machine: forward + backward
of `models.layers.moe.expert_ffn` (gate weights replayed from the router's softmax, float32), its
FLOPs by XLA's count, and each form's time over dense_capacity's.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe_forms.py [--tokens 512 --hidden 256 --width 128
                                                                --experts 16 --k 2 --iters 5]

On CPU, XLA lowers `jax.lax.ragged_dot` to a dense expansion over all groups (k times
dense_capacity's FLOPs), which is why `kernels.choice.expert_form_for` runs dense_capacity there
(docs/models.md, "Mixture of experts (Qwen3-MoE)").
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxrl4llm.kernels.choice import EXPERT_FORMS
from jaxrl4llm.models.layers.moe import (
    Experts,
    expert_ffn,
    replay_route,
    router_probs,
    top_k_route,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 512), ("hidden", 256), ("width", 128), ("experts", 16), ("k", 2), ("iters", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    n, d, i, e, k = a.tokens, a.hidden, a.width, a.experts, a.k
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, d))
    router = 0.1 * jax.random.normal(keys[1], (d, e))
    experts = Experts(*(0.05 * jax.random.normal(key, shape)
                        for key, shape in zip(keys[2:], [(e, d, i), (e, d, i), (e, i, d)])))
    _, ids = top_k_route(router_probs(x, router), k, True)
    times, gflops = {}, {}
    for form in EXPERT_FORMS:
        def loss(x, router, experts, form=form):
            w = replay_route(router_probs(x, router), ids, True)
            return jnp.sum(expert_ffn(x, ids, w, experts, form) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        cost = step.lower(x, router, experts).compile().cost_analysis()
        flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
        jax.block_until_ready(step(x, router, experts))
        runs = []
        for _ in range(a.iters):
            start = time.perf_counter()
            jax.block_until_ready(step(x, router, experts))
            runs.append(time.perf_counter() - start)
        times[form], gflops[form] = sorted(runs)[len(runs) // 2], flops / 1e9
    for form in EXPERT_FORMS:
        print(f"{form:15s} N={n} D={d} I={i} E={e} k={k}: forward+backward median {times[form] * 1e3:8.2f} ms, "
              f"{gflops[form]:6.2f} GFLOP (XLA), {times[form] / times['dense_capacity']:.2f}x dense_capacity")


if __name__ == "__main__":
    main()
