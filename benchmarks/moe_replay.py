"""A small mixture of experts against a dense model of the same active size, and what router replay
costs and closes, on this machine:

1. sampler tokens/s (the continuous engine): dense, MoE, MoE recording its routes (the recording's
   overhead: the issue's goal is under 2% of the rollout);
2. the trainer's forward + backward tokens/s (`score_tokens`, a padded batch): dense against MoE;
3. in bfloat16, over seeds: the share of (token, layer) pairs whose top-k set differs between the
   sampler and the trainer's native routing (`core.route_disagreement`), and the mean |trainer -
   sampler| log-prob gap with the sampler's routes replayed against native routing.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe_replay.py [--hidden 128 --layers 2 --experts 16 --k 4
                                                                  --width 64 --prompts 8 --samples 4
                                                                  --new-tokens 64 --seeds 3 --repeats 3]

The dense model's feed-forward width is k x the experts' width (the same FLOPs a token); each figure
is the median of --repeats timed runs after a compile run, MoE and dense alternating (a noisy machine
slows both alike). docs/results/models.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import LITE_PPO, agreement_stats, compute_advantages, route_disagreement
from jaxrl4llm.models import ModelConfig, init_model, score_tokens
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.policy import make_logprob_fn, make_routing_fn
from jaxrl4llm.train.step import make_logprob_pass


def configs(a) -> dict[str, ModelConfig]:
    """{"dense": ..., "moe": ...}: the same attention and vocabulary; the dense FFN width k x I."""
    base = dict(vocab_size=512, hidden_size=a.hidden, num_layers=a.layers, num_heads=4, num_kv_heads=2,
                head_dim=a.hidden // 4, max_position_embeddings=1024, dtype="float32")
    return {"dense": ModelConfig(architecture="qwen3", intermediate_size=a.k * a.width, **base),
            "moe": ModelConfig(architecture="qwen3_moe", intermediate_size=a.k * a.width, num_experts=a.experts,
                               num_experts_per_tok=a.k, moe_intermediate_size=a.width, **base)}


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(8, 24))).tolist() for _ in range(n)]


def seconds_of(fn) -> float:
    """Seconds of one call of fn, blocked until its arrays are ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def sampler_figures(a, models) -> dict:
    """Generated tokens/s of each model (and of the MoE recording routes), alternating per repeat."""
    work = prompts(a.prompts, 512, 0)
    kwargs = dict(num_samples=a.samples, max_new_tokens=a.new_tokens, temperature=1.0, eos_token_ids=[1],
                  pad_token_id=0, engine="continuous", cpu_kernels=False, rng=jax.random.PRNGKey(3))
    cases = {"dense": (models["dense"], False), "moe": (models["moe"], False), "moe, routes recorded": (models["moe"], True)}
    calls = {name: (lambda m=m, r=r: generate(*m, work, record_routes=r, **kwargs)) for name, (m, r) in cases.items()}
    tokens = {name: int(np.asarray(call().lengths).sum()) for name, call in calls.items()}  # compiles each
    seconds = {name: [] for name in calls}
    for _ in range(a.repeats):
        for name, call in calls.items():
            seconds[name].append(seconds_of(call))
    return {name: {"tokens": tokens[name], "seconds": statistics.median(s), "tokens_per_s": tokens[name] / statistics.median(s)}
            for name, s in seconds.items()}


