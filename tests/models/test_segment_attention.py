"""segment_causal_attention: every backend against a dense masked-softmax reference, on packed,
left-padded and all-padding rows, values and gradients; "auto" by the compiled-for platform; the
splash kernel in a program compiled for a TPU topology."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxrl4llm.kernels.choice import ATTENTION_IMPLS
from jaxrl4llm.models.config import ConfigError, ModelConfig
from jaxrl4llm.models.layers.segment_attention import (GPU_SHARED_MEMORY, block_causal_attention,
                                                       first_key_blocks, kernel_attention_flops, pallas_gpu_blocks,
                                                       pallas_gpu_shared_memory, resolve_impl,
                                                       segment_causal_attention)
from jaxrl4llm.plan.gpu import missing_gpu_packages
from tests.gpu_kernels import assert_close_bf16, bf16_normal, segment_attention_reference
from tests.subprocess_xla_flags import xla_flags

H, KVH = 4, 2


def dense_reference(q, k, v, segment_ids):
    """softmax over s <= t with equal ids, from the explicit [B, H, T, T] mask (float32, -inf masked)."""
    t = q.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") / np.sqrt(q.shape[-1])
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v, precision="highest")


def packed_row(lengths, t):
    """ids 1, 2, ... over consecutive segments of `lengths`, 0 on the trailing padding."""
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return np.pad(ids, (0, t - len(ids)))


def left_padded_row(pad, t):
    """The attention mask of a left-padded row: `pad` zeros then ones."""
    return (np.arange(t) >= pad).astype(np.int32)


def qkv(seed, b, t, dh):
    """q [B, T, H, Dh], k, v [B, T, KVH, Dh] and the loss weights w [B, T, H, Dh], standard normal."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, H, dh), (b, t, KVH, dh), (b, t, KVH, dh), (b, t, H, dh)]
    return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes]


@functools.lru_cache(maxsize=None)
def value_and_grads(attention):
    """jit of (q, k, v, ids, w) -> (out, d sum(out * w) / d(q, k, v)): one compile per attention and shape."""
    def loss(q, k, v, ids, w):
        out = attention(q, k, v, ids)
        return jnp.sum(out * w), out
    grads = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v, ids, w: grads(q, k, v, ids, w)[::-1])


@functools.lru_cache(maxsize=None)
def attention_of(impl, block, dtype=jnp.float32):
    return functools.partial(_attention, impl=impl, block=block, dtype=dtype)


def _attention(q, k, v, ids, *, impl, block, dtype):
    return segment_causal_attention(q, k, v, ids, dtype=dtype, impl=impl, block=block)


# ---------------------------------------------------------------- xla: a property test against the dense reference
T_SMALL, BLOCK_SMALL = 44, 16  # 3 key blocks, the last one padded


