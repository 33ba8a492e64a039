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
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl4llm.core import policy_loss
from jaxrl4llm.plan.programs import per_chip_bytes, plan_inputs, plan_trainer
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import config_path
from jaxrl4llm.train.loop import run_meshes, setup_run
from jaxrl4llm.train.programs import loss_fn_for, optimizer_for, router_labels
from tests.train.conftest import teacher_folder, tiny_overrides
from tests.train.custom_parts import negated_policy_loss

ROOT = Path(__file__).resolve().parents[2]
METADATA = re.compile(r"( loc\([^)]*\)|#loc\d*( = loc\(.*)?|\{mhlo\.[^}]*\}|, mhlo\.[a-z_]+ = [^,}]+)")


FUNCTION_NUMBER = re.compile(r"(@[A-Za-z_][\w.]*?)_\d+\b")  # @dynamic_update_index_in_dim_118: tracing order


def hlo_text(lowered) -> str:
    """A lowered program's StableHLO without source locations, naming metadata and the numbers
    tracing gave its private functions (they count what the process traced before)."""
    return "\n".join(line for line in (FUNCTION_NUMBER.sub(r"\1", METADATA.sub("", l)).rstrip()
                                        for l in lowered.as_text().splitlines())
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


def test_a_frozen_router_gets_no_update_and_no_weight_decay(demo_assets, tmp_path):
    """model.freeze_router: the optimizer leaves a router leaf as it was (weight decay included) while the
    others move; clipping counts the trained leaves' gradients alone."""
    cfg = demo_config(demo_assets, tmp_path, **{"model.freeze_router": True, "optim.weight_decay": 0.1,
                                                "optim.max_grad_norm": 1.0, "optim.warmup_steps": 0,
                                                "optim.schedule": "constant"})
    optimizer, _ = optimizer_for(cfg)
    params = {"layers": {"mlp": {"router": jnp.ones((2, 3)), "gate_proj": jnp.ones((2, 3))}}}
    grads = {"layers": {"mlp": {"router": jnp.full((2, 3), 100.0), "gate_proj": jnp.full((2, 3), 0.1)}}}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert not np.any(np.asarray(updates["layers"]["mlp"]["router"]))
    plain, _ = optimizer_for(demo_config(demo_assets, tmp_path, **{"optim.weight_decay": 0.1, "optim.max_grad_norm": 1.0,
                                                                   "optim.warmup_steps": 0, "optim.schedule": "constant"}))
    alone = {"layers": {"mlp": {"gate_proj": params["layers"]["mlp"]["gate_proj"]}}}
    want, _ = plain.update({"layers": {"mlp": {"gate_proj": grads["layers"]["mlp"]["gate_proj"]}}}, plain.init(alone),
                           alone)
    np.testing.assert_array_equal(updates["layers"]["mlp"]["gate_proj"], want["layers"]["mlp"]["gate_proj"])
    assert router_labels(params) == {"layers": {"mlp": {"router": "frozen", "gate_proj": "trained"}}}


# a mixture of experts whose update replays the sampler's routes (padded rows; packed: tests/train/test_loop.py)
MOE_REPLAY = {"model.architecture": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
              "model.moe_intermediate_size": 16, "trainer.router_replay": "rollout", "trainer.packing": False,
              "trainer.share_prompt": False}


@pytest.mark.parametrize("rows", ["packed", "moe replay"])
def test_plan_lowers_the_loops_update_and_logprob_pass(demo_assets, tmp_path, rows):
    """On one CPU device, packed rows (the quick demo's pinned row form), and a mixture of experts
    replaying routes: the StableHLO `plan` compiled for the update and the log-prob pass equals the
    loop's programs lowered on the same arguments (metadata stripped); plan's batch carries the
    routes [rows, positions, layers, k] the loop's does, its FLOPs count the active parameters, and it
    prices the routing pass of router replay's metrics, the loop's own.
    data.max_prompt_tokens is the demo prompts' bucket, so the loop's layout (its prompts' width) is
    plan's (the bucket of the longest prompt a run can meet)."""
    extra = {"trainer.packing": True} if rows == "packed" else MOE_REPLAY
    cfg = demo_config(demo_assets, tmp_path, **extra)
    mesh, _ = run_meshes(cfg)
    run, _ = setup_run(cfg, mesh, lambda line: None)
    # plan reads the model's shape from the config (no checkpoint): the vocabulary the loop's tokenizer gave
    # plan_run's trainer stage (plan_inputs -> plan_trainer); the sampler's programs are not the update's
    ins = plan_inputs(demo_config(demo_assets, tmp_path, **extra, **{"model.vocab_size": run.policy.config.vocab_size}),
                      "cpu")
    plans = plan_trainer(ins)[0]
    planned = {p.name: p.lowered for p in plans}
    assert run.settings == ins.layout.update, "plan resolved another layout than the loop"
    batch = planned["update"].args_info[0][1]
    if rows == "moe replay":
        c = ins.config
        assert batch.routes.shape == batch.input_tokens.shape + (c.num_layers, c.num_experts_per_tok)
        assert batch.routes.dtype == np.uint8
        update = next(p for p in plans if p.name == "update")
        assert c.num_active_params < c.num_params
        positions = batch.input_tokens.shape[0] * batch.input_tokens.shape[1]
        assert update.model_flops == pytest.approx(6 * c.num_active_params * cfg.trainer.ppo_epochs * positions
                                                   / mesh.size)
    programs = [("update", run.programs.update), ("logprob pass", run.programs.logprob_pass)]
    if rows == "moe replay":  # router replay's metrics: the native routing pass, priced by plan as the loop runs it
        assert [p.name for p in plans] == ["logprob pass", "update", "routing pass"]
        assert next(p for p in plans if p.name == "routing pass").runs == 1 / cfg.trainer.router_metrics_every
        programs.append(("routing pass", run.programs.routing_pass))
    for name, program in programs:
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


def test_plan_lowers_the_loops_teacher_pass(demo_assets, tmp_path):
    """On-policy distillation (a 2-layer, 48-wide teacher of the tiny student's tokenizer, padded rows):
    plan compiles the loop's own teacher pass and update (its batch carries teacher_logp), priced at
    2 N_teacher a position, and counts the teacher's parameters beside the other trainer programs."""
    teacher = teacher_folder(tmp_path / "teacher", demo_assets["tokenizer"])
    extra = {"algorithm.preset": "opd", "teacher.model": teacher, "teacher.dtype": "float32",
             "trainer.packing": False, "trainer.share_prompt": False}
    cfg = demo_config(demo_assets, tmp_path, **extra)
    mesh, _ = run_meshes(cfg)
    run, _ = setup_run(cfg, mesh, lambda line: None)
    ins = plan_inputs(demo_config(demo_assets, tmp_path, **extra, **{"model.vocab_size": run.policy.config.vocab_size}),
                      "cpu")
    plans = plan_trainer(ins)[0]
    assert [p.name for p in plans] == ["logprob pass", "update", "teacher pass"]
    planned = {p.name: p.lowered for p in plans}
    assert planned["update"].args_info[0][1].teacher_logp is not None
    for name, program in (("teacher pass", run.programs.teacher_pass), ("update", run.programs.update)):
        args, kwargs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), planned[name].args_info)
        with jax.set_mesh(mesh):
            loop = program.lower(*args, **kwargs)
        assert hlo_text(loop) == hlo_text(planned[name]), f"plan's {name} is not the loop's"
    t = next(p for p in plans if p.name == "teacher pass")
    positions = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt * (
        ins.prompt_len + ins.response_len - 1)
    assert t.model_flops == pytest.approx(2 * run.teacher.config.num_active_params * positions)
    assert per_chip_bytes(ins.teacher.params, tiled=False) == sum(x.size * 4 for x in jax.tree.leaves(run.teacher.params))
    assert ins.teacher_bytes >= per_chip_bytes(ins.teacher.params, tiled=False)  # TPU tiling pads small leaves
