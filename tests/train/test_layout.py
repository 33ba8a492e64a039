"""train/layout.py: one run layout that the loop and `plan` both resolve, and what each reads of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.layout import model_config_from_fields, packing_layout, replays_routes, shared_prompt_group, \
    single_optimizer_step

ROOT = Path(__file__).resolve().parents[2]


def test_the_loop_and_plan_resolve_the_same_layout_for_every_shipped_config():
    """8 simulated devices against an 8-chip TPU topology, every shipped model config under every
    shipped recipe and ablation, with LoRA, an own sampler, a tensor-parallel sampler, padded rows
    and a single optimizer step (tests/train/layout_main.py)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("layout_main.py"))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout and int(proc.stdout.split("OK ")[1].split()[0]) > 500


def test_lora_dropout_rules_out_the_single_optimizer_step():
    """With dropout the update's own forward is not the policy that scored pi_old: the recompute pass stays."""
    one = ["trainer.ppo_epochs=1", "trainer.mini_batches=1"]
    assert single_optimizer_step(load_config(None, one))
    assert single_optimizer_step(load_config(None, one + ["model.lora.rank=4"]))
    assert not single_optimizer_step(load_config(None, one + ["model.lora.dropout=0.1"]))
    assert not single_optimizer_step(load_config(None, ["trainer.mini_batches=2"]))


def test_a_model_from_size_fields_takes_its_fields_and_the_run_s_budget():
    cfg = load_config(None, ["model.tie_word_embeddings=false", "model.rope_theta=1e6", "model.max_position_embeddings=64",
                             "data.max_prompt_tokens=100", "rollout.max_new_tokens=50"])
    config = model_config_from_fields(cfg, vocab_size=300, eos_token_id=3)
    assert (config.vocab_size, config.tie_word_embeddings, config.rope_theta) == (300, False, 1e6)
    assert config.max_position_embeddings == 150 and config.eos_token_id == 3


def test_plan_shows_the_layout_without_compiling(capsys):
    from jaxrl4llm.cli import main

    code = main(["plan", "-c", str(ROOT / "configs/models/qwen3_0.6b_base.yaml"), "--topology", "cpu", "--show-layout",
                 "mesh.fsdp=1", "mesh.data=-1", "trainer.micro_batch_size=8", "model.lora.rank=8"])
    layout = json.loads(capsys.readouterr().out)
    assert code == 0
    assert layout["model"]["hidden_size"] == 1024 and layout["lora"]["rank"] == 8
    assert layout["update"]["micro_batches"] == 32 and layout["sampler"]["engine"] == "continuous"
    # no topology (none passed, none in the config): the error names the fix (it was a NameError)
    assert main(["plan", "--show-layout", "trainer.micro_batch_size=8"]) != 0
    assert "plan --show-layout needs a topology: pass --topology" in capsys.readouterr().err


