"""Partial rollouts against one continuous call per rollout, at a length distribution.

    python benchmarks/partial_rollouts.py [--size 48m] [--prompts 8] [--samples 8] [--rollouts 4]
        [--lengths lognormal:mean=64,sigma=0.8] [--max-new-tokens 256] [--slots 64,16]

K consecutive rollouts of P prompts x G samples, the same weights, row lengths drawn from the
distribution (a new draw per rollout) and forced through `row_max_new_tokens` with no EOS, so
both arms sample exactly the same tokens:
- per rollout: `generate(engine="continuous", slots=S)` once per rollout (the synchronous loop):
  each call decodes until its longest row ends, its slots draining at the tail;
- partial: `sampling.partial.PartialRollouts` with S slots (rollout.partial): a segment decodes
  until rollout t is complete and admits rollout t+1's rows into the slots rollout t's rows free.
It prints tokens/s of both (sum of lengths over the wall time of the K rollouts, compile
excluded: a warm-up pass of 2 rollouts of each arm first), their ratio, and whether the tokens are
equal. The first segment starts from empty slots and the last has no next rollout to admit, so
the steady-state gain needs many rollouts; `jaxrl4llm plan` models the steady state
(`plan.decode_work.continuous_decode_work(partial=True)`), and this script prints that model's step
ratio for the run's K rollouts beside the measured one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sampler import SAMPLED, draw_lengths, make_hf_model  # noqa: E402
from jaxrl4llm.models import load_pretrained  # noqa: E402
from jaxrl4llm.plan.decode_work import segment_schedule  # noqa: E402
from jaxrl4llm.sampling.continuous import BURST  # noqa: E402
from jaxrl4llm.sampling import generate  # noqa: E402
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket  # noqa: E402
from jaxrl4llm.sampling.partial import PartialRollouts  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="48m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--lengths", default="lognormal:mean=64,sigma=0.8")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--slots", default="64,16", help="comma-separated slot counts, one comparison each")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)

    p, g, r, k = args.prompts, args.samples, args.max_new_tokens, args.rollouts
    rows = p * g
    lengths = [draw_lengths(args.lengths, rows, r, seed=t) for t in range(k)]
    total = int(sum(x.sum() for x in lengths))
    with tempfile.TemporaryDirectory() as folder:
        make_hf_model(args.size, args.dtype, folder)
        model = load_pretrained(folder, dtype=args.dtype, param_dtype=args.dtype)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = [[row.tolist() for row in rng.integers(1, model.config.vocab_size, (p, args.prompt_len))]
               for _ in range(k)]
    width = bucket(args.prompt_len, PROMPT_BUCKETS)
    keys = [jax.random.key(100 + t) for t in range(k)]
    print(f"{args.size}, {k} rollouts of {p} prompts x {g} samples, R = {r}, {args.dtype}; lengths {args.lengths}: "
          f"mean {np.mean(lengths):.0f}, max {max(x.max() for x in lengths)}; {total} tokens")

    def per_rollout(slots, k=k):
        outs = [generate(graphdef, state, prompts[t], num_samples=g, max_new_tokens=r, eos_token_ids=[], pad_token_id=0,
                         rng=keys[t], row_max_new_tokens=lengths[t], engine="continuous", slots=slots,
                         prompt_buckets=(width,), **SAMPLED) for t in range(k)]
        return [np.asarray(jax.block_until_ready(o.response_tokens)) for o in outs]

    def partial(slots, k=k):
        stream = PartialRollouts(graphdef, state, num_prompts=p, num_samples=g, max_new_tokens=r, prompt_len=width,
                                 eos_token_ids=[], pad_token_id=0, slots=slots, **SAMPLED)
        stream.enqueue(prompts[0], keys[0], lengths[0])
        outs = []
        for t in range(k):
            if t + 1 < k:
                stream.enqueue(prompts[t + 1], keys[t + 1], lengths[t + 1])
            outs.append(stream.segment(graphdef, state, version=0)[0].response_tokens)
        return [np.asarray(jax.block_until_ready(o)) for o in outs]

    def step_ratio(slots):  # decode steps of the K calls over those of the K segments, replayed on the host
        stream = np.concatenate(lengths)[None]
        steps = lambda x, ahead: sum(seg[2] for seg in segment_schedule(x, rows, slots, g, BURST, 16, 8, 0.0, ahead))
        return sum(steps(x[None], False) for x in lengths) / steps(stream, True)

    print(f"{'slots':>6} | {'per rollout tok/s':>17} {'partial tok/s':>13} {'x':>6} | {'x decode steps':>14} | "
          f"{'same tokens':>11}")
    for slots in (int(s) for s in args.slots.split(",")):
        results = {}
        for name, arm in (("per rollout", per_rollout), ("partial", partial)):
            arm(slots, k=2)  # compile
            start = time.perf_counter()
            results[name] = (arm(slots), time.perf_counter() - start)
        same = all(np.array_equal(a, b) for a, b in zip(results["per rollout"][0], results["partial"][0]))
        base, part = total / results["per rollout"][1], total / results["partial"][1]
        print(f"{slots:>6} | {base:>17.0f} {part:>13.0f} {part / base:>6.2f} | {step_ratio(slots):>14.2f} | "
              f"{str(same):>11}", flush=True)


if __name__ == "__main__":
    main()
