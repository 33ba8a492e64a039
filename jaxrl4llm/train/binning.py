"""`jaxrl4llm bin-difficulty`: the study's Easy/Medium/Hard binning, with the JAX sampler.

Samples k responses per problem, counts correct answers with the math verifier, and writes
easy/medium/hard JSONL files plus a histogram of correct counts (jaxrl4llm.data.difficulty).
"""

from __future__ import annotations

import argparse

import jax

from jaxrl4llm.data import encode_prompt_text, load_problems, run_difficulty_binning
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.policy import load_policy


def make_generate_fn(policy, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int,
                     template: str, max_prompt_tokens: int | None = None):
    """generate_fn(prompts: list[str], num_samples) -> list[list[str]] on the JAX sampler; prompts
    formatted with `template` are encoded as training encodes them (`data.encode_prompt_text`)."""
    calls = [0]

    def generate_fn(prompts: list[str], num_samples: int) -> list[list[str]]:
        ids = [encode_prompt_text(p, policy.tokenizer, template) for p in prompts]
        for i, x in enumerate(ids):
            if max_prompt_tokens and len(x) > max_prompt_tokens:
                raise ConfigError(f"prompt {i} has {len(x)} tokens, over the budget of {max_prompt_tokens}.")
        calls[0] += 1
        rollout = policy.generate(ids, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, rng=jax.random.fold_in(jax.random.PRNGKey(seed), calls[0]))
        texts = policy.decode(rollout)
        return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    return generate_fn


def bin_difficulty_command(args: argparse.Namespace) -> dict:
    cfg = load_config(None, [f"model.path={args.model}", f"rollout.temperature={args.temperature}"])
    policy = load_policy(cfg, None)
    problems = load_problems(args.data)
    if args.limit:
        problems = problems[: args.limit]
    gen = make_generate_fn(policy, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, template=args.template)
    result = run_difficulty_binning(problems, gen, rollouts=args.rollouts, template=args.template, tokenizer=policy.tokenizer,
                                    out_dir=args.out, easy_min=args.easy_min, hard_max=args.hard_max,
                                    batch_size=args.batch_prompts)
    print(f"binned {len(problems)} problems into {args.out}: {result.summary}")
    return result.summary