def test_a_mixture_of_experts_layout_names_its_expert_kernels(capsys):
    """Qwen3-30B-A3B on v5p: the ragged form trains and prefills, dense_capacity decodes, tgmm takes
    the weight gradient, each with its reason; a forced model.expert_form is named; dense: none."""
    from jaxrl4llm.cli import main

    models = ROOT / "configs/models"
    args = ["plan", "-c", str(models / "qwen3_30b_a3b_base.yaml"), "-c", str(ROOT / "configs/lite_ppo_r3.yaml"),
            "--show-layout"]
    assert main(args) == 0
    experts = json.loads(capsys.readouterr().out)["experts"]
    assert {k: v["kernel"] for k, v in experts.items()} == {
        "train": "ragged_dot", "prefill": "ragged_dot", "decode": "dense_capacity", "weight_grad": "tgmm"}
    assert "dense dot over all experts" in experts["weight_grad"]["reason"]
    assert main(args + ["model.expert_form=reference"]) == 0
    experts = json.loads(capsys.readouterr().out)["experts"]
    assert experts["train"] == experts["decode"] == {"kernel": "reference", "reason": "model.expert_form=reference",
                                                      "fallback": False}
    assert main(["plan", "-c", str(models / "qwen3_0.6b_base.yaml"), "--topology", "cpu", "--show-layout", "mesh.fsdp=1",
                 "mesh.data=-1", "trainer.micro_batch_size=8"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"] is None


@pytest.mark.parametrize("bad", [["mesh.fsdp=3"], ["trainer.micro_batch_size=7"]])
def test_a_layout_that_cannot_be_built_is_a_config_error_from_plan_too(bad):
    from jaxrl4llm.plan.programs import plan_layout
    from jaxrl4llm.train.config import ConfigError

    with pytest.raises(ConfigError):
        plan_layout(load_config(ROOT / "configs/models/qwen3_0.6b_base.yaml", ["mesh.data=-1"] + bad), "cpu")


# the two workloads of benchmarks/row_form.py, at the shapes it times (docs/training.md, "Which row form")
DEMO_SHAPE = dict(rows=128, mini_batches=2, prompt_width=64, prompt_tokens=53.0, max_new_tokens=32, budget=None)
RAGGED_SHAPE = dict(rows=64, mini_batches=1, prompt_width=64, prompt_tokens=35.0, max_new_tokens=256, budget=4096)


def _choice(shape, group=8):
    from jaxrl4llm.train.layout import choose_row_form
    from jaxrl4llm.train.packing import pack_layout

    s = dict(shape)
    n, budget = s.pop("mini_batches"), s.pop("budget")
    lay = pack_layout(rows=s["rows"], mini_batches=n, shards=1, prompt_width=s["prompt_width"],
                      response_width=s["max_new_tokens"], tokens_per_micro_batch=budget)
    return choose_row_form(**s, prompt_group=group, packing=lay)


def test_the_row_form_rule_picks_what_the_benchmark_found_fastest():
    """benchmarks/row_form.py: shared-prompt rows on the demo's short, equal responses (packing
    saves no micro-batch there), packed rows on lognormal responses of a quarter of the budget."""
    demo, ragged = _choice(DEMO_SHAPE), _choice(RAGGED_SHAPE)
    assert demo.form == "shared_prompt", demo.reason
    assert ragged.form == "packed", ragged.reason
    assert demo.positions["packed"] == demo.positions["padded"]  # one sequence per packed row: no position saved
    assert ragged.positions["packed"] < ragged.positions["shared_prompt"] / 2


def test_without_a_shared_prompt_the_rule_weighs_packed_against_padded_rows():
    assert _choice(DEMO_SHAPE, group=None).form == "padded"
    assert _choice(RAGGED_SHAPE, group=None).form == "packed"
    assert "shared_prompt" not in _choice(DEMO_SHAPE, group=None).positions


def test_packing_auto_resolves_in_the_layout_plan_shows(capsys):
    from jaxrl4llm.cli import main

    def show(*overrides):
        code = main(["plan", "-c", str(ROOT / "configs/models/qwen3_0.6b_base.yaml"), "--topology", "cpu",
                     "--show-layout", "mesh.fsdp=1", "mesh.data=-1", *overrides])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    long = show("trainer.packing=auto")  # 8k-token budget, lognormal mean 2k expected: packed
    assert long["row_form"] == "packed" and long["update"]["packing"] is not None
    assert "least expected work" in long["row_form_reason"]
    short = show("trainer.packing=auto", "rollout.max_new_tokens=32")  # the prompt dominates: share it
    assert short["row_form"] == "shared_prompt" and short["update"]["packing"] is None
    assert short["update"]["prompt_group"] == 8
    fixed = show("trainer.packing=true", "rollout.max_new_tokens=32")  # today's form, no reason
    assert fixed["row_form"] == "packed" and fixed["row_form_reason"] == ""


def test_a_run_with_packing_auto_logs_its_row_form_and_writes_it_to_layout_json(demo_assets, tmp_path):
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.loop import train
    from tests.train.conftest import tiny_overrides

    lines = []
    train(load_config(None, tiny_overrides(demo_assets, tmp_path / "run", **{
        "trainer.packing": "auto", "trainer.steps": 1})), log=lines.append)
    layout = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert layout["row_form"] in ("padded", "shared_prompt", "packed") and layout["row_form_reason"]
    assert any(line.startswith(f"row form: {layout['row_form'].replace('_', '-')} (trainer.packing=auto") for line in lines)


def test_router_replay_runs_on_every_row_form_of_a_mixture_of_experts_model():
    """trainer.router_replay=rollout: padded, packed or shared-prompt rows, whole or partial rollouts; a
    ConfigError naming the setting for a dense model or the static engine (which records no routes)."""
    from jaxrl4llm.models import ModelConfig
    from jaxrl4llm.train.config import ConfigError

    moe = ModelConfig(architecture="qwen3_moe", intermediate_size=0, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    replay = ["trainer.router_replay=rollout"]
    assert not replays_routes(load_config(None, []), moe)
    cfg = load_config(None, replay)
    assert replays_routes(cfg, moe)
    assert packing_layout(cfg, True, 1, 32, print) is not None
    shared = load_config(None, replay + ["trainer.share_prompt=true"])
    assert replays_routes(shared, moe) and shared_prompt_group(shared, True, 1) == shared.rollout.samples_per_prompt
    assert replays_routes(load_config(None, replay + ["trainer.packing=true"]), moe)
    assert replays_routes(load_config(None, replay + ["rollout.partial=true", "trainer.max_staleness=1"]), moe)
    for extra, named in ((["model.architecture=qwen3"], "this model is dense"),
                         (["rollout.engine=static"], "set rollout.engine=continuous")):
        with pytest.raises(ConfigError, match=named):
            replays_routes(load_config(None, replay + extra), ModelConfig() if "dense" in named else moe)
    with pytest.raises(ConfigError, match="trainer.router_aux_loss_coef"):
        load_config(None, ["trainer.router_aux_loss_coef=-0.1"])
    with pytest.raises(ConfigError, match="choose one of 'off', 'rollout'"):
        load_config(None, ["trainer.router_replay=native"])
