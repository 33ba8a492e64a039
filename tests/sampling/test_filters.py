"""Sampling filters: top-k / top-p sets, the two-level top-k and inverse-CDF sampler, log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from jaxrl4llm.sampling.filters import (allowed_tokens, first_argmax, min_p_keep, nucleus_keep, sample_tokens,
                                        top_k_logits, top_p_keep)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed counts vs probabilities (rare categories pooled)."""
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    expected = probs * counts.sum()
    order = np.argsort(expected)
    pooled_obs, pooled_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o += counts[i]
        acc_e += expected[i]
        if acc_e >= min_expected:
            pooled_obs.append(acc_o)
            pooled_exp.append(acc_e)
            acc_o = acc_e = 0.0
    pooled_obs[-1] += acc_o
    pooled_exp[-1] += acc_e
    obs, exp = np.array(pooled_obs), np.array(pooled_exp)
    return float(stats.chi2.sf(np.sum((obs - exp) ** 2 / exp), df=len(obs) - 1))


def test_top_p_keep_hand_example():
    # p = [0.5, 0.3, 0.15, 0.05]: mass before = [0, 0.5, 0.8, 0.95]
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(top_p_keep(logits, 0.5), [[True, False, False, False]])
    np.testing.assert_array_equal(top_p_keep(logits, 0.75), [[True, True, False, False]])
    np.testing.assert_array_equal(top_p_keep(logits, 0.81), [[True, True, True, False]])
    np.testing.assert_array_equal(top_p_keep(logits, 1.0), [[True, True, True, True]])


def test_two_level_top_k_equals_lax_top_k():
    """Also on ties (logits on a coarse grid, as bf16 logits often are): the lower index first."""
    z = jax.random.normal(jax.random.key(0), (5, 3001)) * 3.0
    for logits in (z, jnp.round(z * 2) / 2):
        values, ids = jax.jit(top_k_logits, static_argnums=1)(logits, 20)
        expected_values, expected_ids = jax.lax.top_k(logits, 20)
        np.testing.assert_array_equal(values, expected_values)
        np.testing.assert_array_equal(ids, expected_ids)


def test_first_argmax_takes_lowest_index_on_ties():
    z = jnp.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    np.testing.assert_array_equal(first_argmax(z), [1, 0])


def test_nucleus_keep_equals_sorted_top_p_keep():
    z = jax.random.normal(jax.random.key(8), (30, 64)) * 2.0
    z = z.at[:, ::5].set(-jnp.inf)
    sorted_z = -jnp.sort(-z, axis=-1)
    for top_p in (0.3, 0.8, 0.99, 1.0):
        expected = top_p_keep(sorted_z, top_p) & (sorted_z > -jnp.inf)
        np.testing.assert_array_equal(jnp.sum(nucleus_keep(z, top_p), -1), jnp.sum(expected, -1))


def test_plain_sampling_matches_softmax_and_skips_zero_probability():
    vocab = 300
    z = jax.random.normal(jax.random.key(1), (vocab,)) * 1.5
    z = z.at[::7].set(-jnp.inf)  # impossible tokens
    draws = jax.jit(sample_tokens)(jnp.broadcast_to(z, (20000, vocab)), jax.random.key(2)).tokens
    counts = np.bincount(np.asarray(draws), minlength=vocab)
    assert counts[::7].sum() == 0
    assert chi_square_pvalue(counts, np.asarray(jax.nn.softmax(z))) > 1e-3


@pytest.mark.parametrize("top_k,top_p,vocab", [(5, 1.0, 500), (0, 0.7, 500), (12, 0.5, 500), (40, 0.9, 500),
                                               (0, 0.8, 100), (100, 0.99, 100)])
def test_sample_tokens_never_leaves_the_top_k_top_p_set(top_k, top_p, vocab):
    z = jax.random.normal(jax.random.key(3), (2000, vocab)) * 2.0
    temperature = 0.8
    out = jax.jit(sample_tokens, static_argnames=("top_k", "use_top_p"))(
        z, jax.random.key(4), temperature=temperature, top_k=top_k, top_p=top_p, use_top_p=top_p < 1.0)
    allowed = np.asarray(jax.jit(allowed_tokens, static_argnames="top_k")(
        z, temperature=temperature, top_k=top_k, top_p=top_p))
    tokens = np.asarray(out.tokens)
    assert np.all(allowed[np.arange(len(tokens)), tokens])
    # log-prob of the draw under the renormalised truncated distribution, and the untruncated one
    zt = np.asarray(z, np.float64) / temperature
    lse_all = np.log(np.exp(zt).sum(-1))
    lse_kept = np.log(np.where(allowed, np.exp(zt), 0.0).sum(-1))
    picked = zt[np.arange(len(tokens)), tokens]
    np.testing.assert_allclose(out.logprob, picked - lse_kept, atol=1e-4)
    np.testing.assert_allclose(out.logprob_untruncated, picked - lse_all, atol=1e-4)


def test_top_k_frequencies_match_the_renormalised_softmax():
    z = jax.random.normal(jax.random.key(5), (50,))
    out = jax.jit(sample_tokens, static_argnames="top_k")(jnp.broadcast_to(z, (20000, 50)), jax.random.key(6), top_k=10)
    counts = np.bincount(np.asarray(out.tokens), minlength=50)
    top = np.argsort(-np.asarray(z))[:10]
    assert counts.sum() == counts[top].sum()
    probs = np.asarray(jax.nn.softmax(z[top]))
    assert chi_square_pvalue(counts[top], probs) > 1e-3


