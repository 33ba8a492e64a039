"""Where the RL update's time and memory go: one Lite PPO update at the TRL benchmark's shape,
split into its stages, each jitted and timed alone, beside XLA's own FLOP and buffer counts.

    .venv/bin/python benchmarks/update_profile.py [--size 48m] [--rows 64] [--prompt 256] [--response 128]
        [--reps 3] [--remat full,save_attention,save_dots,off] [--prompt-group 1,8]
    .venv/bin/python benchmarks/update_profile.py --lengths lognormal:mean=256,sigma=0.8 --max-new-tokens 1024
        (padded rows, padded rows sharing each prompt's forward, and packed rows on one ragged
        rollout: update and log-prob pass seconds, their ratio, the losses side by side)
        [--stages forward,score,grad,optimizer,update,logprob_pass]

Stages (the update is `train.step.make_update_fn` with one micro-batch, one optimizer step, the
old log-probs scored by the update itself, the LM head on the response positions only, as
`jaxrl4llm train` runs it in benchmarks/vs_trl.py):
  forward       the decoder stack alone: hidden states [B, T, D]
  score         forward + the chunked LM head on the response positions: logp, entropy [B, R]
  grad          value and gradient of the Lite PPO loss (forward + backward; per remat policy, or off)
  optimizer     global-norm clip + AdamW on f32 parameters
  update        the whole jitted update (grad + optimizer + metrics), the number vs_trl.py sees
  logprob_pass  the separate pi_old scoring pass that a multi-step update (mini_batches > 1)
                still runs before the update

Rows come in groups of 8 answers to one prompt (as the sampler lays them out); --prompt-group 8
runs each prompt's forward once for its 8 rows (`UpdateSettings.prompt_group`, the trainer's
`trainer.share_prompt`), 1 runs every row whole (the forward stage is then the
whole-row forward either way).

Per stage: median wall seconds, XLA's FLOPs (`cost_analysis`) against the model count
2 N per token forward, 3x that with the backward (N: the
stack's matmul parameters on every position, the LM head's on the scored ones), temporaries and output bytes (`memory_analysis`).
The machine is noisy: compare stages of one run, not runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from train_step import SIZES  # noqa: E402
from jaxrl4llm.core import LITE_PPO, compute_advantages  # noqa: E402
from jaxrl4llm.sampling import Rollout  # noqa: E402
from jaxrl4llm.train.batching import rollout_to_batch  # noqa: E402
from jaxrl4llm.models import ModelConfig, hidden_states, init_model  # noqa: E402
from jaxrl4llm.models.remat import REMAT_POLICIES  # noqa: E402
from jaxrl4llm.train.policy import make_logprob_fn  # noqa: E402
from jaxrl4llm.train.step import (  # noqa: E402
    TrainBatch, UpdateSettings, batch_loss_terms, init_train_state, make_logprob_pass, make_optimizer, make_update_fn)


def make_batch(cfg: ModelConfig, rows: int, prompt: int, response: int, real_prompt: int, seed: int = 0) -> TrainBatch:
    """The trainer's batch (`rollout_to_batch`) of a synthetic rollout: `real_prompt` real prompt
    tokens left-padded to a `prompt` bucket, then `response` tokens, Lite PPO advantages; rows in
    groups of 8 (when 8 divides `rows`) answer one prompt."""
    rng = np.random.default_rng(seed)
    group = 8 if rows % 8 == 0 else 1
    prompt_mask = np.zeros((rows, prompt), np.float32)
    prompt_mask[:, prompt - real_prompt:] = 1.0
    logp = -np.abs(rng.standard_normal((rows, response))).astype(np.float32)
    rollout = Rollout(
        prompt_tokens=jnp.asarray(np.repeat(rng.integers(0, cfg.vocab_size, (rows // group, prompt)), group, 0),
                                  jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, response)), jnp.int32),
        response_mask=jnp.ones((rows, response), jnp.float32), logprobs=jnp.asarray(logp),
        logprobs_untruncated=jnp.asarray(logp), lengths=jnp.full((rows,), response, jnp.int32),
        truncated=jnp.zeros((rows,), bool))
    rewards = jnp.asarray(rng.integers(0, 2, rows), jnp.float32)
    return rollout_to_batch(rollout, compute_advantages(rewards, group, LITE_PPO))


def ragged_rollout(cfg: ModelConfig, rows: int, prompt: int, real_prompt: int, lengths: np.ndarray, response: int,
                   seed: int = 0):
    """A synthetic rollout whose row b has lengths[b] response tokens (of `response` =
    max_new_tokens) and `real_prompt` prompt tokens left-padded to a `prompt` bucket; rows in
    groups of 8 share a prompt; rewards 0/1. Returns (rollout, rewards, group)."""
    rng = np.random.default_rng(seed)
    group = 8 if rows % 8 == 0 else 1
    prompt_mask = np.zeros((rows, prompt), np.float32)
    prompt_mask[:, prompt - real_prompt:] = 1.0
    response_mask = (np.arange(response)[None] < lengths[:, None]).astype(np.float32)
    logp = -np.abs(rng.standard_normal((rows, response))).astype(np.float32) * response_mask
    rollout = Rollout(
        prompt_tokens=jnp.asarray(np.repeat(rng.integers(0, cfg.vocab_size, (rows // group, prompt)), group, 0),
                                  jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, response)), jnp.int32),
        response_mask=jnp.asarray(response_mask), logprobs=jnp.asarray(logp), logprobs_untruncated=jnp.asarray(logp),
        lengths=jnp.asarray(lengths, jnp.int32), truncated=jnp.asarray(lengths >= response))
    return rollout, jnp.asarray(rng.integers(0, 2, rows), jnp.float32), group


def compare_layouts(args) -> None:
    """--lengths: one Lite PPO update and one log-prob pass of the same ragged rollout with padded
    rows, padded rows sharing each prompt's forward (group 8), and packed rows
    (train/packing.py), timed in one run; the losses must agree."""
    from jaxrl4llm.train.packing import pack, pack_layout, pack_plan
    from jaxrl4llm.train.response_lengths import parse_lengths

    cfg = ModelConfig(architecture="qwen3", tie_word_embeddings=True, dtype="bfloat16", param_dtype="float32",
                      remat=True, remat_policy="full", **SIZES[args.size])
    graphdef, params = init_model(cfg, jax.random.PRNGKey(0))
    W = args.max_new_tokens
    dist = parse_lengths(args.lengths, W)
    lengths = dist.sample(args.rows, W, np.random.default_rng(0)).astype(np.int64)
    rollout, rewards, group = ragged_rollout(cfg, args.rows, args.prompt, args.real_prompt, lengths, W)
    batch = rollout_to_batch(rollout, compute_advantages(rewards, group, LITE_PPO))
    logprob_fn = make_logprob_fn(graphdef, 1.0, args.chunk)
    opt, sched = make_optimizer(lr=1e-6)
    layout = pack_layout(rows=args.rows, mini_batches=1, shards=1, prompt_width=args.prompt, response_width=W,
                         tokens_per_micro_batch=args.tokens_per_micro_batch)
    plan = pack_plan(np.full(args.rows, args.real_prompt), lengths, layout, args.prompt)
    packed = jax.jit(pack)(batch, plan)
    tokens = int(lengths.sum()) + args.rows * (args.real_prompt - 1)
    padded_positions = args.rows * (args.prompt + W - 1)
    packed_positions = int(plan.num_micro.sum()) * layout.positions
    print(f"  {cfg.num_params / 1e6:.1f}M params, {args.rows} rows, responses {dist.describe(W)}: mean "
          f"{lengths.mean():.0f}, max {lengths.max()} of {W}; real positions {tokens}; padded {padded_positions}; "
          f"packed {packed_positions} ({int(plan.num_micro.sum())} micro-batches of {layout.rows_per_shard} rows x "
          f"{layout.row_width})", flush=True)
    arms = {
        "padded": (UpdateSettings(old_logp_from_update=True, scored_tokens=W), batch, (1, W, None)),
        "padded-shared-prompt": (UpdateSettings(old_logp_from_update=True, scored_tokens=W, prompt_group=group),
                                 batch, (1, W, group)),
        "packed": (UpdateSettings(old_logp_from_update=True, packing=layout), packed, (1, None, None)),
    }
    results = {}
    print(f"{'layout':<22} {'update s':>9} {'logprob s':>9} {'compile s':>9} {'loss':>12} {'XLA GFLOP':>10}")
    for name in args.layouts.split(","):
        settings, data, pass_args = arms[name]
        state = init_train_state(jax.tree.map(jnp.copy, params), opt)
        update = jax.jit(make_update_fn(logprob_fn=logprob_fn, recipe=LITE_PPO, optimizer=opt, schedule=sched,
                                        settings=settings), donate_argnums=(0,))
        t = time.perf_counter()
        compiled = update.lower(state, data).compile()
        compile_s = time.perf_counter() - t
        flops = xla_counts(compiled)[0]
        _, metrics, _ = compiled(state, data)  # the loss of the first step, from the same parameters
        loss = float(metrics["loss"])
        state = init_train_state(jax.tree.map(jnp.copy, params), opt)
        _, update_s = timed(compiled, (state, data), args.reps, donate_state=True)
        lp = jax.jit(make_logprob_pass(logprob_fn, *pass_args)).lower(params, data).compile()
        _, pass_s = timed(lp, (params, data), args.reps)
        results[name] = (update_s, pass_s, loss)
        print(f"{name:<22} {update_s:>9.2f} {pass_s:>9.2f} {compile_s:>9.1f} {loss:>12.6f} {flops / 1e9:>10.0f}",
              flush=True)
    if "padded" in results and "packed" in results:
        (u0, p0, l0), (u1, p1, l1) = results["padded"], results["packed"]
        print(f"packed vs padded: update {u0 / u1:.2f}x less time, log-prob pass {p0 / p1:.2f}x; "
              f"loss {l1:.6f} vs {l0:.6f} (relative difference {abs(l1 - l0) / max(abs(l0), 1e-12):.1e})")


def timed(compiled, args, reps: int, donate_state: bool = False) -> tuple[float, float]:
    """(first call seconds, median of `reps` later calls) of a compiled program."""
    t = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        if donate_state:  # the update donates its state: feed it its own output
            args = (out[0],) + tuple(args[1:])
        t = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return first, float(np.median(times))


def xla_counts(compiled) -> tuple[float, float, float]:
    """(FLOPs, temporary bytes, output bytes) of a compiled program, as XLA reports them."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    return float(cost.get("flops", float("nan"))), float(mem.temp_size_in_bytes), float(mem.output_size_in_bytes)