@st.composite
def segment_row(draw, t=T_SMALL):
    kind = draw(st.sampled_from(["packed", "left_padded", "all_padding"]))
    if kind == "left_padded":
        return left_padded_row(draw(st.integers(0, t)), t)
    if kind == "all_padding":
        return np.zeros(t, np.int32)
    lengths = draw(st.lists(st.integers(1, t), min_size=1, max_size=6))
    lengths = np.array(lengths)[np.cumsum(lengths) <= t]
    return packed_row(lengths if len(lengths) else [t], t)


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(segment_row(), min_size=2, max_size=2), seed=st.integers(0, 2**16))
@example(rows=[packed_row([20, 24], T_SMALL), packed_row([18, 20], T_SMALL)], seed=0)  # block 2 skips key block 0
def test_xla_block_causal_equals_the_dense_masked_softmax_values_and_gradients(rows, seed):
    ids = jnp.asarray(np.stack(rows), jnp.int32)
    q, k, v, w = qkv(seed, 2, T_SMALL, 8)
    out, grads = value_and_grads(attention_of("xla", BLOCK_SMALL))(q, k, v, ids, w)
    ref, ref_grads = value_and_grads(dense_reference)(q, k, v, ids, w)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def test_xla_path_never_builds_a_t_by_t_array():
    """No intermediate of the forward and backward of T = 64 in blocks of 16 has two dims >= T."""
    t = 64
    q, k, v, w = qkv(0, 2, t, 8)
    ids = jnp.ones((2, t), jnp.int32)
    loss = lambda q, k, v: jnp.sum(block_causal_attention(q, k, v, ids, dtype=jnp.float32, block=16) * w)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (var.aval.shape for var in eqn.outvars if hasattr(var.aval, "shape"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    seen = list(shapes(jaxpr.jaxpr))
    assert (2, KVH, H // KVH, 16, 16) in seen  # a [B, KVH, G, block, block] score tile: the walk sees the loops
    assert not [s for s in seen if sum(d >= t for d in s) >= 2]


def test_first_key_blocks_is_where_the_segments_of_a_query_block_begin():
    packed = packed_row([5, 6, 3], 16)  # segments start at 0, 5, 11; padding at 14: blocks of 4 start at 0, 0, 1, 2
    left = left_padded_row(6, 16)  # padding from 0, the sequence from 6: 0, 0, 1, 1
    recurring = np.tile([1, 1, 2, 2], 4)  # ids 1 and 2 recur along the row: every query may see block 0
    first = lambda *rows: first_key_blocks(jnp.asarray(np.stack(rows), jnp.int32), 4).tolist()
    assert first(packed) == [0, 0, 1, 2]
    assert first(left) == [0, 0, 1, 1]
    assert first(packed, left) == [0, 0, 1, 1]  # one loop serves all rows: the earliest row's start
    assert first(recurring) == [0, 0, 0, 0]


# ---------------------------------------------------------------- the kernels (Pallas interpret mode on CPU) == xla
T_KERNEL = 200  # padded to 256 inside the kernels' wrappers: two splash blocks of 128
KERNEL_ROWS = np.stack([packed_row([90, 70, 25], T_KERNEL), left_padded_row(57, T_KERNEL), np.zeros(T_KERNEL)])


@pytest.mark.parametrize("impl", ["splash", pytest.param("pallas_gpu", marks=pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="on a GPU the Triton kernel runs for real, in bf16: "
                                           "test_pallas_gpu_flash_attention_in_bf16_at_qwen3_head_dim"))])
def test_kernel_in_interpret_mode_equals_xla_values_and_gradients(impl):
    ids = jnp.asarray(KERNEL_ROWS, jnp.int32)
    q, k, v, w = qkv(1, 3, T_KERNEL, 32)
    out, grads = value_and_grads(attention_of(impl, 128))(q, k, v, ids, w)
    ref, ref_grads = value_and_grads(attention_of("xla", 128))(q, k, v, ids, w)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- the Triton flash kernel for real on a GPU (pytest -m gpu)
T_GPU = 200  # ragged: the kernel pads it to 256 (its forward blocks of 128)
GPU_ROWS = np.stack([packed_row([90, 70, 25], T_GPU), left_padded_row(57, T_GPU)])


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2)])
def test_pallas_gpu_flash_attention_in_bf16_at_qwen3_head_dim(heads, kv_heads):
    """The "pallas_gpu" backend (Triton `mha`: the real kernel on a GPU, Pallas' interpreter elsewhere,
    as `segment_causal_attention` decides) at Qwen3's head_dim 128 in bf16, packed and left-padded
    rows of a ragged T: values and gradients wrt q, k, v equal the XLA path and a float64 reference
    (`tests.gpu_kernels.BF16_*` tolerances). GQA 2:1 and 4:1 (Qwen3-0.6B's 16:8, Qwen3-8B's 32:8
    ratios; the kernel repeats kv heads, so the ratio matters, not the head count)."""
    rng = np.random.default_rng(heads)
    b, dh = len(GPU_ROWS), 128
    q, w = bf16_normal(rng, (b, T_GPU, heads, dh)), rng.standard_normal((b, T_GPU, heads, dh))
    k, v = bf16_normal(rng, (b, T_GPU, kv_heads, dh)), bf16_normal(rng, (b, T_GPU, kv_heads, dh))
    ids = jnp.asarray(GPU_ROWS, jnp.int32)
    ref = segment_attention_reference(q, k, v, GPU_ROWS, w)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]  # bf16 values; cast to bf16 inside
    for impl in ("pallas_gpu", "xla"):
        out, grads = value_and_grads(attention_of(impl, 128, jnp.bfloat16))(*args, ids, jnp.asarray(w, jnp.float32))
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
            assert bool(jnp.isfinite(got).all()), f"{impl} {name}"
            assert_close_bf16(got, want, f"{impl} {name}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t", [1, 16, 17, 33, 48, 80, 96, 112, 127, 128, 200, 1000, 4096])
