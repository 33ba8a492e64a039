"""Which row form is fastest for a workload: padded rows, padded rows sharing each prompt's forward,
and packed rows, timed on one synthetic rollout per workload, beside what `trainer.packing: auto`
picks (`train.layout.choose_row_form`).

    .venv/bin/python benchmarks/row_form.py [--workloads demo,ragged] [--repeats 4] [--size demo]
        [--ragged-lengths lognormal:mean=64,sigma=0.8] [--ragged-max-new-tokens 256]

Workloads (rows in groups of G = 8 answers to one prompt):
  demo    the demo's step: 128 rows, 2 mini-batches (so a pi_old log-prob pass before the update),
          48-58 real prompt tokens in a 64 bucket, nearly equal responses (23-27 of 32 tokens)
  ragged  64 rows, one mini-batch (pi_old scored by the update), 35 real prompt tokens in a 64
          bucket, responses from --ragged-lengths of --ragged-max-new-tokens, packed micro-batches
          of 4096 positions (docs/training.md's lognormal mean 256 of 1024 with 139 of 256 prompt
          tokens and the default 16384-position budget, scaled down 4x for a 2-core CPU)
Per form, one step's trainer work: (packed) the host's pack plan and the pack program, (two
mini-batches) the pi_old log-prob pass, and the update. Each form is compiled first, then the
forms run interleaved (A B C A B C ...) `--repeats` times, since the machine is shared and noisy;
the median per form is printed with its ratio to the best, and auto's pick and its ratio.
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
from update_profile import ragged_rollout  # noqa: E402
from jaxrl4llm.core import LITE_PPO, compute_advantages  # noqa: E402
from jaxrl4llm.models import ModelConfig, init_model  # noqa: E402
from jaxrl4llm.train.batching import rollout_to_batch  # noqa: E402
from jaxrl4llm.train.layout import ROW_FORMS, choose_row_form  # noqa: E402
from jaxrl4llm.train.packing import pack, pack_layout, pack_plan  # noqa: E402
from jaxrl4llm.train.policy import make_logprob_fn  # noqa: E402
from jaxrl4llm.train.response_lengths import parse_lengths  # noqa: E402
from jaxrl4llm.train.step import UpdateSettings, init_train_state, make_logprob_pass, make_optimizer, make_update_fn  # noqa: E402

GROUP = 8


def workload(name: str, args) -> dict:
    """rows, mini_batches, prompt bucket P, real prompt lengths [rows], response lengths [rows], R,
    and the length distribution auto is told (None: its prior)."""
    rng = np.random.default_rng(0)
    if name == "demo":
        rows, R = 128, 32
        plen = np.repeat(rng.integers(48, 59, rows // GROUP), GROUP)
        rlen = rng.choice([23, 23, 23, 23, 24, 25, 27], rows)
        return dict(rows=rows, mini_batches=2, prompt=64, plen=plen, rlen=rlen, R=R, budget=None)
    rows, R = 64, args.ragged_max_new_tokens
    dist = parse_lengths(args.ragged_lengths, R)
    rlen = np.clip(dist.sample(rows, R, rng).astype(np.int64), 1, R)
    return dict(rows=rows, mini_batches=1, prompt=64, plen=np.full(rows, 35), rlen=rlen, R=R,
                budget=args.ragged_tokens_per_micro_batch)


def build_forms(cfg: ModelConfig, graphdef, params, w: dict, chunk: int) -> dict:
    """{form: (step function (state, key) -> state, initial state)} of the three row forms; a step
    runs its form's whole trainer work for the workload's rollout."""
    rows, n, P, R = w["rows"], w["mini_batches"], w["prompt"], w["R"]
    rollout, rewards, group = ragged_rollout(cfg, rows, P, int(w["plen"].max()), w["rlen"], R)
    mask = (np.arange(P)[None] >= P - w["plen"][:, None]).astype(np.float32)  # per-row real prompt tokens
    rollout = rollout._replace(prompt_mask=jnp.asarray(mask))
    batch = rollout_to_batch(rollout, compute_advantages(rewards, group, LITE_PPO))
    logprob_fn = make_logprob_fn(graphdef, 1.0, chunk)
    opt, sched = make_optimizer(lr=1e-6)
    single = n == 1
    layout = pack_layout(rows=rows, mini_batches=n, shards=1, prompt_width=P, response_width=R,
                         tokens_per_micro_batch=w["budget"])
    pack_fn = jax.jit(pack)
    forms = {}
    for form in ROW_FORMS:
        packed = form == "packed"
        settings = UpdateSettings(mini_batches=n, old_logp_from_update=single, scored_tokens=None if packed else R,
                                  prompt_group=GROUP if form == "shared_prompt" else None,
                                  packing=layout if packed else None)
        update = jax.jit(make_update_fn(logprob_fn=logprob_fn, recipe=LITE_PPO, optimizer=opt, schedule=sched,
                                        settings=settings), donate_argnums=(0,))
        logprob_pass = jax.jit(make_logprob_pass(logprob_fn, 1, None if packed else R,
                                                 GROUP if form == "shared_prompt" else None))

        def step(state, update=update, logprob_pass=logprob_pass, packed=packed):
            data = batch
            if packed:
                data = pack_fn(batch, pack_plan(w["plen"], w["rlen"], layout, P))
            if not single:
                old, _ = logprob_pass(state.params, data)
                data = data._replace(old_logp=old * data.loss_mask)
            state, metrics, _ = update(state, data)
            jax.block_until_ready(metrics)
            return state

        forms[form] = step
    return forms, init_train_state(params, opt), layout


def run_workload(name: str, args) -> None:
    w = workload(name, args)
    cfg = ModelConfig(architecture="qwen3", tie_word_embeddings=True, dtype="float32", param_dtype="float32",
                      **SIZES[args.size])
    graphdef, params = init_model(cfg, jax.random.PRNGKey(0))
    forms, state0, layout = build_forms(cfg, graphdef, params, w, args.chunk)
    choice = choose_row_form(rows=w["rows"], prompt_width=w["prompt"], prompt_tokens=float(w["plen"].mean()),
                             max_new_tokens=w["R"], prompt_group=GROUP, packing=layout)
    print(f"\n{name}: {w['rows']} rows, packed micro-batches of {layout.rows_per_shard} rows x {layout.row_width}, {w['mini_batches']} mini-batch(es), prompts {w['plen'].mean():.0f} of "
          f"{w['prompt']}, responses mean {w['rlen'].mean():.0f} (min {w['rlen'].min()}, max {w['rlen'].max()}) of "
          f"{w['R']}, {args.size} model ({cfg.num_params / 1e6:.2f}M params)", flush=True)
    states = {}
    for form, step in forms.items():  # compile + first call
        t = time.perf_counter()
        states[form] = step(jax.tree.map(jnp.copy, state0))
        print(f"  {form:<14} compile + first step {time.perf_counter() - t:6.1f} s", flush=True)
    times = {form: [] for form in forms}
    for _ in range(args.repeats):  # interleaved: A B C A B C ...
        for form, step in forms.items():
            t = time.perf_counter()
            states[form] = step(states[form])
            times[form].append(time.perf_counter() - t)
    med = {form: float(np.median(ts)) for form, ts in times.items()}
    best = min(med.values())
    for form in forms:
        print(f"  {form:<14} {med[form]:7.3f} s per step  {med[form] / best:5.2f}x the best  "
              f"(runs {' '.join(f'{t:.2f}' for t in times[form])}; expected positions {choice.positions[form]:.0f})")
    ratio = med[choice.form] / best
    print(f"  auto picks {choice.form}: {ratio:.2f}x the best ({'within' if ratio <= 1.10 else 'NOT within'} 10%)")
    print(f"  why: {choice.reason}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="demo,ragged")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--size", default="demo", choices=sorted(SIZES))
    ap.add_argument("--chunk", type=int, default=128, help="LM-head positions per chunk (model.logprob_chunk_size)")
    ap.add_argument("--ragged-lengths", default="lognormal:mean=64,sigma=0.8")
    ap.add_argument("--ragged-max-new-tokens", type=int, default=256)
    ap.add_argument("--ragged-tokens-per-micro-batch", type=int, default=4096,
                    help="trainer.tokens_per_micro_batch of the ragged workload (the default 16384 scaled down 4x)")
    args = ap.parse_args()
    print(f"row forms, jax {jax.__version__} on {jax.devices()[0].platform}, 1-min load average {os.getloadavg()[0]:.1f}")
    for name in args.workloads.split(","):
        run_workload(name, args)
    print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
