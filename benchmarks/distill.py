"""On-policy distillation against GRPO on the demo task (issue #53): accuracy against steps and
seconds, the teacher pass's share of the step, teacher memory.

    python benchmarks/distill.py [--out runs/distill] [--steps 30] [--student-sft 30] [--teacher-sft 300]
                                 [--recipes opd,grpo,lite_ppo_opd] [--seed 0] [--lr 1e-3]

1. writes the demo task (train/demo.py's DEMO_TASK: 1-digit two-step +/- word problems);
2. builds two warm starts of the demo's 0.4M-parameter model by the demo's SFT on noisy worked
   solutions (`train.demo.build_warm_start`): the student after --student-sft steps (weak: it
   rarely boxes the right number), the teacher after --teacher-sft steps (the same recipe, longer);
3. the teacher's held-out accuracy (`train.evaluation.evaluate`, the runs' sampling);
4. from the student, configs/demo.yaml with each recipe for --steps steps, held-out accuracy every
   --eval-every steps: `opd` (pure distillation, teacher = step 2's), `grpo` (the verifier's
   reward only) and `lite_ppo_opd` (both);
5. prints one table and writes OUT/distill.json and OUT/distill.png (held-out accuracy against
   steps and against seconds of the run, teacher_kl against steps).

The teacher pass's share: mean `time_teacher` / (`time_update` - `time_teacher`) (the teacher's
forward against the student's trainer work of the step: old-log-prob pass and update) beside the
FLOP estimate 2 N_teacher / 8 N_student (a forward is 2N per token; the student's pass and update
6N + 2N); teacher memory: its parameters' bytes (frozen, `teacher.dtype`, no optimizer state).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxrl4llm.data import write_demo_task
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import DEMO_TASK, build_warm_start, config_path
from jaxrl4llm.train.evaluation import evaluate
from jaxrl4llm.train.loop import run_meshes, setup_run, train


def run_overrides(args, data: dict, student: Path, out: Path, eval_limit: int) -> list[str]:
    """configs/demo.yaml's overrides shared by every run of the comparison."""
    return [f"model.path={student}", f"data.train_files=[{data['train']}]", f"data.eval_files=[{data['test']}]",
            f"trainer.out_dir={out}", "trainer.overwrite=true", f"trainer.steps={args.steps}",
            f"trainer.eval_every={args.eval_every}", "trainer.checkpoint_every=0", "trainer.export_hf=false",
            "trainer.progress_bar=false", f"data.eval_limit={eval_limit}", "trainer.eval_samples=2",
            f"trainer.seed={args.seed}", f"rollout.prompts_per_step={args.prompts}",
            "rollout.samples_per_prompt=8", "trainer.mini_batches=1", "teacher.dtype=float32", f"optim.lr={args.lr}"]


def teacher_accuracy(args, data, teacher: Path, out: Path, eval_limit: int) -> float:
    """The teacher's held-out accuracy with the runs' evaluation (same problems, samples, temperature)."""
    cfg = load_config(config_path(), run_overrides(args, data, teacher, out / "teacher_eval", eval_limit))
    mesh, _ = run_meshes(cfg)
    run, state = setup_run(cfg, mesh, lambda s: None)
    result = evaluate(run.policy.with_state(state), run.eval_sets, cfg, run.reward_fn,
                      jax.random.fold_in(run.base_key, 10**9))
    return float(result["accuracy"])


def param_bytes(folder: Path) -> int:
    """Bytes of a checkpoint's parameters (its safetensors files)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def summarize(name: str, history: list[dict], eval_before: dict, params_student: int, params_teacher: int) -> dict:
    """One recipe's curves and figures from its step records."""
    seconds = np.cumsum([r["time_step"] for r in history]).tolist()
    curve = [(0, 0.0, eval_before["accuracy"])] + [
        (i + 1, seconds[i], r["eval/accuracy"]) for i, r in enumerate(history) if "eval/accuracy" in r]
    row = {"recipe": name, "curve": curve, "final_accuracy": curve[-1][2],
           "seconds": seconds[-1], "step_seconds": float(np.mean([r["time_step"] for r in history[1:]]))}
    if "teacher_kl" in history[0]:
        kl = [r["teacher_kl"] for r in history]
        row.update(teacher_kl=kl, teacher_kl_first=float(np.mean(kl[:3])), teacher_kl_last=float(np.mean(kl[-3:])))
        share = [r["time_teacher"] / max(r["time_update"] - r["time_teacher"], 1e-9) for r in history[1:]]
        row.update(teacher_share_measured=float(np.mean(share)),
                   teacher_share_estimate=2 * params_teacher / (8 * params_student))
    return row


