"""Does RL learn to use the tool? The tool task from one warm start, with tools on, off and wrong.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tool_learning.py [--out runs/tool_learning]
        [--steps 30] [--arms on,off,wrong] [--eval-limit 100] [--eval-samples 2] [--seed 0]
        [--workers 2] [--rebuild-warmstart] [--sft-steps N] [key=value ...]

1. writes the tool task (`data/tool_task.py`: products of two 3-digit numbers) and builds its warm
   start under OUT (`train.demo.prepare_task`, as `jaxrl4llm demo --task tools` does: SFT on a
   teacher that writes a ```python block for 30% of the problems and the product in its text for
   the rest); a warm start already under OUT from the same recipe is reused;
2. runs `configs/examples/tool_demo.yaml` (Lite PPO, rollout.tools on, fence format) from that warm
   start with the same seed for --steps steps in each arm:
   - on: the Python executor as configured;
   - off: `rollout.tools.format=null` (the model's ```output block is its own text);
   - wrong: the real engine and executor, but every integer the executor prints is off by one
     (`WrongExecutor`, a wrapper of `tools.PythonExecutor` that this script puts in place of the
     trainer's executor for that arm only): the tool is called, its output is forced into the
     row, and copying it gives a wrong answer;
   held-out accuracy is measured before the first and after the last step on the first
   --eval-limit test problems, --eval-samples samples each at temperature 1.0, with the arm's tool
   (none for off, the off-by-one one for wrong);
3. prints and writes OUT/tool_learning.json and OUT/tool_learning.md: per arm, held-out accuracy
   before -> after, tool calls per row and the tool-token share (of the response tokens) over the
   training rollouts (mean over the steps, and at the last step), the training reward at the first
   and last steps, and the run's seconds (compile, evaluations and steps). Extra key=value
   arguments are config overrides for every arm.

docs/results/tools.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl4llm.tools.python_executor import PythonExecutor, ToolResult  # noqa: E402

ARMS = ("on", "off", "wrong")
INT = re.compile(r"-?\d+")


def off_by_one(text: str) -> str:
    """Every integer in `text` plus one ("-3" -> "-2", "12345" -> "12346")."""
    return INT.sub(lambda m: str(int(m.group()) + 1), text)


class WrongExecutor(PythonExecutor):
    """The Python executor whose printed integers are all off by one (a tool that returns wrong numbers)."""

    def run(self, codes):
        return [ToolResult(r.status, off_by_one(r.output) if r.status == "ok" else r.output, r.seconds)
                for r in super().run(codes)]


@contextlib.contextmanager
def wrong_tool():
    """The trainer builds its executor as `train.policy.PythonExecutor(...)`: swapped for WrongExecutor."""
    from jaxrl4llm.train import policy

    saved, policy.PythonExecutor = policy.PythonExecutor, WrongExecutor
    try:
        yield
    finally:
        policy.PythonExecutor = saved


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tool_learning")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--eval-limit", type=int, default=100, help="held-out problems evaluated")
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="rollout.tools.workers")
    parser.add_argument("--rebuild-warmstart", action="store_true")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (default: the demo's)")
    parser.add_argument("overrides", nargs="*", help="config key=value for every arm")
    args = parser.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        parser.error(f"--arms: unknown {bad}: choose from {', '.join(ARMS)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def arm_overrides(arm: str, paths: dict, out: Path, args) -> list[str]:
    base = [f"model.path={paths['warmstart']}", f"data.train_files=[{paths['train']}]",
            f"data.eval_files=[{paths['test']}]", f"trainer.out_dir={out / arm}", "trainer.overwrite=true",
            f"trainer.steps={args.steps}", f"trainer.eval_every={args.steps}", f"trainer.seed={args.seed}",
            f"data.eval_limit={args.eval_limit}", f"trainer.eval_samples={args.eval_samples}",
            "trainer.checkpoint_every=0", "trainer.progress_bar=false", "trainer.export_hf=false",
            f"rollout.tools.workers={args.workers}"]
    if arm == "off":
        base.append("rollout.tools.format=null")
    return base + list(args.overrides)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def arm_figures(summary: dict, seconds: float) -> dict:
    history = summary["history"]
    steps = [h for h in history if "reward" in h or "tools/calls_per_row" in h] or history

    def series(key):
        return [h.get(key) for h in steps]

    calls, share = series("tools/calls_per_row"), series("tools/token_share")
    reward = series("reward")
    return {
        "accuracy_before": (summary.get("eval_before") or {}).get("accuracy"),
        "accuracy_after": (summary.get("eval_after") or {}).get("accuracy"),
        "calls_per_row_mean": _mean(calls), "calls_per_row_last": calls[-1] if calls else None,
        "token_share_mean": _mean(share), "token_share_last": share[-1] if share else None,
        "reward_first": reward[0] if reward else None, "reward_last": reward[-1] if reward else None,
        "steps": len(steps), "seconds": seconds, "run_dir": summary.get("out_dir"),
    }


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(results: dict) -> str:
    header = ("| arm | held-out accuracy before -> after | calls / row (mean; last step) "
              "| tool-token share (mean; last step) | reward (first; last step) | run seconds |")
    lines = [header, "|---|---|---|---|---|---|"]
    for arm, r in results.items():
        lines.append(f"| {arm} | {_pct(r['accuracy_before'])} -> {_pct(r['accuracy_after'])} "
                     f"| {_num(r['calls_per_row_mean'])}; {_num(r['calls_per_row_last'])} "
                     f"| {_pct(r['token_share_mean'])}; {_pct(r['token_share_last'])} "
                     f"| {_num(r['reward_first'], '{:.3f}')}; {_num(r['reward_last'], '{:.3f}')} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.demo import config_path, prepare_task
    from jaxrl4llm.train.loop import train
    from jaxrl4llm.train.report import print_run_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths = prepare_task(out, "tools", args.sft_steps, args.rebuild_warmstart)
    print(f"task + warm start: {time.perf_counter() - t0:.0f}s ({paths['warmstart']})")
    results = {}
    for arm in args.arms:
        cfg = load_config(config_path("tools"), arm_overrides(arm, paths, out, args))
        print(f"== arm {arm}: {args.steps} steps ==", flush=True)
        t = time.perf_counter()
        with wrong_tool() if arm == "wrong" else contextlib.nullcontext():
            summary = train(cfg, log=print)
        print_run_report(summary)
        results[arm] = arm_figures(summary, time.perf_counter() - t)
        r = results[arm]
        print(f"arm {arm}: held-out accuracy {_pct(r['accuracy_before'])} -> {_pct(r['accuracy_after'])}, "
              f"{r['seconds']:.0f}s", flush=True)
        (out / "tool_learning.json").write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "jax": jax.__version__,
             "python": sys.version.split()[0], "devices": str(jax.devices()), "results": results}, indent=1))
    md = table(results)
    (out / "tool_learning.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'tool_learning.json'} and {out / 'tool_learning.md'}")


if __name__ == "__main__":
    main()
