"""The demo: Lite PPO on the built-in arithmetic task, on the CPU, in a few minutes.

    jaxrl4llm demo [--out-dir runs/demo] [--rebuild-warmstart] [key=value ...]

1. writes the demo task (1-digit, two-step +/- word problems; train/test JSONL) under OUT;
2. builds the warm start (OUT/warmstart, an HF folder with a character-level tokenizer): a
   0.4M-parameter Qwen3-shaped model fine-tuned (SFT) on worked solutions from a *noisy
   teacher* whose final boxed answer is wrong in 40% of the examples (the worked steps are
   right). The policy computes well but often boxes a wrong number: an unreliable base model
   that the verifier's reward can fix. It takes about two minutes and is reused by later runs
   while its recipe (`warmstart.json`) matches; `--rebuild-warmstart` forces a new one;
3. runs `configs/demo.yaml` (Lite PPO) from that checkpoint, with the same templates,
   verifier, loaders, sampler and train step as a real run;
4. prints the step table and `held-out accuracy: X% -> Y%` (4 samples per test problem at the
   rollout temperature 1.0); `jaxrl4llm demo` then draws the run's curves (`cli.cmd_demo`, with
   `study.plot.plot_runs`) and prints the PNG's path.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

from jaxrl4llm.data import demo_solution, format_prompt, load_problems, write_demo_task
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train
from jaxrl4llm.train.report import print_run_report
from jaxrl4llm.train.warm_start import DEMO_MODEL, SFT_DEFAULTS, ensure_warm_start
from jaxrl4llm.train.warm_start import build_warm_start as build_sft_warm_start

DEMO_TASK = dict(num_train=4000, num_test=200, seed=0, digits=1, ops="+-", steps=2)
SFT = dict(**SFT_DEFAULTS, answer_noise=0.4)
REPO = Path(__file__).resolve().parents[2]


def config_path() -> Path:
    path = REPO / "configs" / "demo.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the demo from a jaxrl4llm checkout (configs/ ships with the repository).")
    return path


def noisy_solution(solution: str, rng: random.Random, noise: float) -> str:
    r"""With probability `noise`, replace the boxed answer by a wrong one (off by 1-3); steps stay right."""
    if rng.random() >= noise:
        return solution
    m = re.search(r"\\boxed\{(-?\d+)\}$", solution)
    wrong = int(m.group(1)) + rng.choice([-3, -2, -1, 1, 2, 3])
    return solution[: m.start(1)] + str(wrong) + "}"


def build_warm_start(path: Path, train_file: str, *, seed: int = 0, sft_steps: int | None = None, log=print) -> Path:
    """SFT a random demo-size model on noisy-teacher worked solutions; save an HF folder at `path`."""
    problems = load_problems(train_file)
    rng = random.Random(seed)
    prompts = [format_prompt(p, "demo") for p in problems]
    completions = [(noisy_solution(demo_solution(p), rng, SFT["answer_noise"]), True) for p in problems]
    log(f"warm start: noisy teacher, {SFT['answer_noise']:.0%} wrong boxed answers")
    sft = {k: SFT[k] for k in SFT_DEFAULTS} | {"steps": sft_steps or SFT["steps"]}
    return build_sft_warm_start(path, prompts, completions, model=DEMO_MODEL, sft=sft, seed=seed, log=log)


def warm_start_recipe(sft_steps: int | None = None) -> dict:
    """Everything the warm start depends on: model shape, task, SFT settings and seed."""
    return {"model": DEMO_MODEL, "task": DEMO_TASK, "sft": {**SFT, "steps": sft_steps or SFT["steps"]}, "seed": 0}


def run_demo(out_dir: str = "runs/demo", overrides: list[str] | None = None, quick: bool = False,
             rebuild_warmstart: bool = False, sft_steps: int | None = None, log=print) -> dict:
    """Runs the demo; returns the train summary (its run folder: "out_dir") plus "total_seconds"."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    paths = write_demo_task(out / "data", **DEMO_TASK)
    warm = out / "warmstart"
    recipe = warm_start_recipe(sft_steps or (30 if quick else None))
    ensure_warm_start(warm, recipe, lambda path: build_warm_start(path, paths["train"], seed=recipe["seed"],
                                                                  sft_steps=recipe["sft"]["steps"], log=log),
                      rebuild=rebuild_warmstart, log=log)
    t_warm = time.perf_counter() - t0
    base = [f"model.path={warm}", f"data.train_files=[{paths['train']}]", f"data.eval_files=[{paths['test']}]",
            f"trainer.out_dir={out / 'rl'}", "trainer.overwrite=true"]  # the demo's own run folder: replaced each time
    if quick:
        base += ["trainer.steps=3", "data.eval_limit=32", "trainer.checkpoint_every=0", "trainer.eval_samples=2"]
    cfg = load_config(config_path(), base + list(overrides or []))
    summary = train(cfg, log=log)
    print_run_report(summary)
    total = time.perf_counter() - t0
    log(f"time: {total:.0f}s in total ({t_warm:.0f}s task + warm start, {total - t_warm:.0f}s RL with evaluation)")
    summary["total_seconds"] = total
    return summary
