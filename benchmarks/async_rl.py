"""Step throughput of asynchronous RL against the synchronous loop, in one run on simulated CPU
devices: trainer.max_staleness = 0 (sampler and update take turns on all 8 devices) against k = 1
with the devices split (mesh.sampler_devices = 4: the rollout of step t + 1 is sampled on 4
devices while update t runs on the other 4) and k = 1 on shared devices (the rewards of the next
rollout are scored while the update runs). A fourth arm runs the synchronous loop on 4 devices
alone: on this CPU a sharded program's cost depends on the simulated device count, so the split's
gain over it is what the overlap itself brings. Each arm is its own process.

    .venv/bin/python benchmarks/async_rl.py [--steps 8] [--warmup 2] [--prompts 16] [--samples 8]
        [--max-new-tokens 32] [--warmstart runs/demo/warmstart]

The policy is the demo's warm start (built under --warmstart if missing, ~2 min): its responses
have the demo task's natural length distribution (EOS wherever the policy stops), not the budget.
Each arm is a `jaxrl4llm train` of the demo config (Lite PPO; decoupled PPO with
is_correction=mis_token for k = 1) for --steps steps; the figure is the median wall time of a step
after --warmup steps (compiles excluded), with the sampling and update times the run logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]

ASYNC = {"trainer.max_staleness": 1, "algorithm.overrides": "{is_correction: mis_token, is_cap: 5.0}"}
ARMS = {  # name: (simulated devices, overrides)
    "synchronous, 8 devices": (8, {}),
    "synchronous, 4 devices (the split's trainer alone)": (4, {}),
    "k=1, sampler 4 + trainer 4 devices": (8, {**ASYNC, "mesh.sampler_devices": 4}),
    "k=1, 8 shared devices": (8, ASYNC),
}


def run_arm(name: str, args) -> dict:
    """One arm in this process (its device count set before jax starts): medians over the steps after warmup."""
    devices, extra = ARMS[name]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    from jaxrl4llm.data import write_demo_task
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.demo import DEMO_TASK, config_path
    from jaxrl4llm.train.loop import train

    assert jax.device_count() == devices, jax.devices()
    root = Path(tempfile.mkdtemp(prefix="async_rl_"))
    data = write_demo_task(root / "data", **DEMO_TASK)
    overrides = {
        "model.path": args.warmstart, "data.train_files": f"[{data['train']}]", "data.eval_files": "[]",
        "rollout.prompts_per_step": args.prompts, "rollout.samples_per_prompt": args.samples,
        "rollout.max_new_tokens": args.max_new_tokens, "trainer.steps": args.steps, "trainer.eval_every": -1,
        "trainer.checkpoint_every": 0, "trainer.export_hf": False, "trainer.progress_bar": False,
        "trainer.out_dir": str(root / "run"), "trainer.compile_cache": "off", **extra}
    cfg = load_config(config_path(), [f"{k}={v}" for k, v in overrides.items()])
    history = train(cfg, log=lambda s: None)["history"][args.warmup:]
    med = lambda key: statistics.median(r[key] for r in history)
    return {"step_s": med("time_step"), "sampling_s": med("time_sampling"), "update_s": med("time_update"),
            "reward_s": med("time_reward"), "response_length": statistics.mean(r["response_length"] for r in history)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--warmstart", default=str(REPO / "runs" / "demo" / "warmstart"))
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm, print its JSON
    args = ap.parse_args()
    if args.arm:
        print("ARM " + json.dumps(run_arm(args.arm, args)), flush=True)
        return
    if not (Path(args.warmstart) / "config.json").is_file():
        from jaxrl4llm.data import write_demo_task
        from jaxrl4llm.train.demo import DEMO_TASK, build_warm_start

        data = write_demo_task(Path(tempfile.mkdtemp(prefix="async_rl_")) / "data", **DEMO_TASK)
        build_warm_start(Path(args.warmstart), data["train"])
    results = {}
    for name in ARMS:  # each arm in its own process: its own simulated device count
        command = [sys.executable, __file__, "--arm", name, *sys.argv[1:]]
        out = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        line = next((x for x in out.stdout.splitlines() if x.startswith("ARM ")), None)
        if line is None:
            raise SystemExit(f"arm {name!r} failed:\n{out.stderr[-3000:]}")
        r = results[name] = json.loads(line[4:])
        print(f"{name:50s} step {r['step_s']:.3f} s  sampling {r['sampling_s']:.3f} s  reward {r['reward_s']:.3f} s  "
              f"update(+wait) {r['update_s']:.3f} s  mean response {r['response_length']:.1f} tokens", flush=True)
    base = results["synchronous, 8 devices"]["step_s"]
    for name, r in results.items():
        r["speedup"] = base / r["step_s"]
        print(f"{name:50s} {r['speedup']:.2f}x the synchronous 8-device loop's step rate")
    print(f"load average: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
