"""What `model.numerics: exact` costs on this machine: rollout and update tokens/s, exact against default.

    PYTHONPATH=. .venv/bin/python benchmarks/numerics.py [--hidden 128] [--dtype bfloat16]

A tiny random Qwen3 (4 layers, hidden --hidden), 8 prompts x 4 samples x 64 new tokens on the
continuous engine; the update is one forward + backward of the trainer's log-prob pass over the
rollout's padded rows. Each figure is the best of --repeats timed runs after one compile run; the
two modes alternate in each repeat (a noisy machine slows both alike). Also prints how many
sampled tokens' log-probs differ in any bit from the trainer's recompute (exact: 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import LITE_PPO, compute_advantages
from jaxrl4llm.models import ModelConfig, init_model
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.policy import make_logprob_fn
from jaxrl4llm.train.step import make_logprob_pass


def measure(config: ModelConfig, prompts, new_tokens: int, samples: int):
    """(rollout seconds, update seconds, response tokens, differing tokens) of one mode, jitted programs warm."""
    graphdef, state = init_model(config, jax.random.PRNGKey(0), std=0.1)
    roll = lambda: generate(graphdef, state, prompts, num_samples=samples, max_new_tokens=new_tokens,
                            eos_token_ids=[1], pad_token_id=0, rng=jax.random.PRNGKey(1))
    rollout = roll()
    n = rollout.prompt_tokens.shape[0]
    batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(n, jnp.float32), samples, LITE_PPO))
    logprob_pass = make_logprob_pass(make_logprob_fn(graphdef, 1.0, 64), 1, new_tokens)
    loss = lambda s: jnp.sum(logprob_pass(s, batch)[0])
    update = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(update(state))
    logp = np.asarray(jax.jit(logprob_pass)(state, batch)[0])[:, -new_tokens:]
    mask = np.asarray(rollout.response_mask) > 0
    differing = int((logp[mask] != np.asarray(rollout.logprobs_untruncated)[mask]).sum())

    def timed():
        start = time.perf_counter()
        jax.block_until_ready(roll().response_tokens)
        middle = time.perf_counter()
        jax.block_until_ready(update(state))
        return middle - start, time.perf_counter() - middle

    return timed, int(mask.sum()), differing


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=True, dtype=args.dtype, param_dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(2, 512, int(n))) for n in rng.integers(8, 64, 8)]
    modes = {m: measure(dataclasses.replace(base, numerics=m), prompts, args.new_tokens, 4) for m in ("default", "exact")}
    best = {m: [float("inf"), float("inf")] for m in modes}
    for _ in range(args.repeats):
        for m, (timed, _, _) in modes.items():
            best[m] = [min(a, b) for a, b in zip(best[m], timed())]
    print(f"tiny qwen3 hidden {args.hidden}, 4 layers, {args.dtype}, 8 prompts x 4 samples x {args.new_tokens} tokens, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| numerics | rollout tokens/s | update tokens/s | tokens whose log-probs differ (sampler vs trainer) |")
    print("|---|---|---|---|")
    for m, (_, tokens, differing) in modes.items():
        print(f"| {m} | {tokens / best[m][0]:.0f} | {tokens / best[m][1]:.0f} | {differing} of {tokens} |")
    ratio = [best["exact"][i] / best["default"][i] for i in range(2)]
    print(f"exact / default time: rollout {ratio[0]:.2f}x, update {ratio[1]:.2f}x")


if __name__ == "__main__":
    main()