def plot(rows: list[dict], teacher_acc: float, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, 3)
    for i, row in enumerate(rows):
        steps, seconds, acc = zip(*row["curve"])
        color = f"C{i}"  # one colour a recipe in every panel
        axes[0].plot(steps, acc, marker="o", label=row["recipe"], color=color)
        axes[1].plot(seconds, acc, marker="o", label=row["recipe"], color=color)
        if "teacher_kl" in row:
            axes[2].plot(range(1, len(row["teacher_kl"]) + 1), row["teacher_kl"], label=row["recipe"], color=color)
    for ax in axes[:2]:
        ax.axhline(teacher_acc, color="gray", linestyle="--", label="teacher")
        ax.set_ylabel("held-out accuracy")
        ax.legend()
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("seconds (the first step's include compiling)")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("teacher_kl")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-limit", type=int, default=100)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--student-sft", type=int, default=30)
    p.add_argument("--teacher-sft", type=int, default=300)
    p.add_argument("--recipes", default="opd,grpo,lite_ppo_opd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3, help="optim.lr of every run (configs/demo.yaml's: 2e-4)")
    args = p.parse_args(argv)
    out = Path(args.out)
    t0 = time.perf_counter()
    data = write_demo_task(out / "data", **DEMO_TASK)
    student, teacher = out / "student", out / "teacher"
    for folder, steps in ((student, args.student_sft), (teacher, args.teacher_sft)):
        if not (folder / "config.json").is_file():
            build_warm_start(folder, data["train"], seed=0, sft_steps=steps, log=lambda s: None)
    print(f"warm starts: {time.perf_counter() - t0:.0f} s", flush=True)
    teacher_acc = teacher_accuracy(args, data, teacher, out, args.eval_limit)
    print(f"teacher held-out accuracy: {teacher_acc:.3f}", flush=True)
    n_student, n_teacher = param_bytes(student) // 4, param_bytes(teacher) // 4  # float32 parameters
    rows = []
    for name in args.recipes.split(","):
        extra = [f"algorithm.preset={name}"] + ([f"teacher.model={teacher}"] if name != "grpo" else [])
        cfg = load_config(config_path(), run_overrides(args, data, student, out / name, args.eval_limit) + extra)
        summary = train(cfg, log=lambda s: None)
        rows.append(summarize(name, summary["history"], summary["eval_before"], n_student, n_teacher))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("teacher_kl",)}), flush=True)
    print(f"\n{'recipe':>14} {'acc@0':>6} {'final':>6} {'/teacher':>8} {'s/step':>7} {'kl first':>8} {'kl last':>8} "
          f"{'teacher share':>13} {'estimate':>8}")
    for r in rows:
        print(f"{r['recipe']:>14} {r['curve'][0][2]:6.3f} {r['final_accuracy']:6.3f} "
              f"{r['final_accuracy'] / max(teacher_acc, 1e-9):8.2f} {r['step_seconds']:7.2f} "
              f"{r.get('teacher_kl_first', float('nan')):8.4f} {r.get('teacher_kl_last', float('nan')):8.4f} "
              f"{r.get('teacher_share_measured', float('nan')):13.3f} {r.get('teacher_share_estimate', float('nan')):8.3f}")
    result = {"teacher_accuracy": teacher_acc, "teacher_param_bytes": param_bytes(teacher),
              "student_params": n_student, "teacher_params": n_teacher, "args": vars(args), "rows": rows,
              "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(sys.argv)}
    (out / "distill.json").write_text(json.dumps(result, indent=1))
    plot(rows, teacher_acc, out / "distill.png")
    print(f"teacher memory: {param_bytes(teacher) / 2**20:.2f} MiB of parameters; {out / 'distill.png'}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
