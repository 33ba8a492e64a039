"""Sampler-trainer log-prob agreement on real and tiny checkpoints (issue #39).

    python benchmarks/mismatch.py [--model DIR] [--tiny 64,128] [--dtypes bfloat16,float32]
                                  [--samplers continuous/xla,continuous/cpu_native,static] [--packing true,false]
                                  [--prompts 8] [--samples 4] [--tokens 64] [--out FILE.json]
                                  [--numerics exact]

For every model (a Hugging Face folder, e.g. SmolLM2-135M-Instruct from
scripts/materialize_smollm2.py, prompted with its chat template; and random-init Qwen3-shaped
tiny models of hidden size 64, 128, ... built in-process, std 0.1, prompted with random ids),
every compute dtype, every sampler (engine / decode attention: `rollout.engine` and
`rollout.decode_attention`; on CPU "xla" runs XLA's ops, "cpu_native" the C++ CPU kernels for the
matmuls and the paged attention; the static engine has no paged attention) and every trainer
row form (`trainer.packing` true: packed rows through segment attention; false: padded rows),
it samples P prompts x G samples x R tokens at temperature 1 (no top-k/top-p, so the sampler's
untruncated log-prob is the sampled one) and re-scores the same tokens with the trainer's
log-prob pass (`train.step.make_logprob_pass`, the program the loop's `old_logp` comes from).
With d_t = logp_trainer - logp_sampler on the response tokens (`core.mismatch_log_ratio`) it
reports:

    out_10   share of tokens with exp(d_t) outside [0.9, 1.1]
    out_1    share of tokens with exp(d_t) outside [0.99, 1.01]
    max|d|, mean|d|
    seq_out  share of rows whose sequence ratio exp(sum_t d_t) leaves [0.5, 2]

`--numerics exact` builds the models with `model.numerics: exact` (kernels/exact.py): the sampler is
then the continuous engine with the exact kernels ("continuous/exact"; --samplers is ignored), and
max|d| = 0 says no token's log-probs differ in any bit.

Prints one table; --out writes the rows as JSON. The trainer's attention path is the CPU's
(`TrainAttention.XLA`, block-causal segment attention) for both row forms.

    python benchmarks/mismatch.py --invariance [--model DIR] [--tiny 64,128] [--dtypes ...] [--out FILE.json]

Batch invariance (issue #39, item 3; tests/train/test_batch_invariance.py holds float32 to it):
the same rows' log-probs under other batch compositions, d_t = logp_variant - logp_reference on
the response tokens (`agreement_stats`). Trainer, padded rows (reference: the whole batch at
once): each row alone, the rows in reverse order, two halves. Trainer, packed rows (reference:
`pack_plan`'s first-fit packing): one sequence per row. Sampler (reference: every row in a slot
at once, same seed): N/2 slots and G slots; rows are compared up to their first differing token
(a bf16 difference can flip a draw), and `diverged` counts the rows whose tokens part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl4llm.core import LITE_PPO, agreement_stats, compute_advantages
from jaxrl4llm.models import init_model, load_pretrained
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.packing import pack, pack_layout, pack_plan, to_padded
from jaxrl4llm.train.policy import make_logprob_fn
from jaxrl4llm.train.step import make_logprob_pass
from numerics import tiny_config  # a sibling benchmark (this folder is on sys.path when run as a script)

SAMPLERS = ("continuous/xla", "continuous/cpu_native", "static")
EXACT_SAMPLER = "continuous/exact"  # --numerics exact: the decode attention `model.numerics` chooses
CHAT_QUESTIONS = ("What is 17 times 23?", "Write a haiku about rain.", "Explain photosynthesis in two sentences.",
                  "Name three prime numbers.", "What is the capital of France?", "Give me one tip for learning Python.",
                  "Why is the sky blue?", "Count from one to five in words.")


def load_model(name: str, dtype: str, prompts: int, numerics: str = "default"):
    """(graphdef, state, prompt id lists, eos ids) of 'tiny:H' or a checkpoint folder."""
    if name.startswith("tiny:"):
        config = dataclasses.replace(tiny_config(int(name[5:]), dtype), numerics=numerics)
        graphdef, state = init_model(config, jax.random.PRNGKey(0), std=0.1)
        rng = np.random.default_rng(0)
        ids = [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(3, 40, size=prompts)]
        return graphdef, state, ids, (1,)
    import transformers  # the chat template; benchmark-time only

    graphdef, state = nnx.split(load_pretrained(name, dtype=dtype, numerics=numerics))
    tok = transformers.AutoTokenizer.from_pretrained(name)
    ids = []
    for i in range(prompts):
        out = tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                                      add_generation_prompt=True, tokenize=True)
        ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    return graphdef, state, ids, (int(tok.eos_token_id),)


def sample(graphdef, state, prompts, eos, sampler: str, args):
    engine, _, attention = sampler.partition("/")
    kw = dict(engine=engine, cpu_kernels=attention == "cpu_native")
    if sampler == EXACT_SAMPLER:
        kw = dict(engine=engine)
    elif engine == "continuous":
        kw["paged_attention"] = attention
    return generate(graphdef, state, prompts, num_samples=args.samples, max_new_tokens=args.tokens, temperature=1.0,
                    eos_token_ids=eos, pad_token_id=0, rng=jax.random.PRNGKey(args.seed), **kw)


def trainer_agreement(graphdef, state, rollout, packing: bool, chunk_size: int):
    """`core.mismatch.agreement_stats` of the trainer's log-probs against the sampler's, through the
    loop's log-prob pass (`make_logprob_pass`) on padded or packed rows."""
    n, r = rollout.response_tokens.shape
    adv = compute_advantages(jnp.zeros(n, jnp.float32), 1, LITE_PPO)
    batch = rollout_to_batch(rollout, adv)
    logprob_fn = make_logprob_fn(graphdef, 1.0, chunk_size)
    if not packing:
        logp, _ = jax.jit(make_logprob_pass(logprob_fn, 1, r))(state, batch)
        return agreement_stats(logp, batch.sampler_logp, batch.loss_mask)
    prompt_width = rollout.prompt_tokens.shape[1]
    layout = pack_layout(rows=n, mini_batches=1, shards=1, prompt_width=prompt_width, response_width=r,
                         tokens_per_micro_batch=None)
    plan = pack_plan(np.asarray(rollout.prompt_mask).sum(axis=1), np.asarray(rollout.lengths), layout, prompt_width)
    packed = jax.jit(pack)(batch, plan)
    logp, _ = jax.jit(make_logprob_pass(logprob_fn, 1))(state, packed)
    flat = lambda x: x.reshape(-1, x.shape[-1])  # [n, M, RR, S] -> [n M RR, S]
    # a sequence is (packed row, segment id): number them 0 .. in row-major order
    seg = flat(packed.segment_ids)
    width = int(seg.max()) + 1
    key = np.asarray(jnp.arange(seg.shape[0])[:, None] * width + seg)
    _, ids = np.unique(key, return_inverse=True)
    return agreement_stats(flat(logp), flat(packed.sampler_logp), flat(packed.loss_mask),
                           jnp.asarray(ids.reshape(seg.shape)), int(ids.max()) + 1)


