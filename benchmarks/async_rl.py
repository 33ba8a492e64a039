"""Step throughput of asynchronous RL against the synchronous loop, in one run on 8 simulated CPU
devices: trainer.max_staleness = 0 (sampler and update take turns on all 8 devices) against k = 1
with the devices split (mesh.sampler_devices = 4: the rollout of step t + 1 is sampled on 4
devices while update t runs on the other 4) and k = 1 on shared devices (the rewards of the next
rollout are scored while the update runs).

    .venv/bin/python benchmarks/async_rl.py [--steps 8] [--warmup 2] [--prompts 16] [--samples 8]
        [--max-new-tokens 32] [--warmstart runs/demo/warmstart]

The policy is the demo's warm start (built under --warmstart if missing, ~2 min): its responses
have the demo task's natural length distribution (EOS wherever the policy stops), not the budget.
Each arm is a `jaxrl4llm train` of the demo config (Lite PPO; decoupled PPO with
is_correction=mis_token for k = 1) for --steps steps; the figure is the median wall time of a step
after --warmup steps (compiles excluded), with the sampling and update times the run logs.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

ARMS = {
    "synchronous (k=0, 8 shared devices)": {"trainer.max_staleness": 0},
    "k=1, sampler 4 + trainer 4 devices": {"trainer.max_staleness": 1, "mesh.sampler_devices": 4,
                                           "algorithm.overrides": "{is_correction: mis_token, is_cap: 5.0}"},
    "k=1, 8 shared devices": {"trainer.max_staleness": 1,
                              "algorithm.overrides": "{is_correction: mis_token, is_cap: 5.0}"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--warmstart", default=str(REPO / "runs" / "demo" / "warmstart"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import jax

    from jaxrl4llm.data import write_demo_task
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.demo import DEMO_TASK, build_warm_start, config_path
    from jaxrl4llm.train.loop import train

    assert jax.device_count() == 8, jax.devices()
    root = Path(tempfile.mkdtemp(prefix="async_rl_"))
    data = write_demo_task(root / "data", **DEMO_TASK)
    warm = Path(args.warmstart)
    if not (warm / "config.json").is_file():
        build_warm_start(warm, data["train"])
    results = {}
    for name, extra in ARMS.items():
        overrides = {
            "model.path": str(warm), "data.train_files": f"[{data['train']}]", "data.eval_files": "[]",
            "rollout.prompts_per_step": args.prompts, "rollout.samples_per_prompt": args.samples,
            "rollout.max_new_tokens": args.max_new_tokens, "trainer.steps": args.steps, "trainer.eval_every": -1,
            "trainer.checkpoint_every": 0, "trainer.export_hf": False, "trainer.progress_bar": False,
            "trainer.out_dir": str(root / name.split()[0].replace("=", "") / str(len(results))),
            "trainer.compile_cache": "off", **extra}
        cfg = load_config(config_path(), [f"{k}={v}" for k, v in overrides.items()])
        history = train(cfg, log=lambda s: None)["history"][args.warmup:]
        med = lambda key: statistics.median(r[key] for r in history)
        results[name] = {"step_s": med("time_step"), "sampling_s": med("time_sampling"),
                         "update_s": med("time_update"), "reward_s": med("time_reward"),
                         "response_length": statistics.mean(r["response_length"] for r in history)}
        print(f"{name:40s} step {results[name]['step_s']:.3f} s  sampling {results[name]['sampling_s']:.3f} s  "
              f"reward {results[name]['reward_s']:.3f} s  update(+wait) {results[name]['update_s']:.3f} s  "
              f"mean response {results[name]['response_length']:.1f} tokens", flush=True)
    base = results["synchronous (k=0, 8 shared devices)"]["step_s"]
    for name, r in results.items():
        r["speedup"] = base / r["step_s"]
        print(f"{name:40s} {r['speedup']:.2f}x the synchronous loop's step rate")
    print(f"load average: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
