"""The demo: Lite PPO on the built-in arithmetic task, on the CPU, in a few minutes.

    jaxrl4llm demo [--task arithmetic|tools] [--out-dir runs/demo] [--rebuild-warmstart] [key=value ...]

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

`--task tools` runs the tool task instead (`data/tool_task.py`: products of two 3-digit numbers,
`configs/examples/tool_demo.yaml`: rollout.tools on, fence format): its warm start is SFT on a teacher
that writes a ```python block for 30% of the problems (`warm_start_completions`) and the product in
its text for the rest; RL with tools raises the share of problems solved by code.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

from jaxrl4llm.data import demo_solution, format_prompt, load_problems, write_demo_task
from jaxrl4llm.data.tool_task import CODE_SHARE, warm_start_completions, write_tool_task
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train
from jaxrl4llm.train.report import print_run_report
from jaxrl4llm.train.warm_start import DEMO_MODEL, SFT_DEFAULTS, ensure_warm_start
from jaxrl4llm.train.warm_start import build_warm_start as build_sft_warm_start

DEMO_TASK = dict(num_train=4000, num_test=200, seed=0, digits=1, ops="+-", steps=2)
SFT = dict(**SFT_DEFAULTS, answer_noise=0.4)
TOOL_TASK = dict(num_train=4000, num_test=200, seed=0)
# a tool solution takes ~70 characters after a ~25-character prompt
TOOL_SFT = dict(SFT_DEFAULTS, length=128, code_share=CODE_SHARE)
REPO = Path(__file__).resolve().parents[2]
TASKS = ("arithmetic", "tools")
CONFIGS = {"arithmetic": "demo.yaml", "tools": "examples/tool_demo.yaml"}


def config_path(task: str = "arithmetic") -> Path:
    if task not in CONFIGS:
        raise ValueError(f"unknown demo task {task!r}: choose one of {', '.join(TASKS)}")
    path = REPO / "configs" / CONFIGS[task]
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


def build_tool_warm_start(path: Path, train_file: str, *, seed: int = 0, sft_steps: int | None = None,
                          log=print) -> Path:
    """SFT a random demo-size model on the tool task's teacher (`warm_start_completions`: code for
    TOOL_SFT["code_share"] of the problems, the product in text for the rest); an HF folder at `path`."""
    problems = load_problems(train_file)
    prompts = [format_prompt(p, "demo") for p in problems]
    completions = [(c, True) for c in warm_start_completions(problems, code_share=TOOL_SFT["code_share"], seed=seed)]
    log(f"warm start: a teacher that writes Python for {TOOL_SFT['code_share']:.0%} of the problems")
    sft = {k: TOOL_SFT[k] for k in SFT_DEFAULTS} | {"steps": sft_steps or TOOL_SFT["steps"]}
    return build_sft_warm_start(path, prompts, completions, model=DEMO_MODEL, sft=sft, seed=seed, log=log)


def warm_start_recipe(sft_steps: int | None = None, task: str = "arithmetic") -> dict:
    """Everything the warm start depends on: model shape, task, SFT settings and seed (the
    arithmetic demo's recipe as it always was; the tool task's names its task)."""
    if task == "tools":
        return {"model": DEMO_MODEL, "task": {"name": "tools", **TOOL_TASK},
                "sft": {**TOOL_SFT, "steps": sft_steps or TOOL_SFT["steps"]}, "seed": 0}
    return {"model": DEMO_MODEL, "task": DEMO_TASK, "sft": {**SFT, "steps": sft_steps or SFT["steps"]}, "seed": 0}


def prepare_task(out: Path, task: str, sft_steps: int | None, rebuild: bool, log=print) -> dict:
    """The demo task's files under out/data and its warm start under out/warmstart (reused when built
    from the same recipe): {"train", "test", "warmstart"} paths."""
    if task not in CONFIGS:
        raise ValueError(f"unknown demo task {task!r}: choose one of {', '.join(TASKS)}")
    paths = write_tool_task(out / "data", **TOOL_TASK) if task == "tools" else write_demo_task(out / "data", **DEMO_TASK)
    build = build_tool_warm_start if task == "tools" else build_warm_start
    recipe = warm_start_recipe(sft_steps, task)
    warm = ensure_warm_start(out / "warmstart", recipe, lambda path: build(
        path, paths["train"], seed=recipe["seed"], sft_steps=recipe["sft"]["steps"], log=log), rebuild=rebuild, log=log)
    return {**paths, "warmstart": str(warm)}


def run_demo(out_dir: str = "runs/demo", overrides: list[str] | None = None, quick: bool = False,
             rebuild_warmstart: bool = False, sft_steps: int | None = None, log=print, task: str = "arithmetic") -> dict:
    """Runs the demo of `task` ("arithmetic", or "tools": the tool task); returns the train summary
    (its run folder: "out_dir") plus "total_seconds"."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    paths = prepare_task(out, task, sft_steps or (30 if quick else None), rebuild_warmstart, log)
    t_warm = time.perf_counter() - t0
    base = [f"model.path={paths['warmstart']}", f"data.train_files=[{paths['train']}]", f"data.eval_files=[{paths['test']}]",
            f"trainer.out_dir={out / 'rl'}", "trainer.overwrite=true"]  # the demo's own run folder: replaced each time
    if quick:
        base += ["trainer.steps=3", "data.eval_limit=32", "trainer.checkpoint_every=0", "trainer.eval_samples=2"]
    cfg = load_config(config_path(task), base + list(overrides or []))
    summary = train(cfg, log=log)
    print_run_report(summary)
    total = time.perf_counter() - t0
    log(f"time: {total:.0f}s in total ({t_warm:.0f}s task + warm start, {total - t_warm:.0f}s RL with evaluation)")
    summary["total_seconds"] = total
    return summary