def measure(args) -> list[dict]:
    results = []
    models = ([args.model] if args.model else []) + [f"tiny:{h}" for h in args.tiny.split(",") if h]
    for model in models:
        for dtype in args.dtypes.split(","):
            graphdef, state, prompts, eos = load_model(model, dtype, args.prompts, args.numerics)
            samplers = [EXACT_SAMPLER] if args.numerics == "exact" else args.samplers.split(",")
            for sampler in samplers:
                t0 = time.perf_counter()
                rollout = sample(graphdef, state, prompts, eos, sampler, args)
                for packing in args.packing.split(","):
                    stats = trainer_agreement(graphdef, state, rollout, packing == "true", args.chunk_size)
                    row = dict(model=os.path.basename(model.rstrip("/")), dtype=dtype, sampler=sampler,
                               packing=packing == "true", **{k: v.item() for k, v in stats.items()},
                               seconds=round(time.perf_counter() - t0, 1))
                    results.append(row)
                    print_row(row)
    return results


def invariance(graphdef, state, prompts, eos, args) -> list[dict]:
    """Rows of (variant, tokens, max|d|, mean|d|, diverged) for one model and dtype (module docstring)."""
    sampler = next((s for s in args.samplers.split(",") if s.startswith("continuous")), "continuous/xla")
    rollout = sample(graphdef, state, prompts, eos, sampler, args)
    n, r = rollout.response_tokens.shape
    batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(n, jnp.float32), 1, LITE_PPO))
    logp_pass = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, args.chunk_size), 1, r))
    score = lambda rows: np.asarray(logp_pass(state, jax.tree.map(lambda x: x[np.asarray(rows)], batch))[0])
    mask = np.asarray(batch.loss_mask)
    reference = score(np.arange(n))
    out = []

    def row(variant, logp, ref, m, diverged=0):
        stats = agreement_stats(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(m))
        out.append(dict(variant=variant, tokens=int(stats["tokens"]), max_abs=float(stats["max_abs"]),
                        mean_abs=float(stats["mean_abs"]), diverged=diverged))

    row("trainer padded: each row alone", np.concatenate([score([b]) for b in range(n)]), reference, mask)
    row("trainer padded: reversed order", score(np.arange(n)[::-1])[::-1], reference, mask)
    half = n // 2
    row("trainer padded: two halves", np.concatenate([score(np.arange(half)), score(np.arange(half, n))]), reference,
        mask)
    prompt_width = rollout.prompt_tokens.shape[1]
    layout = pack_layout(rows=n, mini_batches=1, shards=1, prompt_width=prompt_width, response_width=r,
                         tokens_per_micro_batch=None)
    packed_pass = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, args.chunk_size), 1))
    lengths = (np.asarray(rollout.prompt_mask).sum(axis=1), np.asarray(rollout.lengths))

    def packed(lay):
        plan = pack_plan(*lengths, lay, prompt_width)
        return to_padded(np.asarray(packed_pass(state, jax.jit(pack)(batch, plan))[0]), plan, n, mask.shape[1])

    one_per_row = dataclasses.replace(layout, sequences_per_row=1)
    row("trainer packed: one sequence per row", packed(one_per_row), packed(layout), mask)
    for slots in (n // 2, args.samples):
        other = generate(graphdef, state, prompts, num_samples=args.samples, max_new_tokens=args.tokens,
                         temperature=1.0, eos_token_ids=eos, pad_token_id=0, rng=jax.random.PRNGKey(args.seed),
                         engine="continuous", cpu_kernels=sampler.endswith("cpu_native"),
                         paged_attention=sampler.partition("/")[2], slots=slots)
        same = np.asarray(other.response_tokens) == np.asarray(rollout.response_tokens)
        agree = np.cumprod(same, axis=1) * np.asarray(rollout.response_mask) * np.asarray(other.response_mask)
        row(f"sampler {sampler}: {slots} slots, not {n}", np.asarray(other.logprobs_untruncated),
            np.asarray(rollout.logprobs_untruncated), agree, diverged=int((~same.all(axis=1)).sum()))
    return out


def measure_invariance(args) -> list[dict]:
    results = []
    models = ([args.model] if args.model else []) + [f"tiny:{h}" for h in args.tiny.split(",") if h]
    print(f"{'model':>14s} {'dtype':>8s} {'variant':>52s} {'tokens':>6s} {'max|d|':>9s} {'mean|d|':>9s} "
          f"{'diverged':>8s}")
    for model in models:
        for dtype in args.dtypes.split(","):
            graphdef, state, prompts, eos = load_model(model, dtype, args.prompts)
            for r in invariance(graphdef, state, prompts, eos, args):
                r = dict(model=os.path.basename(model.rstrip("/")), dtype=dtype, **r)
                results.append(r)
                print(f"{r['model']:>14s} {r['dtype']:>8s} {r['variant']:>52s} {r['tokens']:6d} {r['max_abs']:9.2e} "
                      f"{r['mean_abs']:9.2e} {r['diverged']:8d}", flush=True)
    return results


HEADER = (f"{'model':>14s} {'dtype':>8s} {'sampler':>21s} {'packing':>7s} {'tokens':>6s} {'out[.9,1.1]':>11s} "
          f"{'out[.99,1.01]':>13s} {'max|d|':>8s} {'mean|d|':>9s} {'seq out[.5,2]':>13s}")


def print_row(r: dict) -> None:
    print(f"{r['model']:>14s} {r['dtype']:>8s} {r['sampler']:>21s} {str(r['packing']):>7s} {r['tokens']:6d} "
          f"{100 * r['out_10']:10.2f}% {100 * r['out_1']:12.2f}% {r['max_abs']:8.2g} {r['mean_abs']:9.2g} "
          f"{100 * r['seq_out']:12.1f}%", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face checkpoint folder (e.g. SmolLM2 materialised)")
    ap.add_argument("--tiny", default="64,128", help="hidden sizes of random Qwen3-shaped models ('' = none)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--samplers", default=",".join(SAMPLERS), help=f"engine/decode attention, of {SAMPLERS}")
    ap.add_argument("--packing", default="true,false")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=128, help="the trainer's logprob chunk (model.logprob_chunk_size)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--invariance", action="store_true", help="batch invariance: the same rows under other batch "
                    "compositions, packings and slot counts (module docstring)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--numerics", default="default", choices=["default", "exact"],
                    help="model.numerics of the models (exact: the continuous sampler with the exact kernels)")
    args = ap.parse_args(argv)
    for s in args.samplers.split(","):
        if s not in SAMPLERS:
            sys.exit(f"--samplers: {s!r} is not one of {SAMPLERS}")
    if args.invariance:
        results = measure_invariance(args)
    else:
        print(HEADER)
        results = measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
