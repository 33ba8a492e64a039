"""Does the meter predict a step it can see? `plan --topology cpu` against the same programs timed here.

    .venv/bin/python benchmarks/plan_accuracy.py [--size 48m] [--prompts 8] [--samples 8] [--response 128]
        [--stop-tokens 0,1200] [--reps 3]

vs_trl.py's random 48M Qwen3 (or a random model of another --size; no download) is set up as `jaxrl4llm train` sets it up (`train.loop.setup_run`:
the same sampler, log-prob pass and update programs, the demo task's prompts). The rollout runs at
two length distributions: with no stop token every row runs to the budget (`fixed`); with K of
the vocabulary's ids as stop tokens (--stop-tokens) a random model stops a row with probability
about K / V a step, so rows end early and a static batch runs until its longest row ends. For each:
  measured   wall seconds of the rollout (median of --reps after a compile), of the log-prob pass
             and of the update on that rollout's batch;
  predicted  `plan.programs.plan_run(cfg, "cpu", lengths=<the rollout's own lengths>)`: XLA's HLO
             cost of each program with every loop trip counted, priced at this CPU's matmul peak
             and memory bandwidth measured in the same run (`plan.chips.measure_cpu_chip`).
Prints predicted / measured per program and for the step. The machine is noisy: one run's ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.data import build_char_tokenizer, write_demo_task  # noqa: E402
from jaxrl4llm.plan.programs import plan_run  # noqa: E402
from jaxrl4llm.train.config import load_config  # noqa: E402
from jaxrl4llm.train.loop import build_batch, setup_run  # noqa: E402
from jaxrl4llm.train.response_lengths import LengthDistribution  # noqa: E402
from jaxrl4llm.train.step import join_params  # noqa: E402
from train_step import SIZES  # noqa: E402


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


CONFIG_FILES = ["configs/lite_ppo.yaml"]  # the study's recipe
PROGRAMS = ("sampler/decode", "logprob pass", "update")  # the programs timed here, by plan's names


def run_overrides(root: Path, size: str | dict, *, prompts: int, samples: int, response: int,
                  mini_batches: int) -> list[str]:
    """`key=value` overrides of the run on CONFIG_FILES: vs_trl.py's 48M model (random Qwen3,
    32000-token BPE) on GSM8K prompts (139 tokens in a 192 bucket), or a random model of another
    size (a name of train_step.SIZES, or a dict of ModelConfig size fields) on the demo task."""
    if size == "48m":
        from vs_trl import DATA, build_48m

        model = {"model.path": str(build_48m(root / "qwen3_48m"))}
        data = {"data.train_files": f"[{DATA}]", "data.template": "base", "data.max_prompt_tokens": 192,
                "data.on_overlong_prompt": "drop"}
    else:
        fields = SIZES[size] if isinstance(size, str) else size
        tasks = write_demo_task(root / "data", num_train=256, num_test=8, seed=0, digits=2, ops="+-", steps=2)
        model = {"model.tokenizer": build_char_tokenizer(root / "tokenizer"), "model.architecture": "qwen3",
                 "model.tie_word_embeddings": True, **{f"model.{k}": v for k, v in fields.items()}}
        data = {"data.train_files": f"[{tasks['train']}]", "data.template": "demo", "data.max_prompt_tokens": 64}
    overrides = {
        **model, **data, "model.dtype": "bfloat16", "model.param_dtype": "float32", "data.shuffle": False,
        "rollout.prompts_per_step": prompts, "rollout.samples_per_prompt": samples,
        "rollout.max_new_tokens": response, "rollout.cpu_kernels": False,
        "trainer.mini_batches": mini_batches, "trainer.micro_batch_size": prompts * samples // mini_batches,
        "trainer.out_dir": str(root / "run"), "trainer.progress_bar": False, "trainer.eval_every": -1,
        "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def run_config(args, root: Path):
    """The run of `run_overrides` at --size, --prompts, --samples, --response, --mini-batches."""
    return load_config(CONFIG_FILES, run_overrides(root, args.size, prompts=args.prompts, samples=args.samples,
                                                   response=args.response, mini_batches=args.mini_batches))


def one_device_mesh():
    """The ("data", "fsdp", "tensor") mesh of this process's first device."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))


def update_batch(run, state, rollout):
    """The update's batch of `rollout` with random 0/1 rewards, as the loop builds it."""
    rewards = np.random.default_rng(0).integers(0, 2, int(rollout.lengths.shape[0])).astype(np.float32)
    return build_batch(run, state, rollout, rewards, 0)[0]