def profile(args, remat: str, group: int):
    """Yields one row per stage (as soon as it is measured); remat: a models/remat.py policy or
    "off"; group: rows per shared prompt forward (1: every row whole)."""
    cfg = ModelConfig(architecture="qwen3", tie_word_embeddings=True, dtype="bfloat16", param_dtype="float32",
                      remat=remat != "off", remat_policy="full" if remat == "off" else remat, **SIZES[args.size])
    graphdef, params = init_model(cfg, jax.random.PRNGKey(0))
    batch = make_batch(cfg, args.rows, args.prompt, args.response, args.real_prompt)
    R = args.response
    logprob_fn = make_logprob_fn(graphdef, 1.0, args.chunk)  # what the trainer's Policy builds
    prompt_group = group if group > 1 else None
    settings = UpdateSettings(old_logp_from_update=True, scored_tokens=R, prompt_group=prompt_group)
    opt, sched = make_optimizer(lr=1e-6)
    state = init_train_state(jax.tree.map(jnp.copy, params), opt)
    all_tokens = args.rows * (args.response - 1) + args.rows // group * args.prompt  # each prompt run once per group
    scored = args.rows * R
    head = cfg.vocab_size * cfg.hidden_size  # the LM head runs on the scored positions only
    body = cfg.num_params - head * (1 if cfg.tie_word_embeddings else 2)  # the embedding lookup is no matmul
    fwd_flops = {"forward": 2 * body * args.rows * (args.prompt + args.response - 1), "score": 2 * (body * all_tokens + head * scored)}
    fwd_flops.update(grad=3 * fwd_flops["score"], update=3 * fwd_flops["score"], logprob_pass=fwd_flops["score"])

    def loss(p):
        terms, _, _ = batch_loss_terms(p, batch, logprob_fn=logprob_fn, recipe=LITE_PPO, old_logp_from_update=True,
                                       scored_tokens=R, prompt_group=prompt_group)
        return terms.value

    grads = jax.jit(jax.grad(loss))(params)
    stages = {
        "forward": (jax.jit(lambda p, b: hidden_states(graphdef, p, b.input_tokens, positions=b.positions,
                                                       attention_mask=b.attention_mask)), (params, batch), False),
        "score": (jax.jit(lambda p, b: logprob_fn(p, b.input_tokens, b.targets, b.positions, b.attention_mask,
                                                  last=R, group=group)), (params, batch), False),
        "grad": (jax.jit(jax.grad(loss)), (params,), False),
        "optimizer": (jax.jit(lambda g, s: opt.update(g, s.opt_state, s.params)), (grads, state), False),
        "update": (jax.jit(make_update_fn(logprob_fn=logprob_fn, recipe=LITE_PPO, optimizer=opt, schedule=sched,
                                          settings=settings), donate_argnums=(0,)), (state, batch), True),
        "logprob_pass": (jax.jit(make_logprob_pass(logprob_fn, 1, R, prompt_group)), (params, batch), False),
    }
    print(f"  ({cfg.num_params / 1e6:.1f}M params, {args.rows} rows x {args.prompt + args.response - 1} positions "
          f"({args.real_prompt} real prompt tokens in a {args.prompt} bucket), {scored} scored tokens)", flush=True)
    for name in args.stages.split(","):
        fn, fargs, donate = stages[name]
        t = time.perf_counter()
        compiled = fn.lower(*fargs).compile()  # compiled once: counted and timed
        compile_s = time.perf_counter() - t
        flops, temp, out = xla_counts(compiled)
        first, med = timed(compiled, fargs, args.reps, donate)
        model = fwd_flops.get(name, float("nan"))
        yield dict(stage=name, remat=remat, group=group, seconds=med, first=first, compile=compile_s, xla_flops=flops, model_flops=model,
                   temp_gib=temp / 2**30, out_gib=out / 2**30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="48m", choices=sorted(SIZES))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256, help="prompt bucket (left-padded width)")
    ap.add_argument("--real-prompt", type=int, default=139, help="real prompt tokens per row (the rest is padding)")
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64, help="LM-head positions per chunk (model.logprob_chunk_size)")
    ap.add_argument("--remat", default="full,save_attention,save_dots",
                    help="comma-separated models/remat.py policies (full, save_attention, save_dots) and/or off")
    ap.add_argument("--prompt-group", default="1,8",
                    help="comma-separated rows per shared prompt forward: 1 (every row whole) and/or 8")
    ap.add_argument("--stages", default="forward,score,grad,optimizer,update,logprob_pass")
    ap.add_argument("--lengths", default=None,
                    help="a response-length distribution (train/response_lengths.py: lognormal:mean=256,sigma=0.8, "
                         "fixed, ...): compare padded, shared-prompt and packed rows on one ragged rollout "
                         "instead of the stages")
    ap.add_argument("--max-new-tokens", type=int, default=1024, help="with --lengths: the response width")
    ap.add_argument("--tokens-per-micro-batch", type=int, default=None,
                    help="with --lengths: the packed micro-batch budget (trainer.tokens_per_micro_batch)")
    ap.add_argument("--layouts", default="padded,padded-shared-prompt,packed", help="with --lengths: which layouts")
    args = ap.parse_args()
    if args.lengths:
        print(f"update layouts, {args.size}, jax {jax.__version__} on {jax.devices()[0].platform}, "
              f"1-min load average {os.getloadavg()[0]:.1f}")
        compare_layouts(args)
        return
    if args.real_prompt > args.prompt:
        ap.error(f"--real-prompt {args.real_prompt} is longer than the --prompt bucket {args.prompt}")
    print(f"update profile, {args.size}, jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"1-min load average {os.getloadavg()[0]:.1f}")
    print(f"{'stage':<13} {'remat':<14} {'group':>5} {'seconds':>8} {'compile':>8} {'1st call':>8} {'XLA GFLOP':>10} {'model GFLOP':>11} "
          f"{'XLA/model':>9} {'temp GiB':>8} {'out GiB':>8}")
    groups = [int(g) for g in args.prompt_group.split(",")]
    if any(g not in (1, 8) or args.rows % g for g in groups):
        ap.error(f"--prompt-group {args.prompt_group!r}: use 1 and/or 8 (with --rows a multiple of 8)")
    for remat, group in [(r, g) for r in args.remat.split(",") for g in groups]:
        if remat not in REMAT_POLICIES + ("off",):
            ap.error(f"--remat {remat!r}: use {', '.join(REMAT_POLICIES)} or off")
        for r in profile(args, remat, group):
            ratio = r["xla_flops"] / r["model_flops"] if r["model_flops"] == r["model_flops"] else float("nan")
            print(f"{r['stage']:<13} {r['remat']:<14} {r['group']:>5} {r['seconds']:>8.2f} {r['compile']:>8.1f} {r['first']:>8.2f} "
                  f"{r['xla_flops'] / 1e9:>10.0f} {r['model_flops'] / 1e9:>11.0f} {ratio:>9.2f} "
                  f"{r['temp_gib']:>8.2f} {r['out_gib']:>8.2f}", flush=True)
    print(f"1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
