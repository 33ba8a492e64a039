"""The kernel each shipped config runs, pinned: decode attention (rollout.decode_attention = auto,
kernel, xla) and training attention (model.attention_impl), on this CPU (without and with the C++
kernels) and for a TPU and an H100 topology as `plan` sees them. The table was written from the
choices of the code before the kernel choice became one value (generate.paged_attention_choice and
continuous.decode_attention_path, segment_attention.resolve_impl); "error": the request cannot run."""

import types
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxrl4llm.models.layers.segment_attention as segment_attention
from jaxrl4llm.plan.programs import plan_model_config, topology_meshes
from jaxrl4llm.sampling.continuous import PAGE_SIZE
from jaxrl4llm.sampling.generate import paged_attention_choice
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.layout import model_config_from_fields, sampler_mesh_for

ROOT = Path(__file__).resolve().parents[2]
EIGHT_CHIPS = ["mesh.data=-1", "mesh.fsdp=8", "mesh.tensor=1"]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "rollout.tensor_parallel=0", "mesh.sampler_devices=0"]
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


def todays_choice(name: str, where: str, requested: str) -> tuple[str, str]:
    cfg = load_config([ROOT / name] if name != "defaults" else None,
                      (ONE_DEVICE if where.startswith("cpu") else EIGHT_CHIPS) + [f"rollout.decode_attention={requested}"])
    config = plan_model_config(cfg) if cfg.model.vocab_size else model_config_from_fields(cfg, vocab_size=512)
    if where == "h100:8":  # XLA's CUDA compiler is an opt-in extra: GPU devices as the choice reads them
        dmesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")] * 8), size=8)
        platform, compile_platform = "gpu", segment_attention.compile_platform
        segment_attention.compile_platform = lambda: "gpu"
        try:
            train = segment_attention.resolve_impl(config.attention_impl)
        finally:
            segment_attention.compile_platform = compile_platform
    else:
        mesh, own = topology_meshes(where.split("+")[0], cfg)
        dmesh = sampler_mesh_for(cfg, own or mesh, config) or own or mesh
        platform = list(dmesh.devices.flat)[0].platform
        with jax.set_mesh(mesh):
            train = segment_attention.resolve_impl(config.attention_impl)
    try:
        attention = paged_attention_choice(config, dmesh, where == "cpu+kernels", requested, page_size=PAGE_SIZE)
    except ValueError:
        return "error", train
    kernel = {"cpu": "cpu_native", "tpu": "tpu_ragged"}.get(platform, "gpu_triton")
    return ("xla" if attention == "xla" else kernel), train


@pytest.mark.parametrize("name, where", sorted(TODAY))
def test_every_shipped_config_runs_the_kernel_it_ran_before(name, where):
    auto, kernel, xla, train = TODAY[name, where]
    got = [todays_choice(name, where, requested) for requested in ("auto", "kernel", "xla")]
    assert [d for d, _ in got] == [auto, kernel, xla]
    assert {t for _, t in got} == {train}
