"""jaxrl4llm/plan/gpu.py: GPU topology names, the GPU spec table and the errors always; a tiny
model's programs compiled by XLA's CUDA compiler for 2 H100s only with the `gpu` extra
(opt-in: `pip install -e .[gpu]; pytest tests/plan/test_gpu_topology.py`, docs/scaling.md "GPU")."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxrl4llm.plan import gpu
from jaxrl4llm.plan.gpu import (GPU_CHIPS, gpu_chip_spec, gpu_target_config, gpu_topology_devices, is_gpu_topology,
                                missing_gpu_packages, parse_gpu_topology)
from jaxrl4llm.train.config import ConfigError

needs_gpu_extra = pytest.mark.skipif(
    bool(missing_gpu_packages()),
    reason="XLA's CUDA compiler is not installed (opt-in): pip install -e .[gpu] (or .[gpu13]); "
           "pytest tests/plan/test_gpu_topology.py")


def test_topology_names_are_gpu_hosts_by_gpus():
    assert parse_gpu_topology("h100:8") == ("h100", 1, 8)
    assert parse_gpu_topology("H100:2x8") == ("h100", 2, 8)
    assert parse_gpu_topology("b200:4x8") == ("b200", 4, 8)
    assert is_gpu_topology("h100:8") and is_gpu_topology("a100:2x8")
    assert not is_gpu_topology("v5p:4x4x4") and not is_gpu_topology("cpu")


def test_bad_names_say_what_is_known_and_how_to_write_one():
    with pytest.raises(ConfigError, match=r"unknown GPU 'h300'; known: h100, h200, a100, b200"):
        parse_gpu_topology("h300:8")
    for bad in ("h100:0", "h100:2x", "h100:1x2x8", "h100", "h100:8x0"):
        with pytest.raises(ConfigError, match=r"<gpu>:<hosts>x<gpus per host>.*h100:2x8"):
            parse_gpu_topology(bad)


def test_spec_table_matches_the_datasheets_and_the_target_files():
    h100 = gpu_chip_spec("h100:2x8")
    assert h100 is GPU_CHIPS["h100"]
    # H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s both ways = 450 one way
    assert (h100.peak_flops, h100.hbm_bandwidth, h100.ici_bandwidth) == (989e12, 3.35e12, 450e9)
    assert h100.peak_flops / h100.hbm_bandwidth == pytest.approx(295, abs=1)  # FLOP per HBM byte to be compute bound
    assert GPU_CHIPS["a100"].peak_flops == 312e12 and GPU_CHIPS["b200"].peak_flops == 2.25e15
    for name, chip in GPU_CHIPS.items():
        text = gpu_target_config(name)
        # the memory we check a fit against is the one XLA's CUDA compiler is told
        assert int(re.search(r"device_memory_size: (\d+)", text)[1]) == chip.hbm, name
        assert text.startswith("# NVIDIA") and "openxla/xla xla/backends/gpu/target_config/specs/" in text
        assert "Apache License 2.0" in text and "collective_memory_granularity" not in text
    assert 79 * 2**30 < GPU_CHIPS["h100"].hbm < 80 * 2**30  # an "80 GB" H100 as CUDA reports it


def test_a_missing_plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpu, "find_spec", lambda name: None)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu.os.path, "exists", lambda path: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert missing_gpu_packages() == ["jax-cuda12-plugin + jax-cuda12-pjrt (or jax-cuda13-plugin + jax-cuda13-pjrt)",
                                      "nvidia-cuda-nvcc-cu12 or nvidia-cuda-nvcc (ptxas)"]
    with pytest.raises(ConfigError, match=r"'h100:8' needs XLA's CUDA compiler.*jax-cuda12-plugin.*jax-cuda13-plugin"
                                          r".*pip install -e \.\[gpu\].*pip install -e \.\[gpu13\]"):
        gpu_topology_devices("h100:8")


def _installed(monkeypatch, versions: dict, jaxlib: str = "0.12.0.1"):
    """Pretend the plugins in `versions` ({pip package: version}) are installed, at jaxlib `jaxlib`."""
    modules = {module for module, dist, _ in gpu.CUDA_PLUGINS if dist in versions}
    monkeypatch.setattr(gpu, "find_spec", lambda name: object() if name in modules else None)

    def version(dist):
        if dist == "jaxlib":
            return jaxlib
        if dist not in versions:
            raise gpu.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(gpu.metadata, "version", version)


def test_the_cuda_12_or_the_cuda_13_plugin_is_taken_at_jaxlibs_version(monkeypatch):
    _installed(monkeypatch, {"jax-cuda13-plugin": "0.12.0.1"})
    assert gpu.cuda_plugin() == ("jax_plugins.xla_cuda13", "jax-cuda13-plugin", "jax-cuda13-pjrt")
    _installed(monkeypatch, {"jax-cuda12-plugin": "0.12.0.1"})
    assert gpu.cuda_plugin()[1] == "jax-cuda12-plugin"
    _installed(monkeypatch, {"jax-cuda12-plugin": "0.10.2", "jax-cuda13-plugin": "0.12.0.1"})
    assert gpu.cuda_plugin()[1] == "jax-cuda13-plugin"  # the one matching jaxlib, not the first
    _installed(monkeypatch, {"jax-cuda12-plugin": "0.12.0.1", "jax-cuda13-plugin": "0.12.0.1"})
    assert gpu.cuda_plugin()[1] == "jax-cuda12-plugin"
    _installed(monkeypatch, {})
    assert gpu.cuda_plugin() is None


def test_a_cuda_13_plugin_at_another_version_names_its_extra(monkeypatch):
    _installed(monkeypatch, {"jax-cuda13-plugin": "0.11.2"})
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/usr/bin/ptxas")
    with pytest.raises(ConfigError, match=r"jax-cuda13-plugin 0\.11\.2 does not match jaxlib 0\.12\.0\.1.*\.\[gpu13\]"):
        gpu_topology_devices("h100:8")


def test_ptxas_alone_missing_is_named(monkeypatch):
    monkeypatch.setattr(gpu, "find_spec", lambda name: object() if name.startswith("jax_plugins") else None)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu.os.path, "exists", lambda path: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ConfigError, match=r"but nvidia-cuda-nvcc-cu12 or nvidia-cuda-nvcc \(ptxas\) is not installed.*\.\[gpu\]"):
        gpu_topology_devices("h100:8")


# ---- opt-in: XLA's CUDA compiler (the `gpu` extra) ----

def _sharded(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@needs_gpu_extra
def test_two_hosts_of_eight_come_host_major():
    devices = gpu_topology_devices("h100:2x8")
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    rows = np.array(devices).reshape(2, 8)  # ("data", "fsdp"): fsdp inside a host's NVLink domain
    assert [{d.process_index for d in row} for row in rows] == [{0}, {1}]


@needs_gpu_extra
def test_a_sharded_matmul_compiles_for_two_h100s():
    mesh = Mesh(np.array(gpu_topology_devices("h100:2")), ("x",), axis_types=(AxisType.Auto,))
    a = _sharded((1024, 512), jnp.bfloat16, mesh, P("x"))
    b = _sharded((512, 256), jnp.bfloat16, mesh, P())
    compiled = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).sum()).lower(a, b).compile()
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes == 512 * 512 * 2 + 512 * 256 * 2  # half of a, all of b, per GPU
    assert memory.output_size_in_bytes == 4
    assert "all-reduce" in compiled.as_text()  # the two halves' sums meet over NVLink
    # XLA gives no cost analysis for these executables: plan counts FLOPs from as_text()
    # (jaxrl4llm/plan/hlo_cost.py); if this starts failing, XLA gives one and plan may use it.
    assert compiled.cost_analysis() is None


@needs_gpu_extra
def test_a_write_into_a_pool_and_a_gather_from_it_move_their_part_not_the_pool():
    """XLA's cost analysis counts a GPU scatter fusion as reading and writing its whole operand (a
    KV write into the sampler's page pool: the pool, every step) and a gather fusion as reading its
    whole operand; the meter counts the update and the gathered pages (hlo_cost.fusion_excess_bytes).
    Loops of n writes of 32 tokens into a 134 MB pool, and of n gathers of 256 pages from it."""
    from jaxrl4llm.plan.hlo_cost import compiled_hlo_text, program_cost

    mesh = Mesh(np.array(gpu_topology_devices("h100:2"))[:1], ("x",), axis_types=(AxisType.Auto,))
    pool = _sharded((4096, 16, 8, 128), jnp.bfloat16, mesh, P())
    new, at = _sharded((32, 8, 128), jnp.bfloat16, mesh, P()), _sharded((32,), jnp.int32, mesh, P())

    def writes(pool, new, page, offset, n):
        return jax.lax.fori_loop(0, n, lambda i, p: p.at[page, offset].set(new + i.astype(new.dtype)), pool)

    hbm = {}
    for n in (10, 20):
        with jax.set_mesh(mesh):
            compiled = jax.jit(writes, static_argnums=4, donate_argnums=0).lower(pool, new, at, at, n).compile()
        hbm[n] = program_cost(compiled_hlo_text(compiled), num_devices=1).hbm_bytes
    update = 32 * 8 * 128 * 2
    per_write = (hbm[20] - hbm[10]) / 10
    assert update <= per_write <= 4 * update, per_write  # XLA alone: 2 x 134 MB a write

    def reads(pool, pages, n):  # gathers of 32 x 8 pages (8.4 MB) a trip
        take = lambda i, acc: acc + jnp.take(pool, (pages + i) % 4096, axis=0).astype(jnp.float32).sum(axis=(1, 2))
        return jax.lax.fori_loop(0, n, take, jnp.zeros((32, 8, 128), jnp.float32))

    pages = _sharded((32, 8), jnp.int32, mesh, P())
    for n in (10, 20):
        with jax.set_mesh(mesh):
            compiled = jax.jit(reads, static_argnums=2).lower(pool, pages, n).compile()
        hbm[n] = program_cost(compiled_hlo_text(compiled), num_devices=1).hbm_bytes
    gathered, per_read = 32 * 8 * 16 * 8 * 128 * 2, (hbm[20] - hbm[10]) / 10
    assert gathered <= per_read <= 4 * gathered, per_read  # XLA alone: the 134 MB pool a read


@needs_gpu_extra
def test_a_tiny_model_forward_compiles_for_two_h100s_and_fits():
    from jaxrl4llm.models import ModelConfig, abstract_model, param_shardings, score_tokens

    mesh = Mesh(np.array(gpu_topology_devices("h100:2")).reshape(1, 2, 1), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    config = ModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, remat=True)
    graphdef, abstract = abstract_model(config)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                          param_shardings(abstract, mesh))
    tokens = _sharded((8, 1024), jnp.int32, mesh, P(("data", "fsdp")))
    fn = jax.jit(lambda s, x: score_tokens(graphdef, s, x, x, positions=x, attention_mask=x, chunk_size=512))
    with jax.set_mesh(mesh):
        compiled = fn.lower(params, tokens).compile()
    memory = compiled.memory_analysis()
    param_bytes = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))
    assert memory.argument_size_in_bytes == param_bytes + 4 * 1024 * 4  # FSDP: half the weights, 4 rows of tokens
    # [4, 1024] float32 log-probs and entropies per GPU (+16 bytes: the tuple's table of pointers)
    assert 2 * 4 * 1024 * 4 <= memory.output_size_in_bytes <= 2 * 4 * 1024 * 4 + 64
    # measured 298 MiB: the [4, 512, 32768] float32 logits of one chunk dominate
    assert 4 * 512 * 32768 * 4 < memory.temp_size_in_bytes < 2 * 2**30
    assert memory.temp_size_in_bytes + memory.argument_size_in_bytes < GPU_CHIPS["h100"].hbm
    hlo = compiled.as_text()
    assert "all-gather-start" in hlo and "__triton" in hlo  # FSDP gathers the weights; GEMMs are Triton fusions


@needs_gpu_extra
def test_xla_compiles_a_program_larger_than_the_gpu_so_plan_must_check():
    mesh = Mesh(np.array(gpu_topology_devices("h100:2")), ("x",), axis_types=(AxisType.Auto,))
    big = _sharded((2 * 25 * 2**30,), jnp.float32, mesh, P("x"))  # 100 GiB a GPU in, 200 out
    memory = jax.jit(lambda x: (x * 2, x + 1)).lower(big).compile().memory_analysis()
    assert memory.argument_size_in_bytes + memory.output_size_in_bytes > 3 * GPU_CHIPS["h100"].hbm


@needs_gpu_extra
def test_plan_compiles_the_continuous_sampler_with_the_triton_paged_kernel_reading_the_pool_in_place(monkeypatch):
    """`plan` on h100:2: the tiny run's eval on the continuous engine (decode mesh 2-way tensor parallel:
    one kv head a GPU) runs the Pallas/Triton paged attention kernel, one custom call per layer, whose
    key and value operands are the same buffer, a bitcast of the layer's pool as the step's token write
    (a scatter) left it: no transpose or copy of the pool a step. The meter adds the kernel's FLOPs and
    KV bytes (XLA counts the custom call as nothing), the FLOPs of the query rows it computes."""
    from jaxrl4llm.plan.programs import format_plan, plan_eval
    from jaxrl4llm.train.config import load_config
    from tests.plan.conftest import TINY

    cfg = load_config(None, TINY + ["rollout.engine=continuous", "mesh.fsdp=2", "rollout.tensor_parallel=2",
                                    "trainer.eval_samples=4", "rollout.slots=8", "model.num_layers=1",
                                    "rollout.max_new_tokens=16", "data.max_prompt_tokens=16"])
    plan = plan_eval(cfg, "h100:2", problems=8)
    decode = next(p for p in plan.programs if p.name == "sampler/decode")
    assert plan.sampler["attention"] == "gpu_triton" and decode.fits
    hlo = decode.hlo
    calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"__gpu\$xla\.gpu\.triton\"[^\n]*"
                       r"jaxrl4llm_paged_attention", hlo)
    assert len(calls) == cfg.model.num_layers
    for operands in calls:
        q, keys, values, table, lengths, split = [o.strip() for o in operands.split(",")]
        assert keys == values  # one pool buffer, K and V picked by the block specs
        # the pool [pages, page, 2 KVH, Dh] viewed as [pages, page, KVH, k|v, Dh]: a bitcast, not a copy
        source = re.search(rf"\n\s*{re.escape(keys)} = bf16\[(\d+),16,1,2,32\]\S* bitcast\(([\w.]+)\)", hlo)
        assert source and "scatter" in source[2], source  # the pool as write_tokens left it
    assert 0 < decode.kernel_flops < decode.flops and 0 < decode.kernel_bytes < decode.hbm_bytes
    assert plan.decode["q_heads"] == 16  # a GPU's kv head and its 2 query heads, padded to the kernel's 16 rows
    # the kernel's float32 partials (o [Dh], l, m) are its bytes too: every slot's K partitions of 16 padded rows
    # (STORE "all"), or only the live partitions' real rows (STORE "live", re-priced: no recompile)
    from jaxrl4llm.plan.programs import with_lengths
    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    work, slots = plan.decode["work"], plan.decode["slots"] // plan.decode["shards"]
    steps = cfg.model.num_layers * work["steps"]
    splits = gpa.kernel_blocks(plan.decode["table_pages"], slots, 1, gpa.PAGES_PER_BLOCK)[1]
    assert work["kv_partitions"] == slots * splits
    kv_bytes = steps * work["kv_pages"] * 16 * 2 * 1 * 32 * 2  # pages x page x (k, v) x 1 kv head x Dh x bf16
    assert decode.kernel_bytes == pytest.approx(kv_bytes + steps * slots * splits * 16 * (32 + 2) * 4)
    every = with_lengths(plan, "lognormal:mean=6,sigma=0.8")
    monkeypatch.setattr(gpa, "STORE", "live")
    live = with_lengths(plan, "lognormal:mean=6,sigma=0.8")
    assert 0 < live.decode["work"]["kv_partitions"] <= every.decode["work"]["kv_partitions"] == slots * splits
    kernel_bytes = lambda p: next(x for x in p.programs if x.name == "sampler/decode").kernel_bytes
    assert kernel_bytes(live) < kernel_bytes(every)
    assert "attention by the Triton paged attention kernel" in format_plan(plan)
