"""Tests of token_logprobs (+ chunked, from hidden) and entropy_from_logits."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import (entropy_from_logits, token_logprobs, token_logprobs_chunked,
                            token_logprobs_from_hidden)
from tests.core import reference as ref
from tests.core._helpers import B, FAST, FEW, T, V, assert_finite, rng, seeds

D = 7
TEMPS = [1.0, 0.7, 1.3]


def _inputs(seed, scale=3.0):
    g = rng(seed)
    logits = (scale * g.normal(size=(B, T, V))).astype(np.float32)
    tokens = g.integers(0, V, size=(B, T)).astype(np.int32)
    return logits, tokens


# ----------------------------------------------------------------------------- hand values


def test_token_logprobs_hand_values():
    # softmax([0, 0]) = (.5, .5); softmax([0, log 3]) = (1/4, 3/4)
    logits = jnp.array([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    out = token_logprobs(logits, jnp.array([[0, 1]]))
    np.testing.assert_allclose(np.asarray(out), [[math.log(0.5), math.log(0.75)]], atol=1e-6)
    # temperature 2 halves the logits: softmax([0, log 3 / 2]) = (1/(1+sqrt3), sqrt3/(1+sqrt3))
    out = token_logprobs(logits, jnp.array([[0, 1]]), temperature=2.0)
    s3 = math.sqrt(3.0)
    np.testing.assert_allclose(np.asarray(out), [[math.log(0.5), math.log(s3 / (1 + s3))]],
                               atol=1e-6)


def test_entropy_hand_values():
    # uniform over 4 -> log 4; one-hot-ish [1e4, -1e4] -> 0; (1/4, 3/4) -> 0.562335
    np.testing.assert_allclose(float(entropy_from_logits(jnp.zeros(4))), math.log(4), atol=1e-6)
    np.testing.assert_allclose(float(entropy_from_logits(jnp.array([1e4, -1e4]))), 0.0,
                               atol=1e-6)
    np.testing.assert_allclose(float(entropy_from_logits(jnp.array([0.0, math.log(3.0)]))),
                               -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), atol=1e-6)


# ----------------------------------------------------------------------------- vs reference


@FAST
@given(seed=seeds, temperature=st.sampled_from(TEMPS))
def test_token_logprobs_matches_numpy_log_softmax_gather(seed, temperature):
    logits, tokens = _inputs(seed)
    out = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature)
    assert out.shape == (B, T) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref.token_logprobs(logits, tokens, temperature),
                               rtol=1e-5, atol=1e-5)


def test_token_logprobs_bfloat16_logits_give_float32():
    logits, tokens = _inputs(0)
    bf = jnp.asarray(logits, jnp.bfloat16)
    out = token_logprobs(bf, jnp.asarray(tokens))
    assert out.dtype == jnp.float32
    expected = ref.token_logprobs(np.asarray(bf.astype(jnp.float32)), tokens)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-2, atol=1e-2)


_chunked = jax.jit(token_logprobs_chunked, static_argnames=("temperature", "chunk_size"))
_from_hidden = jax.jit(token_logprobs_from_hidden,
                       static_argnames=("temperature", "chunk_size", "return_entropy"))


@FAST
@given(seed=seeds, chunk_size=st.sampled_from([1, 4, 5, 6, 8]))
def test_chunked_equals_unchunked(seed, chunk_size):
    """Chunk sizes that do not divide T = 6 (4, 5) and exceed it (8) included."""
    logits, tokens = _inputs(seed)
    full = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature=0.7)
    chunked = _chunked(jnp.asarray(logits), jnp.asarray(tokens), temperature=0.7,
                       chunk_size=chunk_size)
    assert chunked.shape == (B, T) and chunked.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked), ref.token_logprobs(logits, tokens, 0.7),
                               rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames="chunk_size")
def _weighted_logp_grad(logits, tokens, w, chunk_size):
    return jax.grad(lambda x: jnp.sum(w * token_logprobs_chunked(x, tokens,
                                                                 chunk_size=chunk_size)))(logits)


@FEW
@given(seed=seeds, chunk_size=st.sampled_from([4, 6]))
def test_chunked_gradient_is_onehot_minus_softmax(seed, chunk_size):
    """d sum_t w_t logp_t / d logits_t = w_t (onehot(token_t) - softmax(logits_t))."""
    logits, tokens = _inputs(seed)
    w = rng(seed + 1).normal(size=(B, T)).astype(np.float32)
    grad = np.asarray(_weighted_logp_grad(jnp.asarray(logits), jnp.asarray(tokens),
                                          jnp.asarray(w), chunk_size))
    p = np.exp(ref.log_softmax(logits))
    expected = w[..., None] * (np.eye(V)[tokens] - p)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)


@FEW
@given(seed=seeds, config=st.sampled_from([(4, 0.7), (6, 1.0)]))
def test_from_hidden_equals_logprobs_of_product(seed, config):
    chunk_size, temperature = config
    g = rng(seed)
    hidden = g.normal(size=(B, T, D)).astype(np.float32)
    unembed = g.normal(size=(D, V)).astype(np.float32)
    tokens = g.integers(0, V, size=(B, T)).astype(np.int32)
    logits = hidden.astype(np.float64) @ unembed.astype(np.float64)
    logp, ent = _from_hidden(jnp.asarray(hidden), jnp.asarray(unembed), jnp.asarray(tokens),
                             temperature=temperature, chunk_size=chunk_size, return_entropy=True)
    assert logp.shape == ent.shape == (B, T)
    np.testing.assert_allclose(np.asarray(logp), ref.token_logprobs(logits, tokens, temperature),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ent), ref.entropy_from_logits(logits, temperature),
                               rtol=1e-4, atol=1e-4)


def test_from_hidden_without_entropy_returns_logp_only():
    g = rng(1)
    hidden = jnp.asarray(g.normal(size=(B, T, D)).astype(np.float32))
    unembed = jnp.asarray(g.normal(size=(D, V)).astype(np.float32))
    tokens = jnp.asarray(g.integers(0, V, size=(B, T)).astype(np.int32))
    logp = _from_hidden(hidden, unembed, tokens, chunk_size=4)
    assert logp.shape == (B, T) and logp.dtype == jnp.float32
    expected = ref.token_logprobs(np.asarray(hidden, np.float64) @ np.asarray(unembed), tokens)
    np.testing.assert_allclose(np.asarray(logp), expected, rtol=1e-4, atol=1e-4)


def test_from_hidden_gradient_matches_hand_derivation():
    """d sum logp / d hidden = (onehot - p) @ unembed^T; d / d unembed = hidden^T (onehot - p)."""
    g = rng(3)
    hidden = g.normal(size=(B, T, D)).astype(np.float32)
    unembed = g.normal(size=(D, V)).astype(np.float32)
    tokens = g.integers(0, V, size=(B, T)).astype(np.int32)

    def f(h, u):
        return jnp.sum(token_logprobs_from_hidden(h, u, jnp.asarray(tokens), chunk_size=4))

    gh, gu = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(hidden), jnp.asarray(unembed))
    delta = np.eye(V)[tokens] - np.exp(ref.log_softmax(hidden.astype(np.float64) @ unembed))
    np.testing.assert_allclose(np.asarray(gh), delta @ unembed.T, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gu), np.einsum("btd,btv->dv", hidden, delta),
                               rtol=1e-3, atol=1e-3)


@FAST
@given(seed=seeds, temperature=st.sampled_from(TEMPS))
def test_entropy_matches_reference(seed, temperature):
    logits, _ = _inputs(seed)
    out = entropy_from_logits(jnp.asarray(logits), temperature=temperature)
    assert out.shape == (B, T)
    np.testing.assert_allclose(np.asarray(out), ref.entropy_from_logits(logits, temperature),
                               rtol=1e-4, atol=1e-5)


@FAST
@given(seed=seeds, shift=st.floats(-1e3, 1e3))
def test_entropy_and_logprobs_are_shift_invariant(seed, shift):
    logits, tokens = _inputs(seed)
    shifted = (logits + np.float32(shift)).astype(np.float32)  # exact inputs of the oracle
    np.testing.assert_allclose(np.asarray(entropy_from_logits(jnp.asarray(shifted))),
                               ref.entropy_from_logits(shifted), atol=1e-3)
    np.testing.assert_allclose(np.asarray(token_logprobs(jnp.asarray(shifted),
                                                         jnp.asarray(tokens))),
                               ref.token_logprobs(shifted, tokens), atol=1e-3)


@pytest.mark.parametrize("shift", [-1e4, 1e4])
def test_entropy_shift_invariant_for_logits_around_1e4(shift):
    logits, tokens = _inputs(0)
    shifted = (logits + np.float32(shift)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(entropy_from_logits(jnp.asarray(shifted))),
                               ref.entropy_from_logits(shifted), atol=1e-3)
    np.testing.assert_allclose(np.asarray(token_logprobs(jnp.asarray(shifted),
                                                         jnp.asarray(tokens))),
                               ref.token_logprobs(shifted, tokens), atol=1e-3)


# ----------------------------------------------------------------------------- extremes


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_extreme_logits_are_finite(temperature):
    g = rng(5)
    logits = np.where(g.random((B, T, V)) < 0.5, 1e4, -1e4).astype(np.float32)
    tokens = g.integers(0, V, size=(B, T)).astype(np.int32)
    ent = entropy_from_logits(jnp.asarray(logits), temperature=temperature)
    assert_finite(ent)
    np.testing.assert_allclose(np.asarray(ent), ref.entropy_from_logits(logits, temperature),
                               atol=1e-3)
    out = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens),
                                    temperature=temperature))
    assert_finite(out)
    np.testing.assert_allclose(out, ref.token_logprobs(logits, tokens, temperature),
                               rtol=1e-5, atol=1e-3)
    chunked = _chunked(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature,
                       chunk_size=4)
    np.testing.assert_allclose(np.asarray(chunked), out, rtol=1e-5, atol=1e-3)
    grad = jax.grad(lambda x: jnp.sum(entropy_from_logits(x)))(jnp.asarray(logits))
    assert_finite(grad)


# ----------------------------------------------------------------------------- jit / vmap


def test_logprobs_under_jit_and_vmap():
    g = rng(11)
    logits = g.normal(size=(2, B, T, V)).astype(np.float32)
    tokens = g.integers(0, V, size=(2, B, T)).astype(np.int32)
    hidden = g.normal(size=(2, B, T, D)).astype(np.float32)
    unembed = g.normal(size=(D, V)).astype(np.float32)
    fns = {
        "token_logprobs": (functools.partial(token_logprobs, temperature=0.7), (logits, tokens)),
        "chunked": (functools.partial(token_logprobs_chunked, temperature=0.7, chunk_size=4),
                    (logits, tokens)),
        "entropy": (entropy_from_logits, (logits,)),
        "hidden": (lambda h, t: token_logprobs_from_hidden(h, jnp.asarray(unembed), t,
                                                           chunk_size=4), (hidden, tokens)),
    }
    for name, (fn, args) in fns.items():
        batched = np.asarray(jax.jit(jax.vmap(fn))(*map(jnp.asarray, args)))
        jitted = jax.jit(fn)
        rows = np.stack([np.asarray(jitted(*(jnp.asarray(a[i]) for a in args)))
                         for i in range(2)])
        np.testing.assert_allclose(batched, rows, rtol=1e-5, atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------- large logits


def test_token_logprobs_at_large_logits_hand_values():
    # logits 1e4 + (0, 1, 2) are exact in float32; log softmax = (0, 1, 2) - log(1 + e + e^2).
    # z_tok - logsumexp(z) without the max subtracted rounds logZ = 10002.4076 to float32's
    # 2^-10 grid and returns -2.40723 for token 0.
    logits = jnp.array([[[1e4, 1e4 + 1.0, 1e4 + 2.0]] * 3], jnp.float32)
    out = token_logprobs(logits, jnp.array([[0, 1, 2]]))
    log_z = math.log(1.0 + math.e + math.e ** 2)
    np.testing.assert_allclose(np.asarray(out), [[-log_z, 1.0 - log_z, 2.0 - log_z]], atol=2e-6)


@FAST
@given(seed=seeds, base=st.floats(1e3, 5e4), sign=st.sampled_from([1.0, -1.0]),
       temperature=st.sampled_from([1.0, 2.0, 0.5]))
def test_token_logprobs_at_large_logits_match_float64(seed, base, sign, temperature):
    """|z| ~ 1e3-5e4 in float32: exact log-softmax of the float32 inputs (float64 reference), equal
    to the chunked path. Temperatures that are powers of 2 divide float32 values exactly."""
    logits, tokens = _inputs(seed, scale=3.0)
    logits = (logits + np.float32(sign * base)).astype(np.float32)
    out = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature))
    expected = ref.token_logprobs(logits, tokens, temperature)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)
    chunked = _chunked(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature, chunk_size=4)
    np.testing.assert_allclose(out, np.asarray(chunked), rtol=0, atol=2e-5)
