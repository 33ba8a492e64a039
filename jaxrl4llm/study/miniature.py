"""The miniature study's setup (issue #40; docs/results/miniature.md): the chain task and its two
warm starts, the stand-ins for the study's base and instruct models.

    jaxrl4llm miniature prepare [--out-dir runs/miniature]   # data/, base_like/, aligned_like/
    jaxrl4llm miniature pilot   [--out-dir runs/miniature]   # the gates, before any grid runs

`prepare` writes the chain task (data/chain_task.py) under OUT/data and SFTs one model per
teacher mixture (``BASE_LIKE``, ``ALIGNED_LIKE``) into OUT/base_like and OUT/aligned_like; a
folder built from the same recipe is reused. The grids (configs/sweeps/chain_*.yaml) read these
paths.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np

from jaxrl4llm.data import format_prompt, load_problems
from jaxrl4llm.data.chain_task import (ALIGNED_LIKE, BASE_LIKE, CHAIN_BANDS, TeacherMixture, teacher_completion,
                                       write_chain_task)
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train
from jaxrl4llm.train.warm_start import build_warm_start, ensure_warm_start

CHAIN_TASK = dict(num_train=4000, num_test_per_band=100, seed=0)
CHAIN_MODEL = dict(architecture="qwen3", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=32)
# prompt "Q: 7+5-3+8=?\nA:" (at most 27 tokens with BOS) + " " + at most DEGENERATE_CHARS + EOS
CHAIN_SFT = dict(steps=600, batch_size=64, lr=3e-3, length=128)
DEGENERATE_CHARS = 96  # a loop or run-on in the SFT data: as long as the long budget (96 new tokens)
TEMPLATE = "demo"
STARTS = {"base_like": BASE_LIKE, "aligned_like": ALIGNED_LIKE}


def start_recipe(name: str) -> dict:
    """Everything the warm start `name` depends on (reused only on an exact match)."""
    return {"task": CHAIN_TASK, "model": CHAIN_MODEL, "sft": CHAIN_SFT, "teacher": dataclasses.asdict(STARTS[name]),
            "degenerate_chars": DEGENERATE_CHARS, "template": TEMPLATE, "seed": 0}


def teacher_data(train_file: str, mixture: TeacherMixture, *, seed: int = 0) -> tuple[list[str], list]:
    """(prompts, completions) of the SFT set: every training problem once, its completion drawn from
    `mixture` (data/chain_task.teacher_completion)."""
    rng = random.Random(seed)
    problems = load_problems(train_file)
    prompts = [format_prompt(p, TEMPLATE) for p in problems]
    completions = [teacher_completion(p, mixture, rng, max_chars=DEGENERATE_CHARS) for p in problems]
    return prompts, completions


def prepare(out_dir: str | Path = "runs/miniature", *, rebuild: bool = False, log=print) -> dict[str, str]:
    """Writes the chain task and builds (or reuses) both warm starts; returns their paths
    ({"train", "<band>"..., "base_like", "aligned_like"})."""
    out = Path(out_dir)
    paths = write_chain_task(out / "data", **CHAIN_TASK)
    for name, mixture in STARTS.items():
        def build(path, mixture=mixture, name=name):
            log(f"{name}: teacher {mixture}")
            prompts, completions = teacher_data(paths["train"], mixture)
            build_warm_start(path, prompts, completions, model=CHAIN_MODEL, sft=CHAIN_SFT, log=log)

        paths[name] = str(ensure_warm_start(out / name, start_recipe(name), build, rebuild=rebuild, log=log))
    return paths


REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "miniature"  # chain.yaml, then a start, a budget and a recipe file
BUDGETS = {"long": 96, "short": 40}  # configs/miniature/<name>_budget.yaml (checked by the tests)
PILOT_RECIPE = "baseline"  # configs/miniature/baseline.yaml: the arm every comparison changes
PILOT_STEPS = 6


@dataclasses.dataclass(frozen=True)
class Gate:
    """A pilot gate: `value` must lie in [low, high] (None: unbounded); `what` says what it measures."""

    name: str
    what: str
    value: float
    low: float | None = None
    high: float | None = None

    @property
    def passed(self) -> bool:
        return (self.low is None or self.value >= self.low) and (self.high is None or self.value <= self.high)

    def line(self) -> str:
        bound = (f"in [{self.low:g}, {self.high:g}]" if self.low is not None and self.high is not None
                 else f">= {self.low:g}" if self.low is not None else f"<= {self.high:g}")
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.value:.4g} ({bound}): {self.what}"


def pilot_arm(out_dir: Path, start: str, budget: str, *, evaluate: bool, log=print) -> dict:
    """A PILOT_STEPS-step run of the grids' baseline arm (configs/miniature: chain.yaml, the start's,
    the budget's and the baseline's files; data and warm start under `out_dir`) at the grids' peak
    learning rate after their warm-up (a constant schedule: a 50-step cosine squeezed into
    PILOT_STEPS steps would measure clipping at a tenth of the rate); returns
    {"steps": metrics of each step, "eval": step-0 greedy evaluation (when `evaluate`),
    "seconds_per_step": wall time of the steps after the first (compiles excluded)}."""
    run_dir = out_dir / "pilot" / f"{start}_{budget}"
    overrides = [f"model.path={out_dir / start}", f"data.train_files=[{out_dir / 'data' / 'train.jsonl'}]",
                 "data.eval_files=[" + ", ".join(str(out_dir / "data" / f"test_{band}.jsonl") for band in CHAIN_BANDS) + "]",
                 # the grids' peak learning rate, not a cosine squeezed into PILOT_STEPS steps
                 f"trainer.steps={PILOT_STEPS}", "optim.schedule=constant", f"trainer.eval_every={0 if evaluate else -1}",
                 "trainer.checkpoint_every=0", f"trainer.out_dir={run_dir}", "trainer.overwrite=true"]
    files = [CONFIGS / "chain.yaml", CONFIGS / f"{start}.yaml", CONFIGS / f"{budget}_budget.yaml",
             CONFIGS / f"{PILOT_RECIPE}.yaml"]
    cfg = load_config(files, overrides)
    summary = train(cfg, log=log)
    steps = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in summary["history"]]
    step_times = [r["time_step"] for r in steps[1:] if "time_step" in r]
    return {"steps": steps, "eval": summary.get("eval_before") or {},
            "seconds_per_step": float(np.mean(step_times)) if step_times else float("nan")}


def pilot_gates(arms: dict) -> list[Gate]:
    """The gates of issue #40 from the pilot arms ({"<start>_<budget>": pilot_arm(...)})."""
    mean = lambda arm, key: float(np.mean([r.get(key, 0.0) for r in arms[arm]["steps"]]))
    # a share of truncated rows: over the steps that truncated any
    of_truncated = lambda arm, key: float(np.mean([r.get(key, 0.0) for r in arms[arm]["steps"]
                                                   if r.get("truncation_rate", 0.0) > 0] or [float("nan")]))
    accuracy = lambda arm: float(arms[arm]["eval"].get("accuracy", float("nan")))
    band = lambda arm, b: float(arms[arm]["eval"].get(f"test_{b}/accuracy", float("nan")))
    aligned, base = accuracy("aligned_like_long"), accuracy("base_like_long")
    bands = ", ".join(f"{b} {band('aligned_like_long', b):.0%} vs {band('base_like_long', b):.0%}" for b in CHAIN_BANDS)
    return [
        Gate("capability", f"greedy held-out accuracy, aligned-like minus base-like ({aligned:.1%} vs {base:.1%}; {bands})",
             aligned - base, low=0.10),
        Gate("hardest band", "aligned-like greedy accuracy at 6-8 operations (room to learn, not zero)",
             band("aligned_like_long", "ops6-8"), low=0.05, high=0.90),
        Gate("short budget truncates", f"aligned-like truncation rate at {BUDGETS['short']} new tokens",
             mean("aligned_like_short", "truncation_rate"), low=0.10, high=0.60),
        Gate("... unfinished chains", "share of those truncated rows that are unfinished work (no boxed answer, no loop)",
             of_truncated("aligned_like_short", "truncated_unfinished_ratio"), low=0.60),
        Gate("long budget: aligned stops", f"aligned-like truncation rate at {BUDGETS['long']} new tokens",
             mean("aligned_like_long", "truncation_rate"), high=0.05),
        Gate("long budget: base-like does not", f"base-like truncation rate at {BUDGETS['long']} new tokens",
             mean("base_like_long", "truncation_rate"), low=0.05, high=0.40),
        Gate("... degenerate", "share of the base-like long-budget truncated rows that are loops or run on past "
             f"a boxed answer (loops alone: {of_truncated('base_like_long', 'truncated_repeat_ratio'):.0%})",
             1.0 - of_truncated("base_like_long", "truncated_unfinished_ratio"), low=0.60),
        Gate("clips high", "aligned-like share of tokens clipped high at eps_high 0.2 (clip_frac_high)",
             mean("aligned_like_long", "clip_frac_high"), low=0.01),
        Gate("all-same groups", "base-like share of groups whose 8 rewards are all equal",
             mean("base_like_long", "all_same_groups"), low=0.15),
        Gate("time per step", "seconds per step at the long budget (50 steps: a cell's RL time / 50)",
             max(arms["aligned_like_long"]["seconds_per_step"], arms["base_like_long"]["seconds_per_step"]), high=8.0),
    ]