def trainer_figures(a, models) -> dict:
    """Forward + backward tokens/s of `score_tokens` (the update's model work) on a padded batch."""
    rows, length = a.prompts * a.samples, 24 + a.new_tokens
    tokens = jax.random.randint(jax.random.PRNGKey(1), (rows, length), 2, 512)
    mask = jnp.ones((rows, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
    steps = {}
    for name, (graphdef, state) in models.items():
        def loss(state, graphdef=graphdef):
            logp, _ = score_tokens(graphdef, state, tokens, tokens, positions=positions, attention_mask=mask)
            return jnp.mean(logp)

        steps[name] = jax.jit(jax.grad(loss))
        jax.block_until_ready(steps[name](state))
    seconds = {name: [] for name in models}
    for _ in range(a.repeats):
        for name, (graphdef, state) in models.items():
            seconds[name].append(seconds_of(lambda: steps[name](state)))
    return {name: {"tokens_per_s": rows * length / statistics.median(s)} for name, s in seconds.items()}


def replay_figures(a) -> list[dict]:
    """Per seed, in bfloat16: route disagreement (sampler vs the trainer's native routing) and the mean
    |trainer - sampler| log-prob gap with the sampler's routes replayed and with native routing."""
    out = []
    for seed in range(a.seeds):
        config = dataclasses.replace(configs(a)["moe"], dtype="bfloat16", param_dtype="float32")
        graphdef, state = init_model(config, jax.random.PRNGKey(seed), std=0.3)
        rollout = generate(graphdef, state, prompts(a.prompts, 512, seed), num_samples=a.samples,
                           max_new_tokens=a.new_tokens, temperature=1.0, eos_token_ids=[1], pad_token_id=0,
                           rng=jax.random.PRNGKey(seed), engine="continuous", cpu_kernels=False, record_routes=True)
        rows = a.prompts * a.samples
        batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(rows, jnp.float32), a.samples, LITE_PPO))
        logprob_pass = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, 128), 1))
        gap = lambda b: float(agreement_stats(logprob_pass(state, b)[0], batch.sampler_logp, batch.loss_mask)["mean_abs"])
        _, native, _ = make_routing_fn(graphdef, 1.0, 128)(state, batch.input_tokens, batch.targets, batch.positions,
                                                        batch.attention_mask)
        out.append({"seed": seed, "route_disagreement": float(route_disagreement(native, batch.routes,
                                                                                  batch.attention_mask)),
                    "gap_replayed": gap(batch), "gap_native": gap(batch._replace(routes=None))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 128), ("layers", 2), ("experts", 16), ("k", 4), ("width", 64), ("prompts", 8),
                          ("samples", 4), ("new-tokens", 64), ("seeds", 3), ("repeats", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    models = {name: init_model(c, jax.random.PRNGKey(0), std=0.3) for name, c in configs(a).items()}
    c = configs(a)["moe"]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: hidden {a.hidden}, {a.layers} layers, {a.experts} "
          f"experts x {a.width} (k {a.k}; {c.num_active_params / 1e6:.2f}M of {c.num_params / 1e6:.2f}M params active) "
          f"against a dense FFN of {a.k * a.width}; {a.prompts} prompts x {a.samples} samples x {a.new_tokens} tokens")
    sampler = sampler_figures(a, models)
    print("\n| sampler (continuous engine) | tokens | s (median) | tokens/s | / dense |\n| --- | ---: | ---: | ---: | ---: |")
    for name, f in sampler.items():
        print(f"| {name} | {f['tokens']} | {f['seconds']:.3f} | {f['tokens_per_s']:.0f} | "
              f"{f['tokens_per_s'] / sampler['dense']['tokens_per_s']:.2f} |")
    overhead = sampler["moe, routes recorded"]["seconds"] / sampler["moe"]["seconds"] - 1
    print(f"route recording: {100 * overhead:+.1f}% of the MoE rollout's time")
    trainer = trainer_figures(a, models)
    print("\n| trainer forward + backward | tokens/s | / dense |\n| --- | ---: | ---: |")
    for name, f in trainer.items():
        print(f"| {name} | {f['tokens_per_s']:.0f} | {f['tokens_per_s'] / trainer['dense']['tokens_per_s']:.2f} |")
    print("\n| bf16 seed | route disagreement | log-prob gap, replayed | native | replayed / native |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for r in replay_figures(a):
        print(f"| {r['seed']} | {100 * r['route_disagreement']:.2f}% | {r['gap_replayed']:.2e} | {r['gap_native']:.2e} | "
              f"{r['gap_replayed'] / r['gap_native']:.4f} |")


if __name__ == "__main__":
    main()
