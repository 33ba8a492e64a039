"""forward / hidden_states / token_logprobs / forward_with_cache agree with each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.models import (
    ModelConfig,
    forward,
    forward_with_cache,
    init_cache,
    init_params,
    positions_from_mask,
    token_logprobs,
)

TINY = ModelConfig(
    architecture="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, dtype="float32",
)
LENGTHS = (8, 5, 1)
T = 8


def _left_padded_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(LENGTHS), T), np.int32)
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, T - n:] = rng.integers(1, TINY.vocab_size, n)
        mask[b, T - n:] = 1
    return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.fixture(scope="module")
def params():
    # std 0.1 so logits are far from uniform and mistakes show.
    return init_params(TINY, jax.random.key(0), std=0.1)


def test_left_padded_rows_equal_rows_alone(params):
    tokens, mask = _left_padded_batch()
    tokens = jnp.where(mask > 0, tokens, -1)  # an out-of-range pad id must not poison real rows
    logits = forward(params, TINY, tokens, positions=positions_from_mask(mask), attention_mask=mask)
    assert logits.shape == (3, T, TINY.vocab_size) and logits.dtype == jnp.float32
    for b, n in enumerate(LENGTHS[1:], start=1):
        # Same row alone, right-aligned in a full-length unpadded batch of one: compare last n.
        alone = tokens[b:b + 1, T - n:]
        ones = jnp.ones_like(alone)
        ref = forward(params, TINY, jnp.pad(alone, ((0, 0), (0, T - n))), positions=jnp.arange(T)[None],
                      attention_mask=jnp.pad(ones, ((0, 0), (0, T - n))))
        np.testing.assert_allclose(logits[b, T - n:], ref[0, :n], atol=1e-5)
    assert np.isfinite(np.asarray(logits)).all()
    chunked = forward(params, TINY.replace(attention_query_chunk=3), tokens, positions=positions_from_mask(mask),
                      attention_mask=mask)
    np.testing.assert_allclose(chunked, logits, atol=1e-5)


def test_token_logprobs_equals_log_softmax_of_forward(params):
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)
    logits = forward(params, TINY, tokens, positions=positions, attention_mask=mask) / 0.7
    ref_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    ref_ent = -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1)
    # chunk 3 does not divide T = 8: exercises the padding of the last chunk.
    logp, ent = token_logprobs(params, TINY, tokens, targets, positions=positions, attention_mask=mask,
                               temperature=0.7, chunk_size=3)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)


def test_token_logprobs_gradients(params):
    """Chunked + remat gradients equal the unchunked ones (f32); bf16 compute gives f32 grads close to them."""
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)

    def chunked(p, config):
        logp, _ = token_logprobs(p, config, tokens, targets, positions=positions, attention_mask=mask, chunk_size=4)
        return jnp.sum(logp * mask)

    def full(p):
        logits = forward(p, TINY, tokens, positions=positions, attention_mask=mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(logp * mask)

    grad = jax.jit(jax.grad(chunked), static_argnums=1)
    # Chunked LM head, chunked attention (3 queries per block, padded) and remat together.
    g_chunked = grad(params, TINY.replace(remat=True, attention_query_chunk=3))
    g_full = jax.jit(jax.grad(full))(params)
    g_bf16 = grad(params, TINY.replace(dtype="bfloat16", remat=True))
    for a, b, c in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_full), jax.tree.leaves(g_bf16)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
        assert c.dtype == jnp.float32
        assert np.abs(c - b).max() <= 0.05 * np.abs(b).max() + 1e-6


def test_prefill_then_decode_equals_full_forward(params):
    tokens, mask = _left_padded_batch()
    prompt_len, steps = 5, 3
    max_len = prompt_len + steps
    positions = positions_from_mask(mask)
    full = forward(params, TINY, tokens, positions=positions, attention_mask=mask)

    cache = init_cache(TINY, batch=3, max_len=max_len + 2, dtype=jnp.float32)  # 2 spare slots stay empty
    kv_mask = jnp.zeros((3, max_len + 2), jnp.int32).at[:, :prompt_len].set(mask[:, :prompt_len])
    logits, cache = forward_with_cache(params, TINY, tokens[:, :prompt_len], positions=positions[:, :prompt_len],
                                       cache=cache, cache_index=0, kv_mask=kv_mask)
    real = np.asarray(mask[:, :prompt_len])[..., None] > 0
    np.testing.assert_allclose(np.where(real, logits, 0), np.where(real, full[:, :prompt_len], 0), atol=1e-5)
    for i in range(prompt_len, max_len):
        kv_mask = kv_mask.at[:, i].set(mask[:, i])
        logits, cache = forward_with_cache(params, TINY, tokens[:, i:i + 1], positions=positions[:, i:i + 1],
                                           cache=cache, cache_index=jnp.int32(i), kv_mask=kv_mask)
        real = np.asarray(mask[:, i])[:, None] > 0  # row 2 is still padding at some steps
        np.testing.assert_allclose(np.where(real, logits[:, 0], 0), np.where(real, full[:, i], 0), atol=1e-5)


def test_bfloat16_compute_stays_close_to_float32(params):
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    f32 = forward(params, TINY, tokens, positions=positions, attention_mask=mask)
    bf16 = forward(params, TINY.replace(dtype="bfloat16"), tokens, positions=positions, attention_mask=mask)
    real = np.asarray(mask)[..., None] > 0
    assert bf16.dtype == jnp.float32
    assert np.abs(np.where(real, bf16 - f32, 0)).max() < 0.05 * np.abs(f32).max()

