"""The mixture-of-experts expert forms timed against each other on this machine: forward + backward
of `models.layers.moe.expert_ffn` (gate weights replayed from the router's softmax, float32), its
FLOPs by XLA's count, and each form's time over dense_capacity's.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe_forms.py [--tokens 512 --hidden 256 --width 128
                                                                --experts 16 --k 2 --iters 5]

On CPU, XLA lowers `jax.lax.ragged_dot` to a dense expansion over all groups (k times
dense_capacity's FLOPs), which is why `kernels.choice.expert_form_for` runs dense_capacity there
(docs/models.md, "Mixture of experts (Qwen3-MoE)"). `time_forms` is also the GPU check's `moe`
phase (benchmarks/gpu_check.py: bfloat16 at Qwen3-30B-A3B's expert shapes, the forward alone too).
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


def useful_flops(tokens: int, hidden: int, width: int, k: int) -> float:
    """The forward's useful FLOPs: 2 N k 3 D I (each token's k chosen experts, three matmuls each);
    forward + backward is 3x that."""
    return 2.0 * tokens * k * 3 * hidden * width


def time_forms(tokens: int, hidden: int, width: int, experts: int, k: int, iters: int, *, dtype: str = "float32",
               forms=EXPERT_FORMS, forward: bool = False, log=lambda line: None) -> dict[str, dict]:
    """Each form of `forms` timed on N=tokens random tokens, D=hidden, I=width, E=experts, top k:
    x [N, D], the router [D, E] and the experts float32 (as the trainer holds them: param_dtype
    float32, the normed residual float32), `expert_ffn(..., dtype)` (`dtype` the matmuls' inputs, as
    model.dtype; float32 accumulation), the loss sum(y^2) with the gate weights replayed from the router.

    Returns {form: {"fwd_bwd_s": median seconds of `iters` runs of the loss and its gradients in x,
    the router and the experts, "fwd_bwd_flops": XLA's FLOPs count of that program, "fwd_bwd_temp_bytes":
    its temporary buffers by XLA's memory analysis}}, with "fwd_s", "fwd_flops" and "fwd_temp_bytes"
    of the loss alone when `forward`. Each program is compiled once, its FLOPs and buffers read from
    the compiled program, then run once untimed."""
    n, d, i, e = tokens, hidden, width, experts
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n, d))
    router = 0.1 * jax.random.normal(keys[1], (d, e))
    weights = Experts(*(0.05 * jax.random.normal(key, shape)
                        for key, shape in zip(keys[2:], [(e, d, i), (e, d, i), (e, i, d)])))
    _, ids = top_k_route(router_probs(x, router), k, True)

    def timed(program) -> tuple[float, float, float]:
        compiled = jax.jit(program).lower(x, router, weights).compile()
        cost = compiled.cost_analysis()
        flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
        temp = float(getattr(compiled.memory_analysis(), "temp_size_in_bytes", float("nan")))
        jax.block_until_ready(compiled(x, router, weights))
        runs = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(compiled(x, router, weights))
            runs.append(time.perf_counter() - start)
        return sorted(runs)[len(runs) // 2], flops, temp

    results = {}
    for form in forms:
        def loss(x, router, experts, form=form):
            w = replay_route(router_probs(x, router), ids, True)
            return jnp.sum(expert_ffn(x, ids, w, experts, form, dtype) ** 2)

        row = dict(zip(("fwd_bwd_s", "fwd_bwd_flops", "fwd_bwd_temp_bytes"),
                       timed(jax.value_and_grad(loss, argnums=(0, 1, 2)))))
        if forward:
            row.update(zip(("fwd_s", "fwd_flops", "fwd_temp_bytes"), timed(loss)))
        log(f"  {form} N={n}: {row}")
        results[form] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 512), ("hidden", 256), ("width", 128), ("experts", 16), ("k", 2), ("iters", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    n, d, i, e, k = a.tokens, a.hidden, a.width, a.experts, a.k
    results = time_forms(n, d, i, e, k, a.iters)
    base = results["dense_capacity"]["fwd_bwd_s"]
    for form, r in results.items():
        print(f"{form:15s} N={n} D={d} I={i} E={e} k={k}: forward+backward median {r['fwd_bwd_s'] * 1e3:8.2f} ms, "
              f"{r['fwd_bwd_flops'] / 1e9:6.2f} GFLOP (XLA), "
              f"{r['fwd_bwd_temp_bytes'] / 2**20:7.1f} MiB of temporaries, "
              f"{r['fwd_bwd_s'] / base:.2f}x dense_capacity")


if __name__ == "__main__":
    main()