def runs_logprob_pass(run) -> bool:
    """Whether the run's step has a separate log-prob pass (not when the update scores old_logp itself)."""
    return run.settings.old_logp_from_update is False and run.cfg.trainer.old_logp_source == "recompute"


def time_update_programs(run, state, rollout, reps: int):
    """Median wall seconds of the log-prob pass (0 when the update scores old_logp itself) and of
    the update on `rollout`'s batch (random 0/1 rewards), each after a compile: (logprob s, update s,
    state after the updates)."""
    batch = update_batch(run, state, rollout)
    t_logprob = 0.0
    if runs_logprob_pass(run):
        params = join_params(state.params, state.frozen)
        run.logprob_pass(params, batch)
        t_logprob = median_seconds(lambda: run.logprob_pass(params, batch)[0], reps)
    box = {"state": state}

    def update():
        box["state"], metrics, _ = run.update(box["state"], batch)
        return metrics

    update()  # compile
    return t_logprob, median_seconds(update, reps), box["state"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="48m", choices=sorted(SIZES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--mini-batches", type=int, default=2, help="2: the update runs 2 optimizer steps and the "
                    "separate pi_old log-prob pass runs")
    ap.add_argument("--stop-tokens", default="0,1200", help="stop-token counts, one length distribution each")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(args, Path(tmp))
        run, state = setup_run(cfg, one_device_mesh(), print)
        prompt_set = run.train_set
        prompts = [prompt_set.token_ids[i] for i in range(args.prompts)]
        vocab = run.policy.config.vocab_size
        rows = []
        for k in (int(x) for x in args.stop_tokens.split(",")):
            # stop tokens from the top of the vocabulary (the char tokenizer's and the BPE's specials are low ids)
            k = min(k, vocab // 2)
            stop = tuple(range(vocab - k, vocab)) if k else (vocab - 1,)
            policy = run.policy.with_state(state)
            policy = dataclasses.replace(policy, eos_token_ids=stop)
            key = jax.random.PRNGKey(k)
            sample = lambda: policy.generate(prompts, num_samples=args.samples, max_new_tokens=args.response,
                                             temperature=1.0, top_p=1.0, top_k=0, rng=key).response_tokens
            sample()  # compile
            t_rollout = median_seconds(sample, args.reps)
            rollout = policy.generate(prompts, num_samples=args.samples, max_new_tokens=args.response, temperature=1.0,
                                      top_p=1.0, top_k=0, rng=key)
            lengths = np.asarray(rollout.lengths)
            t_logprob, t_update, state = time_update_programs(run, state, rollout, args.reps)
            real_prompt = float(np.asarray(rollout.prompt_mask).sum(-1).mean())
            plan = plan_run(cfg, "cpu", lengths=LengthDistribution("empirical", values=tuple(int(x) for x in lengths),
                                                                  source=f"{k} stop tokens"),
                            prompt_tokens=real_prompt)
            predicted = {p.name: p.seconds * p.runs for p in plan.programs}
            measured = dict(zip(PROGRAMS, (t_rollout, t_logprob, t_update)))
            print(f"\n{k} stop tokens: mean length {lengths.mean():.1f}, longest {lengths.max()} of {args.response} "
                  f"(CPU measured: peak {plan.chip.peak_flops / 1e12:.3f} TFLOP/s, {plan.chip.hbm_bandwidth / 1e9:.1f} GB/s)")
            print(f"{'program':<16} {'measured s':>11} {'predicted s':>12} {'pred/meas':>9} {'binding':>8} "
                  f"{'compute s':>10} {'memory s':>9}")
            for p in plan.programs:
                if p.name not in measured:
                    continue
                m = measured[p.name]
                ratio = predicted[p.name] / m if m else float("nan")
                print(f"{p.name:<16} {m:>11.3f} {predicted[p.name]:>12.3f} {ratio:>9.2f} {p.binding:>8} "
                      f"{p.compute_seconds * p.runs:>10.3f} {p.memory_seconds * p.runs:>9.3f}")
            total_m = sum(measured.values())
            total_p = sum(predicted[n] for n in measured)
            print(f"{'step (3 programs)':<16} {total_m:>11.3f} {total_p:>12.3f} {total_p / total_m:>9.2f}")
            rows.append((k, total_m, total_p))
        print("\nsummary: " + "; ".join(f"{k} stop tokens: step predicted / measured {p / m:.2f}" for k, m, p in rows))


if __name__ == "__main__":
    main()
