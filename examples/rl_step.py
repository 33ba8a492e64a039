"""One RL iteration for LLM reasoning, top to bottom: sample -> score -> advantages -> batch -> update.

Lite PPO ("Tricks or Traps? A Deep Dive into RL for LLM Reasoning", arXiv 2508.08221) on the demo's
arithmetic word problems, composed from jaxrl4llm's public functions in one file, as purejaxrl's
`ppo.py` writes PPO. `rl_step` is the iteration `jaxrl4llm train` runs (jaxrl4llm/train/loop.py),
without what the trainer adds around it: sharding, micro-batches, packed or shared-prompt rows,
asynchronous rollouts, dynamic-sampling refills, metrics files, checkpoints and evaluation.

    python examples/rl_step.py --steps 3 --seed 0    # the demo's warm start (300 SFT steps) first
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from jaxrl4llm.core import LITE_PPO, compute_advantages, policy_loss
from jaxrl4llm.data import encode_prompts, load_problems, write_demo_task
from jaxrl4llm.models import load_pretrained, load_tokenizer, score_tokens
from jaxrl4llm.rewards import batch_math_reward
from jaxrl4llm.sampling import decode_responses, generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.demo import DEMO_TASK, build_warm_start

RECIPE = LITE_PPO  # group-mean / batch-std advantages, PPO clip 0.2 / 0.2, token-mean loss, no KL
TEMPLATE = "demo"  # the prompt is "Q: {problem}\nA:"
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(2e-4))  # configs/demo.yaml's clip and peak lr


def setup(workdir, *, seed: int = 0, sft_steps: int = 300, log=print):
    """The demo task (one-digit two-step +/- word problems) and the demo's warm start: a 0.4M-parameter
    Qwen3-shaped model, SFT on worked solutions whose boxed answer is wrong 40% of the time
    (jaxrl4llm/train/demo.py), so that the verifier's reward has something to fix."""
    paths = write_demo_task(Path(workdir) / "data", **DEMO_TASK)
    warm = build_warm_start(Path(workdir) / "warmstart", paths["train"], seed=seed, sft_steps=sft_steps, log=log)
    graphdef, params = nnx.split(load_pretrained(warm, dtype="float32"))  # static structure, pytree of arrays
    return graphdef, params, load_tokenizer(warm), load_problems(paths["train"])


def scores(graphdef, params, batch):
    """log pi(y_t | x, y_<t) and the policy's entropy at every position of a teacher-forced batch [B, L]."""
    return score_tokens(graphdef, params, batch.input_tokens, batch.targets, positions=batch.positions,
                        attention_mask=batch.attention_mask)


def make_update(graphdef, optimizer, recipe=RECIPE):
    """update(params, opt_state, batch) -> (params, opt_state, metrics): one jitted optimizer step."""

    def loss_fn(params, batch):
        logp, entropy = scores(graphdef, params, batch)
        # l_bt = -min(r_bt A_b, clip(r_bt, 1 - eps, 1 + eps) A_b), r_bt = exp(logp - old_logp), aggregated as
        # the recipe says (Lite PPO: token-level, the sum over all response tokens / their count, Sec. 4.3)
        terms, metrics = policy_loss(recipe, logp=logp, old_logp=batch.old_logp, advantages=batch.advantages,
                                     mask=batch.loss_mask, row_weights=batch.row_weights, entropy=entropy)
        return terms.value, metrics

    @jax.jit
    def update(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return optax.apply_updates(params, updates), opt_state, metrics

    return update


def rl_step(graphdef, params, opt_state, update, tokenizer, problems, key, *, reward_fn=batch_math_reward,
            group_size: int = 8, max_new_tokens: int = 32, mini_batches: int = 2):
    """One iteration on `problems` (the step's prompts) -> (params, opt_state, stats, batch): stats are the
    rollout's mean reward and length and the last mini-batch's loss metrics. reward_fn(responses, golds)
    -> N floats: the verifier, or any batched reward of that form."""
    G = group_size
    # 1. Sample: G responses per prompt from the current policy (temperature 1, no top-k / top-p).
    prompts, _, _ = encode_prompts(problems, tokenizer, TEMPLATE, max_prompt_tokens=96)
    rollout = generate(graphdef, params, prompts, num_samples=G, max_new_tokens=max_new_tokens, temperature=1.0,
                       eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, rng=key)
    # 2. Score: the study's rule-based outcome reward, 1 when the final (boxed) answer equals the gold, else 0.
    golds = [p.answer for p in problems for _ in range(G)]  # rows p*G .. p*G+G-1 answer prompt p
    rewards = np.asarray(reward_fn(decode_responses(rollout, tokenizer), golds), np.float32)
    # 3. Advantages, Lite PPO's normalisation (Sec. 4.1): A_i = (r_i - mean of its group) / std of the batch.
    adv = compute_advantages(rewards, G, RECIPE)
    # 4. Batch: prompt + response laid out for teacher forcing, the loss mask on response tokens, and the
    #    behaviour policy's log-probs pi_old recomputed by a scoring pass (the trainer's old_logp_source: recompute).
    batch = rollout_to_batch(rollout, adv)
    batch = batch._replace(old_logp=scores(graphdef, params, batch)[0])
    # 5. Update: one Adam step per mini-batch of whole groups; from the second on, the policy has moved
    #    away from pi_old and the clip can bind (PPO's reuse of one rollout for several steps).
    if len(problems) % mini_batches:
        raise ValueError(f"{len(problems)} prompts do not split into {mini_batches} mini-batches of whole groups")
    rows = len(rewards) // mini_batches
    for i in range(mini_batches):
        mini = jax.tree.map(lambda x: x[i * rows:(i + 1) * rows], batch)
        params, opt_state, metrics = update(params, opt_state, mini)
    stats = {k: float(metrics[k]) for k in ("loss", "entropy", "clip_frac", "approx_kl", "grad_norm")}
    stats.update(reward=float(rewards.mean()), response_length=float(np.mean(rollout.lengths)))
    return params, opt_state, stats, batch


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description="One RL iteration, top to bottom (Lite PPO on the demo task).")
    parser.add_argument("--steps", type=int, default=3, help="RL iterations")
    parser.add_argument("--seed", type=int, default=0, help="seed of the warm start, the prompts and the sampler")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step, even (each sampled 8 times)")
    parser.add_argument("--sft-steps", type=int, default=300, help="warm start's SFT steps, >= 1 (the demo's: 300)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        graphdef, params, tokenizer, problems = setup(work, seed=args.seed, sft_steps=args.sft_steps)
    opt_state, update = OPTIMIZER.init(params), make_update(graphdef, OPTIMIZER)
    key, draw = jax.random.PRNGKey(args.seed), np.random.default_rng(args.seed)
    history = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        key, sample_key = jax.random.split(key)
        chosen = [problems[i] for i in draw.choice(len(problems), args.prompts, replace=False)]
        params, opt_state, stats, _ = rl_step(graphdef, params, opt_state, update, tokenizer, chosen, sample_key)
        print(f"step {step}: reward {stats['reward']:.3f}  loss {stats['loss']:+.4f}  entropy {stats['entropy']:.3f}  "
              f"clip_frac {stats['clip_frac']:.3f}  length {stats['response_length']:.1f}  "
              f"({time.perf_counter() - start:.1f} s)")
        history.append(stats)
    return history


if __name__ == "__main__":
    main()