def test_pallas_gpu_blocks_are_powers_of_two_dividing_the_padded_row_within_shared_memory(t, head_dim):
    """Triton takes power-of-two blocks of >= 16 rows; T is padded to a multiple of every block;
    both kernels' staged tiles fit an H100's shared memory (227 KB) in bf16 up to head_dim 256."""
    blocks = pallas_gpu_blocks(t, head_dim)
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    assert pow2(blocks.forward) and pow2(blocks.backward) and blocks.backward <= blocks.forward <= 128
    assert blocks.padded >= t and blocks.padded % blocks.forward == 0 and blocks.padded % blocks.backward == 0
    assert blocks.padded - t < blocks.forward
    assert pallas_gpu_shared_memory(blocks.forward, head_dim, backward=False) <= GPU_SHARED_MEMORY
    assert pallas_gpu_shared_memory(blocks.backward, head_dim, backward=True) <= GPU_SHARED_MEMORY


@pytest.mark.skipif(bool(missing_gpu_packages()), reason="XLA's CUDA compiler is not installed (opt-in): "
                                                          "pip install -e .[gpu]")
@pytest.mark.parametrize("t, head_dim", [(80, 128), (512, 256)])
def test_pallas_gpu_forward_and_backward_compile_for_an_h100(t, head_dim):
    """XLA's Triton compiler for sm_90 (on this CPU host, no GPU) takes the blocks of
    `pallas_gpu_blocks`: a row of 80 positions (one block of 128, not 80: Triton refuses a
    non-power-of-two block) and head_dim 256 (forward blocks of 64: at 128 the forward asks for
    328192 bytes of shared memory, more than the H100's 232448)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxrl4llm.plan.programs import topology_mesh

    mesh = topology_mesh("h100:1", data=1, fsdp=1, tensor=1)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    args = (spec((1, t, 4, head_dim), jnp.bfloat16), spec((1, t, 2, head_dim), jnp.bfloat16),
            spec((1, t, 2, head_dim), jnp.bfloat16), spec((1, t), jnp.int32))

    def loss(q, k, v, ids):
        return jnp.sum(segment_causal_attention(q, k, v, ids, dtype=jnp.bfloat16, impl="pallas_gpu") ** 2)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert compiled.as_text().count("__gpu$xla.gpu.triton") >= 2  # the forward and backward kernels


def test_pallas_gpu_blocks_follow_jax_defaults_and_halve_for_shared_memory():
    assert pallas_gpu_blocks(4096, 128) == (128, 32, 4096)  # JAX's BlockSizes.get_default: 128 forward, 32 backward
    assert pallas_gpu_blocks(4096, 256) == (64, 32, 4096)  # 128 at Dh 256: 352 KB of tiles > 227 KB
    assert pallas_gpu_blocks(80, 128) == (128, 32, 128)  # 80 positions: one block of 128, not 80
    assert pallas_gpu_blocks(40, 128) == (64, 32, 64) and pallas_gpu_blocks(5, 128) == (16, 16, 16)
    assert pallas_gpu_blocks(4096, 128, block=100) == (64, 32, 4096)  # a smaller `block`: its power of two below
    # forward: 2 B x (Q 128x128 + 2 stages x (K, V) 128x128 + P 128x128) = 192 KB at Dh 128
    assert pallas_gpu_shared_memory(128, 128, backward=False) == 2 * (1 + 4 + 1) * 128 * 128


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_all_padding_rows_give_finite_values_and_gradients(impl):
    ids = jnp.zeros((3, T_KERNEL), jnp.int32)
    q, k, v, w = qkv(2, 3, T_KERNEL, 32)
    out, grads = value_and_grads(attention_of(impl, 128))(q, k, v, ids, w)
    assert all(bool(jnp.isfinite(x).all()) for x in (out, *grads))


def test_bfloat16_matmuls_stay_close_to_float32():
    ids = jnp.asarray(KERNEL_ROWS, jnp.int32)
    q, k, v, _ = qkv(3, 3, T_KERNEL, 32)
    out = jax.jit(attention_of("xla", 128, jnp.bfloat16))(q, k, v, ids)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, dense_reference(q, k, v, ids), atol=3e-2)


# ---------------------------------------------------------------- choosing a backend
def test_auto_is_xla_on_cpu_and_names_are_validated():
    assert resolve_impl("auto") == "xla"
    assert resolve_impl("splash") == "splash"
    with pytest.raises(ValueError, match="valid: auto, xla, splash, pallas_gpu, cudnn"):
        resolve_impl("flash")
    q, k, v, _ = qkv(0, 1, 8, 8)
    with pytest.raises(ValueError, match="model.attention_impl=pallas_gpu"):
        segment_causal_attention(q, k, v, jnp.ones((1, 8), jnp.int32), dtype=jnp.float32, impl="cudnn")
    with pytest.raises(ValueError, match=r"segment_ids \(1, 7\) must be \[B, T\]"):
        segment_causal_attention(q, k, v, jnp.ones((1, 7), jnp.int32), dtype=jnp.float32)


def test_model_config_validates_attention_impl():
    assert ModelConfig().attention_impl == "auto"
    assert {ModelConfig(attention_impl=name).attention_impl for name in ATTENTION_IMPLS} == set(ATTENTION_IMPLS)
    with pytest.raises(ConfigError, match="attention_impl='flash'; choose one of auto, xla, splash, pallas_gpu"):
        ModelConfig(attention_impl="flash")


def test_kernel_attention_flops_counts_the_blocks_on_and_below_the_diagonal():
    # T = 1000 in blocks of 512: 2 x 2 blocks, 3 computed; 2 matmuls x 2 FLOPs x 512^2 x 128 each, per row and head
    assert kernel_attention_flops(2, 1000, 4, 128) == 2 * 4 * 3 * 4 * 512 * 512 * 128
    assert kernel_attention_flops(2, 1000, 4, 128, backward=True) == 2 * 4 * 3 * 10 * 512 * 512 * 128
    assert kernel_attention_flops(1, 100, 1, 64) == 4 * 128 * 128 * 64  # one block of 128 lanes
    # pallas_gpu: its own blocks (pallas_gpu_blocks): T = 1000 -> 1024, forward 8 blocks of 128 (36 computed),
    # backward 32 blocks of 32 (528 computed), 7 matmuls each
    assert kernel_attention_flops(2, 1000, 4, 128, block=128, impl="pallas_gpu") == 2 * 4 * 36 * 4 * 128 * 128 * 128
    assert kernel_attention_flops(2, 1000, 4, 128, block=128, impl="pallas_gpu", backward=True) == (
        2 * 4 * 528 * 14 * 32 * 32 * 128)


def topology_mesh_or_skip(topology):
    from jaxrl4llm.plan.programs import topology_mesh
    try:
        return topology_mesh(topology, data=1, fsdp=2, tensor=2)
    except ConfigError as e:  # XLA's TPU compiler (libtpu) or CUDA compiler (the gpu extra) not installed
        pytest.skip(str(e))


@pytest.mark.parametrize("topology, impl, kernel", [
    ("v5e:2x2", "splash", "tpu_custom_call"),
    pytest.param("h100:4", "pallas_gpu", "__gpu$xla.gpu.triton", marks=pytest.mark.skipif(
        bool(missing_gpu_packages()), reason="XLA's CUDA compiler is not installed (opt-in): pip install -e .[gpu]")),
])
def test_auto_compiles_the_platform_kernel_for_a_topology(topology, impl, kernel):
    """Under jax.set_mesh(a TPU or GPU topology mesh) on this CPU host, "auto" picks the platform's
    kernel: the forward and gradient compile with it (batch over fsdp, heads over tensor)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = topology_mesh_or_skip(topology)
    b, t, dh = 4, 256, 128
    spec = lambda shape, pspec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, pspec))
    args = (spec((b, t, H, dh), P("fsdp", None, "tensor")), spec((b, t, KVH, dh), P("fsdp", None, "tensor")),
            spec((b, t, KVH, dh), P("fsdp", None, "tensor")),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))))

    def loss(q, k, v, ids):
        return jnp.sum(segment_causal_attention(q, k, v, ids, dtype=jnp.bfloat16) ** 2)

    with jax.set_mesh(mesh):
        assert resolve_impl("auto") == impl
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert compiled.as_text().count(kernel) >= 2  # the forward kernel and the backward kernels


def test_splash_in_a_shard_map_over_8_devices_equals_single_device_xla():
    """splash under jax.set_mesh((data 2, fsdp 2, tensor 2)): batch and heads split by the shard_map,
    grouped kv heads kept (KVH 2) or repeated (KVH 1): values and gradients."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",  # 8 devices, fast compiles
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "tests.models.segment_attention_sharded_main"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr[-3000:]
