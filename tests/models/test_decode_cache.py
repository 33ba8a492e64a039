"""Decode-path memory ops of the CPU decode backend: the KV-block write changes one slot bit for
bit; the embedding lookup never makes a float32 copy of a 16-bit table. The platform-neutral
DecodeBackend ops are the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.models.decode import DecodeBackend
from jaxrl4llm.models.layers.norm import rms_norm
from jaxrl4llm.sampling.decode_backends import CpuBackend

CPU = CpuBackend()  # kernels=False: the 16-bit moves only, no C++ kernel needed
_cpu_write_slot = jax.jit(CPU.write_slot)
_xla_write_slot = jax.jit(DecodeBackend().write_slot)


@settings(max_examples=20, deadline=None)
@given(slot=st.integers(0, 7), dtype=st.sampled_from(["bfloat16", "float32", "float16"]))
def test_write_slot_equals_a_plain_dynamic_update_slice(slot, dtype):
    """16-bit floats go through their uint16 bits (XLA:CPU would widen a bf16 update to f32)."""
    cache = jax.random.normal(jax.random.key(1), (3, 2, 8, 4)).astype(dtype)
    new = jax.random.normal(jax.random.key(2), (3, 2, 1, 4), jnp.float32)
    got = _cpu_write_slot(cache, new, jnp.int32(slot))
    expected = np.array(cache)
    expected[:, :, slot] = np.asarray(new.astype(dtype))[:, :, 0]
    assert got.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(np.asarray(_xla_write_slot(cache, new, jnp.int32(slot))), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embed_lookup_gathers_rows_without_a_float32_copy_of_the_table(dtype):
    """Inside a loop (as in the decode while_loop) a bf16 table stays bf16 in the compiled program:
    XLA:CPU would convert the whole loop-invariant table to float32 in front of the gather."""
    table = jax.random.normal(jax.random.key(0), (96, 64)).astype(dtype)
    tokens = jnp.array([3, 95, 0, 17, 3])
    expected = np.asarray(table.astype(jnp.float32))[np.asarray(tokens)]
    np.testing.assert_array_equal(np.asarray(CPU.embed(table, tokens)), expected)
    np.testing.assert_array_equal(np.asarray(DecodeBackend().embed(table, tokens)), expected)

    def loop(table, scale, tokens):
        def body(i, acc):
            x = rms_norm(CPU.embed(table, (tokens + i) % 96), scale, 1e-6).astype(jnp.bfloat16)
            return acc + x.astype(jnp.float32).sum()
        return jax.lax.fori_loop(0, 4, body, 0.0)

    hlo = jax.jit(loop).lower(table, jnp.ones((64,)), tokens).compile().as_text()
    assert ("f32[96,64]" in hlo) == (dtype == "float32")


@pytest.mark.parametrize("backend", [DecodeBackend(), CPU], ids=["xla", "cpu_fused"])
def test_decode_layout_of_a_mixture_of_experts_model_prefills_as_the_forward(backend):
    """The decode layout carries the router and experts; its prefill (expert form chosen for the
    prefill phase) gives the training forward's last-token logits, on both weight layouts."""
    from jaxrl4llm.models import ModelConfig, forward
    from jaxrl4llm.models.causal_lm import init_model
    from jaxrl4llm.models.decode import decode_weights, prefill

    moe = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=0, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8, dtype="float32")
    graphdef, state = init_model(moe, jax.random.key(0), std=0.4)  # routes differ from token to token
    layer = jax.eval_shape(lambda s: decode_weights(s, moe, backend), state)["layers"][0]
    assert layer["expert_gate"].shape == (4, 16, 8) and "gate_up_t" not in layer
    tokens = jnp.array([[0, 0, 5, 9, 3, 61], [7, 1, 2, 3, 4, 5]], jnp.int32)
    mask = jnp.array([[0, 0, 1, 1, 1, 1], [1] * 6], jnp.int32)
    logits, _ = jax.jit(lambda s: prefill(decode_weights(s, moe, backend), moe, tokens, mask, backend=backend))(state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    expected, routes = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, return_routes=True)
    assert len(np.unique(np.asarray(routes).reshape(-1, 2), axis=0)) > 2
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected[:, -1]), rtol=1e-5, atol=1e-5)
