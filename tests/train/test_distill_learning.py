"""On-policy distillation learns (issue #53's learning criterion; a learning run of minutes, marked
`learning`: `./scripts/test -m learning`). A small Qwen3-shaped teacher is SFT'd on correct worked
solutions of one-step additions ("Ed has 2 keys. Gets 6 more. How many?" -> "2+6=8 \\boxed{8}");
the student is that teacher fine-tuned for STUDENT_SFT steps on the same solutions with every boxed
answer off by 1-3 (train/demo.py's noisy_solution), so it computes the sum and then mostly boxes a
wrong number. From the student, `opd` (the teacher's per-token signal only) and `grpo` (the
verifier's reward only) run the same steps; pure distillation must reach 80% of the teacher's
held-out accuracy, beat GRPO, and halve teacher_kl (mean of the first 3 steps against the last 3)."""

import random

import jax
import numpy as np
import pytest

from jaxrl4llm.data import demo_solution, format_prompt, load_problems, write_demo_task
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import config_path, noisy_solution
from jaxrl4llm.train.evaluation import evaluate
from jaxrl4llm.train.loop import run_meshes, setup_run, train
from jaxrl4llm.train.warm_start import build_warm_start

TASK = dict(num_train=2000, num_test=64, seed=0, digits=1, ops="+", steps=1)
MODEL = dict(architecture="qwen3", hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2,
             num_kv_heads=1, head_dim=32)
SFT = dict(steps=200, batch_size=32, lr=3e-3, length=64)
STUDENT_SFT = 30  # steps of the student's fine-tune from the teacher, every boxed answer wrong
STEPS = 100


@pytest.fixture(scope="module")
def warm_starts(tmp_path_factory):
    """{"train", "test", "teacher", "student"}: the task's files and the two warm-start folders."""
    root = tmp_path_factory.mktemp("distill_learning")
    paths = write_demo_task(root / "data", **TASK)
    problems = load_problems(paths["train"])
    prompts = [format_prompt(p, "demo") for p in problems]
    rng = random.Random(0)
    right = [(demo_solution(p), True) for p in problems]
    wrong = [(noisy_solution(demo_solution(p), rng, 1.0), True) for p in problems]
    paths["teacher"] = build_warm_start(root / "teacher", prompts, right, model=MODEL, sft=SFT, log=lambda s: None)
    paths["student"] = build_warm_start(root / "student", prompts, wrong, sft=dict(SFT, steps=STUDENT_SFT),
                                        init=paths["teacher"], log=lambda s: None)
    return paths


def run_config(paths, model, out, *extra):
    """configs/demo.yaml from `model`: 16 prompts x 8 samples a step, held-out accuracy on the 64
    test problems (4 samples each, temperature 1) before the first step and after the last."""
    return load_config(config_path(), [
        f"model.path={model}", f"data.train_files=[{paths['train']}]", f"data.eval_files=[{paths['test']}]",
        f"trainer.out_dir={out}", f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}", "trainer.checkpoint_every=0",
        "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.compile_cache=off", "data.eval_limit=64",
        "trainer.eval_samples=4", "rollout.prompts_per_step=16", "rollout.max_new_tokens=24", "trainer.mini_batches=1",
        "optim.lr=3e-3", "teacher.dtype=float32", *extra])


def teacher_accuracy(paths, out) -> float:
    cfg = run_config(paths, paths["teacher"], out)
    run, state = setup_run(cfg, run_meshes(cfg)[0], lambda s: None)
    return float(evaluate(run.policy.with_state(state), run.eval_sets, cfg, run.reward_fn,
                          jax.random.fold_in(run.base_key, 10**9))["accuracy"])


@pytest.mark.learning
def test_pure_distillation_reaches_the_teacher_beats_grpo_and_halves_teacher_kl(warm_starts, tmp_path):
    """Measured on the 2-core VM (seed 0, 2026-12-06): the teacher 39.1% held-out, the student 9.4%;
    after 100 steps opd 41.8% (1.07x the teacher) and grpo 3.5%; teacher_kl 0.216 -> 0.037 (-83%).
    At 30 steps of 8 prompts opd reached 18.4%, at 60 steps of 16 prompts 30.9% (0.79x): STEPS = 100
    leaves about 10 points above the bar. ~175 s (two SFTs, the teacher's evaluation, two runs)."""
    teacher = teacher_accuracy(warm_starts, tmp_path / "teacher")
    opd = train(run_config(warm_starts, warm_starts["student"], tmp_path / "opd", "algorithm.preset=opd",
                           f"teacher.model={warm_starts['teacher']}"), log=lambda s: None)
    grpo = train(run_config(warm_starts, warm_starts["student"], tmp_path / "grpo", "algorithm.preset=grpo"),
                 log=lambda s: None)
    start = opd["eval_before"]["accuracy"]
    kl = [r["teacher_kl"] for r in opd["history"]]
    figures = dict(teacher=teacher, start=start, opd=opd["eval_after"]["accuracy"],
                   grpo=grpo["eval_after"]["accuracy"], kl_first=float(np.mean(kl[:3])), kl_last=float(np.mean(kl[-3:])))
    assert start < 0.5 * teacher, figures  # a weak student, a clearly stronger teacher
    assert figures["opd"] >= 0.8 * teacher, figures
    assert figures["opd"] > figures["grpo"], figures
    assert figures["kl_last"] <= 0.5 * figures["kl_first"], figures