def test_greedy_is_argmax_with_untruncated_logprob():
    z = jax.random.normal(jax.random.key(7), (6, 40))
    out = jax.jit(sample_tokens, static_argnames="greedy")(z, jax.random.key(0), temperature=0.5, greedy=True)
    np.testing.assert_array_equal(out.tokens, jnp.argmax(z, -1))
    np.testing.assert_allclose(out.logprob, jnp.max(jax.nn.log_softmax(z / 0.5), -1), atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(logits=hnp.arrays(np.float32, (3, 17), elements=st.floats(-30, 30, width=32)),
       min_p=st.floats(0.0, 1.0))
def test_min_p_keep_is_the_set_of_tokens_within_min_p_of_the_top(logits, min_p):
    """keep = {v : p_v >= min_p * max p} (float64 reference; entries within 1e-5 of the boundary
    skipped); min_p = 0 keeps everything; the argmax always survives."""
    keep = np.asarray(min_p_keep(jnp.asarray(logits), min_p))
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ratio = p / p.max(-1, keepdims=True)
    clear = np.abs(np.log(np.maximum(ratio, 1e-300)) - np.log(max(min_p, 1e-300))) > 1e-5
    np.testing.assert_array_equal(keep[clear], (ratio >= min_p)[clear])
    assert keep[np.arange(3), logits.argmax(-1)].all()
    assert np.asarray(min_p_keep(jnp.asarray(logits), 0.0)).all()


def test_min_p_keep_drops_masked_entries_and_hand_example():
    # p = [0.5, 0.3, 0.15, 0.05], min_p 0.4: threshold 0.2 -> keeps 0.5 and 0.3
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_array_equal(min_p_keep(logits, 0.4), [[True, True, False, False]])
    np.testing.assert_array_equal(min_p_keep(logits.at[0, 1].set(-jnp.inf), 0.0), [[True, False, True, True]])


@pytest.mark.parametrize("top_k,top_p,vocab", [(0, 1.0, 500), (40, 1.0, 500), (0, 0.9, 100), (40, 0.9, 500)])
def test_min_p_sampling_stays_in_its_set_with_renormalised_logprobs(top_k, top_p, vocab):
    """Every path (plain blocks, top-k, top-p pairwise, top-k + top-p): draws inside
    allowed_tokens(min_p=...) (min-p, then top-k, then top-p), log-probs over the kept set, the
    untruncated log-prob unchanged; min_p = 0.2 actually drops tokens."""
    z = jax.random.normal(jax.random.key(3), (2000, vocab)) * 2.0
    temperature, min_p = 0.8, 0.2
    out = jax.jit(sample_tokens, static_argnames=("top_k", "use_top_p"))(
        z, jax.random.key(4), temperature=temperature, top_k=top_k, top_p=top_p, use_top_p=top_p < 1.0, min_p=min_p)
    allowed = np.asarray(jax.jit(allowed_tokens, static_argnames="top_k")(
        z, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    without = np.asarray(allowed_tokens(z, temperature=temperature, top_k=top_k, top_p=top_p))
    assert allowed.sum() < without.sum()
    tokens = np.asarray(out.tokens)
    assert np.all(allowed[np.arange(len(tokens)), tokens])
    zt = np.asarray(z, np.float64) / temperature
    picked = zt[np.arange(len(tokens)), tokens]
    np.testing.assert_allclose(out.logprob, picked - np.log(np.where(allowed, np.exp(zt), 0.0).sum(-1)), atol=1e-4)
    np.testing.assert_allclose(out.logprob_untruncated, picked - np.log(np.exp(zt).sum(-1)), atol=1e-4)


def test_min_p_frequencies_match_the_renormalised_softmax():
    z = jax.random.normal(jax.random.key(5), (300,)) * 1.5
    out = jax.jit(sample_tokens)(jnp.broadcast_to(z, (20000, 300)), jax.random.key(6), min_p=0.1)
    counts = np.bincount(np.asarray(out.tokens), minlength=300)
    keep = np.asarray(min_p_keep(z, 0.1))
    assert counts[~keep].sum() == 0
    assert chi_square_pvalue(counts[keep], np.asarray(jax.nn.softmax(z[keep]))) > 1e-3


def test_min_p_zero_or_none_draws_what_no_min_p_draws():
    """min_p = 0 keeps the whole distribution: the same tokens and log-probs as min_p=None (off)."""
    z = jax.random.normal(jax.random.key(9), (64, 500)) * 2.0
    for top_k, top_p in ((0, 1.0), (20, 0.9)):
        run = jax.jit(sample_tokens, static_argnames=("top_k", "use_top_p"))
        kwargs = dict(top_k=top_k, top_p=top_p, use_top_p=top_p < 1.0)
        off, zero = run(z, jax.random.key(1), **kwargs), run(z, jax.random.key(1), min_p=0.0, **kwargs)
        np.testing.assert_array_equal(off.tokens, zero.tokens)
        np.testing.assert_allclose(off.logprob, zero.logprob, atol=1e-5)
