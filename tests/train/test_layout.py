"""train/layout.py: one run layout that the loop and `plan` both resolve, and what each reads of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.layout import model_config_from_fields, single_optimizer_step

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


@pytest.mark.parametrize("bad", [["mesh.fsdp=3"], ["trainer.micro_batch_size=7"]])
def test_a_layout_that_cannot_be_built_is_a_config_error_from_plan_too(bad):
    from jaxrl4llm.plan.programs import plan_layout
    from jaxrl4llm.train.config import ConfigError

    with pytest.raises(ConfigError):
        plan_layout(load_config(ROOT / "configs/models/qwen3_0.6b_base.yaml", ["mesh.data=-1"] + bad), "cpu")
