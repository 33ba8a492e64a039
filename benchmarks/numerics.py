"""What `model.numerics: exact` costs on this machine: rollout and update tokens/s, exact against default.

    PYTHONPATH=. .venv/bin/python benchmarks/numerics.py [--hidden 128] [--dtype bfloat16]

A tiny random Qwen3 (4 layers, hidden --hidden), 8 prompts x 4 samples x 64 new tokens on the
continuous engine; the update is one forward + backward of the trainer's log-prob pass over the
rollout's padded rows. Each figure is the best of --repeats timed runs after one compile run; the
two modes alternate in each repeat (a noisy machine slows both alike). Also prints how many
sampled tokens' log-probs differ in any bit from the trainer's recompute (exact: 0), and the share
outside [0.9, 1.1] and max |d| of `core.agreement_stats` (benchmarks/mismatch.py's figures).
`scripts/gpu_check --phases agreement` runs `compare` on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import LITE_PPO, agreement_stats, compute_advantages
from jaxrl4llm.models import ModelConfig, init_model
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.policy import make_logprob_fn
from jaxrl4llm.train.step import make_logprob_pass


def measure(config: ModelConfig, prompts, new_tokens: int, samples: int):
    """(timed, agreement) of one mode, jitted programs warm: timed() -> (rollout seconds, update seconds);
    agreement: `core.agreement_stats` of the trainer's log-probs against the sampler's (out_10, max_abs,
    mean_abs, ...) with `differing`, the response tokens whose log-probs differ in any bit."""
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
    trainer_logp = jax.jit(logprob_pass)(state, batch)[0]
    agreement = {k: v.item() for k, v in agreement_stats(trainer_logp, batch.sampler_logp, batch.loss_mask).items()}
    logp = np.asarray(trainer_logp)[:, -new_tokens:]
    mask = np.asarray(rollout.response_mask) > 0
    agreement["differing"] = int((logp[mask] != np.asarray(rollout.logprobs_untruncated)[mask]).sum())
    agreement["tokens"] = int(mask.sum())

    def timed():
        start = time.perf_counter()
        jax.block_until_ready(roll().response_tokens)
        middle = time.perf_counter()
        jax.block_until_ready(update(state))
        return middle - start, time.perf_counter() - middle

    return timed, agreement


def tiny_config(hidden: int, dtype: str, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                vocab: int = 512) -> ModelConfig:
    """A random Qwen3-shaped model: `layers` layers of hidden `hidden`, `heads`:`kv_heads` heads of hidden/heads."""
    return ModelConfig(architecture="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True, dtype=dtype,
                       param_dtype="float32")


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 8-63 random ids in [2, vocab) (1 is EOS, 0 padding)."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(2, vocab, int(n))) for n in rng.integers(8, 64, count)]


def compare(base: ModelConfig, prompts, new_tokens: int, samples: int, repeats: int) -> dict:
    """{mode: {rollout_tokens_per_s, update_tokens_per_s, tokens, differing, out_10, max_abs, ...}} for
    model.numerics default and exact (`measure`), each the best of `repeats` timed runs after a compile
    run, the modes alternating in each repeat (a noisy machine slows both alike); plus rollout_ratio
    and update_ratio, exact's time over default's."""
    modes = {m: measure(dataclasses.replace(base, numerics=m), prompts, new_tokens, samples) for m in ("default", "exact")}
    best = {m: [float("inf"), float("inf")] for m in modes}
    for _ in range(repeats):
        for m, (timed, _) in modes.items():
            best[m] = [min(a, b) for a, b in zip(best[m], timed())]
    figures = {m: {"rollout_tokens_per_s": agreement["tokens"] / best[m][0],
                   "update_tokens_per_s": agreement["tokens"] / best[m][1], **agreement}
               for m, (_, agreement) in modes.items()}
    figures["rollout_ratio"] = best["exact"][0] / best["default"][0]
    figures["update_ratio"] = best["exact"][1] / best["default"][1]
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = tiny_config(args.hidden, args.dtype)
    figures = compare(base, random_prompts(8, base.vocab_size), args.new_tokens, 4, args.repeats)
    print(f"tiny qwen3 hidden {args.hidden}, 4 layers, {args.dtype}, 8 prompts x 4 samples x {args.new_tokens} tokens, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| numerics | rollout tokens/s | update tokens/s | tokens whose log-probs differ (sampler vs trainer) "
          "| ρ outside [0.9, 1.1] | max \\|d\\| |")
    print("|---|---|---|---|---|---|")
    for m in ("default", "exact"):
        f = figures[m]
        print(f"| {m} | {f['rollout_tokens_per_s']:.0f} | {f['update_tokens_per_s']:.0f} | "
              f"{f['differing']} of {f['tokens']} | {100 * f['out_10']:.2f}% | {f['max_abs']:.4f} |")
    print(f"exact / default time: rollout {figures['rollout_ratio']:.2f}x, update {figures['update_ratio']:.2f}x")


if __name__ == "__main__":
    main()
