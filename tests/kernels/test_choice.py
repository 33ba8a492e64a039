"""kernels/choice.py: which attention kernel runs, decided once. The kernel each shipped config runs is
pinned: decode attention (rollout.decode_attention = auto, kernel, xla) and training attention
(model.attention_impl), on this CPU (without and with the C++ kernels: the loop's layout) and for a
TPU and an H100 topology as `plan`'s layout resolves them. The table was written from the choices of
the code before the kernel choice became one value (generate.paged_attention_choice,
continuous.decode_attention_path and segment_attention.resolve_impl; the commit before this
module); "error": the request cannot run there."""

import json
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxrl4llm.kernels.choice import (DecodeAttention, TrainAttention, decode_attention_choice, gpu_kernel_supports,
                                      train_attention_choice)
from jaxrl4llm.models import ModelConfig
from jaxrl4llm.plan.gpu import missing_gpu_packages
from jaxrl4llm.plan.programs import plan_layout, plan_model_config, topology_meshes
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.layout import attention_kernels, model_config_from_fields, run_layout

ROOT = Path(__file__).resolve().parents[2]
EIGHT_CHIPS = ["mesh.data=-1", "mesh.fsdp=8", "mesh.tensor=1"]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "rollout.tensor_parallel=0", "mesh.sampler_devices=0"]
GPUS = [types.SimpleNamespace(platform="gpu")] * 8  # XLA's CUDA compiler is an opt-in extra: GPUs as the rule reads them
# (config, where): decode attention for auto, kernel, xla; training attention
TODAY = {
    ('defaults', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('defaults', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('defaults', 'v5p:2x2x2'): ('xla', 'error', 'xla', 'splash'),
    ('defaults', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/demo.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/demo.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/demo.yaml', 'v5p:2x2x2'): ('xla', 'error', 'xla', 'splash'),
    ('configs/demo.yaml', 'h100:8'): ('xla', 'error', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_0.6b_base.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_0.6b_base.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_0.6b_base.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_0.6b_base.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_1.7b_base.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_1.7b_base.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_1.7b_base.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_1.7b_base.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_4b_base.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_4b_base.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_4b_base.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_4b_base.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_4b_instruct.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_4b_instruct.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_4b_instruct.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_4b_instruct.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_8b_base.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_8b_base.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_8b_base.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_8b_base.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/models/qwen3_8b_instruct.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/models/qwen3_8b_instruct.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/models/qwen3_8b_instruct.yaml', 'v5p:2x2x2'): ('tpu_ragged', 'tpu_ragged', 'xla', 'splash'),
    ('configs/models/qwen3_8b_instruct.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
    ('configs/examples/smollm2_arithmetic.yaml', 'cpu'): ('xla', 'error', 'xla', 'xla'),
    ('configs/examples/smollm2_arithmetic.yaml', 'cpu+kernels'): ('cpu_native', 'cpu_native', 'xla', 'xla'),
    ('configs/examples/smollm2_arithmetic.yaml', 'v5p:2x2x2'): ('xla', 'error', 'xla', 'splash'),
    ('configs/examples/smollm2_arithmetic.yaml', 'h100:8'): ('gpu_triton', 'gpu_triton', 'xla', 'pallas_gpu'),
}


def layout_choice(name: str, where: str, requested: str):
    """(decode, training) KernelChoice of the layout that the loop (on this CPU) or `plan` resolves."""
    mesh_overrides = ONE_DEVICE if where.startswith("cpu") else EIGHT_CHIPS
    cfg = load_config([ROOT / name] if name != "defaults" else None,
                      mesh_overrides + [f"rollout.decode_attention={requested}"])
    config = plan_model_config(cfg) if cfg.model.vocab_size else model_config_from_fields(cfg, vocab_size=512)
    if where == "h100:8" and missing_gpu_packages():  # the rule `run_layout` applies, on GPU devices
        return attention_kernels(cfg, config, GPUS, GPUS, cpu_kernels=False)
    # `plan_layout` (model.vocab_size or model.path needed: a random model's here), or on this CPU the
    # loop's layout on one device, with or without the C++ kernels
    mesh, own_sampler = topology_meshes(where.split("+")[0], cfg)
    layout = run_layout(cfg, mesh, config, prompt_width=bucket(cfg.data.max_prompt_tokens, PROMPT_BUCKETS),
                        sampler_mesh=own_sampler, cpu_kernels=where == "cpu+kernels")
    return layout.decode_attention, layout.train_attention


@pytest.mark.parametrize("name, where", sorted(TODAY))
def test_every_shipped_config_runs_the_kernel_it_ran_before(name, where):
    auto, kernel, xla, train = TODAY[name, where]
    got = []
    for requested in ("auto", "kernel", "xla"):
        try:
            decode, training = layout_choice(name, where, requested)
        except ConfigError as e:
            assert "rollout.decode_attention" in str(e) and "This call" in str(e)
            got.append("error")
            continue
        assert training.kernel == train and isinstance(training.kernel, TrainAttention) and training.reason
        assert isinstance(decode.kernel, DecodeAttention) and decode.reason
        got.append(decode.kernel)
    assert got == [auto, kernel, xla]


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**dict(dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=32, dtype="bfloat16"), **kw))


def test_auto_falls_back_to_xla_and_says_what_the_kernel_could_not_take():
    tpu = [types.SimpleNamespace(platform="tpu")]
    choice = decode_attention_choice(tiny(head_dim=64), tpu, cpu_kernels=False, page_size=16)
    assert choice.kernel == "xla" and choice.fallback and "multiple of 128 (this model: 64)" in choice.reason
    choice = decode_attention_choice(tiny(head_dim=128), tpu, cpu_kernels=False, page_size=16)
    assert choice.kernel == "tpu_ragged" and not choice.fallback
    assert decode_attention_choice(tiny(head_dim=96), GPUS, cpu_kernels=False, page_size=16).fallback
    assert decode_attention_choice(tiny(), GPUS, cpu_kernels=False, page_size=16, requested="gpu_triton").kernel == \
        "gpu_triton"
    with pytest.raises(ValueError, match="'tpu_ragged'.*This call: gpu.*its kernel: gpu_triton"):
        decode_attention_choice(tiny(), GPUS, cpu_kernels=False, page_size=16, requested="tpu_ragged")
    with pytest.raises(ValueError, match="choose one of 'auto', 'kernel', 'xla'"):
        decode_attention_choice(tiny(), GPUS, cpu_kernels=False, page_size=16, requested="fast")


def test_the_static_engine_has_no_paged_attention_and_ignores_the_request():
    cpu = [types.SimpleNamespace(platform="cpu")]
    static = dict(page_size=16, requested="kernel", engine="static")
    assert decode_attention_choice(tiny(), cpu, cpu_kernels=True, **static).kernel == "cpu_native"
    assert decode_attention_choice(tiny(), cpu, cpu_kernels=False, **static).kernel == "xla"
    assert decode_attention_choice(tiny(dtype="float16"), cpu, cpu_kernels=True, **static).kernel == "xla"


def test_training_attention_by_platform_and_as_named():
    assert [train_attention_choice("auto", p).kernel for p in ("cpu", "tpu", "gpu", "cuda")] == \
        ["xla", "splash", "pallas_gpu", "pallas_gpu"]
    assert train_attention_choice("splash", "cpu").kernel == "splash"  # Pallas' interpreter off its platform
    with pytest.raises(ValueError, match="model.attention_impl=pallas_gpu"):
        train_attention_choice("cudnn", "gpu")
    with pytest.raises(ValueError, match="unknown; valid: auto, xla"):
        train_attention_choice("flash", "gpu")


def test_gpu_kernel_takes_power_of_two_16_bit_shapes():
    assert gpu_kernel_supports(128, jnp.bfloat16, 16) and gpu_kernel_supports(64, jnp.float16, 32)
    assert not gpu_kernel_supports(96, jnp.bfloat16, 16)  # Triton blocks are powers of two
    assert not gpu_kernel_supports(128, jnp.bfloat16, 12) and not gpu_kernel_supports(8, jnp.bfloat16, 16)
    assert not gpu_kernel_supports(128, jnp.float32, 16)  # a float32 dot would run in TF32


def test_the_layout_json_shows_both_choices_with_their_reasons():
    cfg = load_config(ROOT / "configs/models/qwen3_0.6b_base.yaml", EIGHT_CHIPS)
    shown = json.loads(json.dumps(plan_layout(cfg, "v5p:2x2x2").to_dict()))
    assert shown["decode_attention"]["kernel"] == "tpu_ragged" and "128" in shown["decode_attention"]["reason"]
    assert shown["train_attention"] == {"kernel": "splash", "reason": "auto: the tpu default", "fallback": False}


def test_the_run_logs_why_auto_falls_back_to_xla():
    """The example's model (head_dim 32) on TPU: the ragged kernel cannot take it, the layout's log line says so."""
    cfg = load_config(ROOT / "configs/examples/smollm2_arithmetic.yaml", EIGHT_CHIPS)
    config = plan_model_config(cfg) if cfg.model.vocab_size else model_config_from_fields(cfg, vocab_size=512)
    mesh, own_sampler = topology_meshes("v5p:2x2x2", cfg)
    lines = []
    layout = run_layout(cfg, mesh, config, prompt_width=128, sampler_mesh=own_sampler, log=lines.append)
    assert layout.decode_attention.kernel == "xla" and layout.decode_attention.fallback
    assert [line for line in lines if "decode_attention" in line] == [
        "decode attention (rollout.decode_attention): auto: the TPU ragged paged attention kernel needs head_dim a "
        "multiple of 128 (this model: 32); XLA's chunks of live pages instead"]


def test_without_pallas_triton_the_layout_takes_xla_and_the_run_works():
    """jax.experimental.pallas.triton missing (deprecated in jax 0.11; simulated in a process of its
    own, tests/kernels/without_triton_main.py): importing jaxrl4llm works, GPUs get XLA's attention
    with the reason, a forced Triton kernel is an error naming the fix, a rollout and an update run."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("without_triton_main.py"))], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK without Pallas' Triton backend" in proc.stdout
