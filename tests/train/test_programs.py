"""`train` and `plan` run one builder of the trainer's programs (train/programs.py): the update and
the log-prob pass that `plan` lowers and prices are the loop's own, so its figures cannot drift from
what a run executes (the optimizer's schedule and constants, `algorithm.custom_loss`)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import optax

from jaxrl4llm.core import policy_loss
from jaxrl4llm.plan.programs import plan_inputs, plan_trainer
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import config_path
from jaxrl4llm.train.loop import run_meshes, setup_run
from jaxrl4llm.train.programs import loss_fn_for, optimizer_for
from tests.train.conftest import tiny_overrides
from tests.train.custom_parts import negated_policy_loss

ROOT = Path(__file__).resolve().parents[2]
METADATA = re.compile(r"( loc\([^)]*\)|#loc\d*( = loc\(.*)?|\{mhlo\.[^}]*\}|, mhlo\.[a-z_]+ = [^,}]+)")


def hlo_text(lowered) -> str:
    """A lowered program's StableHLO without source locations and naming metadata."""
    return "\n".join(line for line in (METADATA.sub("", l).rstrip() for l in lowered.as_text().splitlines())
                     if line and not line.startswith("#loc"))


def demo_config(assets, tmp_path, **extra):
    """configs/demo.yaml (cosine schedule, warm-up, Lite PPO) on the tests' tiny model, with a custom loss."""
    return load_config(config_path(), tiny_overrides(assets, tmp_path, **{
        "algorithm.custom_loss": "tests.train.custom_parts:negated_policy_loss", "optim.weight_decay": 0.01,
        "optim.b2": 0.95, "data.max_prompt_tokens": 48, **extra}))


def test_the_optimizer_and_the_loss_are_the_configs(demo_assets, tmp_path):
    cfg = demo_config(demo_assets, tmp_path)
    _, schedule = optimizer_for(cfg)
    total = cfg.trainer.steps * cfg.trainer.ppo_epochs * cfg.trainer.mini_batches
    want = optax.warmup_cosine_decay_schedule(0.0, cfg.optim.lr, cfg.optim.warmup_steps, max(total, 4),
                                              end_value=cfg.optim.lr * cfg.optim.min_lr_ratio)
    assert [float(schedule(s)) for s in range(total + 1)] == [float(want(s)) for s in range(total + 1)]
    assert loss_fn_for(cfg) is negated_policy_loss
    assert loss_fn_for(demo_config(demo_assets, tmp_path, **{"algorithm.custom_loss": "null"})) is policy_loss


def test_plan_lowers_the_loops_update_and_logprob_pass(demo_assets, tmp_path):
    """On one CPU device, packed rows (the quick demo's pinned row form): the StableHLO `plan`
    compiled for the update and the log-prob pass equals the loop's programs lowered on the same
    arguments (metadata stripped). data.max_prompt_tokens is the demo prompts' bucket, so the
    loop's layout (its prompts' width) is plan's (the bucket of the longest prompt a run can meet)."""
    packing = True
    cfg = demo_config(demo_assets, tmp_path, **{"trainer.packing": packing})
    mesh, _ = run_meshes(cfg)
    run, _ = setup_run(cfg, mesh, lambda line: None)
    # plan reads the model's shape from the config (no checkpoint): the vocabulary the loop's tokenizer gave
    # plan_run's trainer stage (plan_inputs -> plan_trainer); the sampler's programs are not the update's
    ins = plan_inputs(demo_config(demo_assets, tmp_path, **{"trainer.packing": packing,
                                                            "model.vocab_size": run.policy.config.vocab_size}), "cpu")
    planned = {p.name: p.lowered for p in plan_trainer(ins)[0]}
    assert run.settings == ins.layout.update, "plan resolved another layout than the loop"
    for name, program in (("update", run.programs.update), ("logprob pass", run.programs.logprob_pass)):
        args, kwargs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), planned[name].args_info)
        with jax.set_mesh(mesh):
            loop = program.lower(*args, **kwargs)
        assert hlo_text(loop) == hlo_text(planned[name]), f"plan's {name} is not the loop's"


def test_plan_lowers_the_loops_programs_on_8_devices(demo_assets, tmp_path):
    """The same on 8 simulated CPU devices (tests/train/programs_main.py, a subprocess): FSDP over 8
    with packed rows, and data 2 x FSDP 4 with LoRA adapters and padded rows."""
    assets = {k: str(v) for k, v in demo_assets.items()}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # programs_main sets its own (8 devices, fast compiles)
    proc = subprocess.run([sys.executable, "-m", "tests.train.programs_main", json.dumps(assets), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK 4 programs" in proc.stdout, proc.stdout