def pilot(out_dir: str | Path = "runs/miniature", *, log=print) -> list[Gate]:
    """Runs the four pilot arms (both starts at both budgets, PILOT_STEPS steps each; the long-budget
    ones evaluated greedily at step 0), prints each gate with its value, writes OUT/pilot/gates.json.
    Run `prepare` first."""
    out = Path(out_dir)
    missing = [name for name in STARTS if not (out / name / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"no warm start {', '.join(str(out / m) for m in missing)}: run "
                                f"`jaxrl4llm miniature prepare --out-dir {out}` first.")
    t0 = time.perf_counter()
    arms = {f"{start}_{budget}": pilot_arm(out, start, budget, evaluate=budget == "long", log=log)
            for budget in BUDGETS for start in STARTS}
    gates = pilot_gates(arms)
    for gate in gates:
        log(gate.line())
    log(f"pilot: {sum(g.passed for g in gates)}/{len(gates)} gates passed in {time.perf_counter() - t0:.0f} s")
    record = {"gates": [dict(dataclasses.asdict(g), passed=g.passed) for g in gates],
              "arms": {name: {"eval": arm["eval"], "seconds_per_step": arm["seconds_per_step"],
                              "steps": arm["steps"]} for name, arm in arms.items()}}
    (out / "pilot" / "gates.json").write_text(json.dumps(record, indent=1, default=float))
    return gates
