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

from jaxrl4llm.models.config import ConfigError, ModelConfig
from jaxrl4llm.models.layers.segment_attention import (ATTENTION_IMPLS, block_causal_attention, first_key_blocks,
                                                       kernel_attention_flops, resolve_impl, segment_causal_attention)
from jaxrl4llm.plan.gpu import missing_gpu_packages

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


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_kernel_in_interpret_mode_equals_xla_values_and_gradients(impl):
    ids = jnp.asarray(KERNEL_ROWS, jnp.int32)
    q, k, v, w = qkv(1, 3, T_KERNEL, 32)
    out, grads = value_and_grads(attention_of(impl, 128))(q, k, v, ids, w)
    ref, ref_grads = value_and_grads(attention_of("xla", 128))(q, k, v, ids, w)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "tests.models.segment_attention_sharded_main"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr[-3000:]
