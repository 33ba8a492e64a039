"""Tests of kl_penalty (k1, k2/mse, k3, abs): values, Monte-Carlo unbiasedness, extremes."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import KL_KINDS, kl_penalty
from tests.core import reference as ref
from tests.core._helpers import B, FAST, T, assert_finite, logps, rng, seeds

KINDS = ["k1", "k2", "k3", "abs", "mse"]


def test_kinds_are_listed():
    assert set(KINDS) <= set(KL_KINDS)


def test_hand_values():
    # pi = 0.5, pi_ref = 0.25: log-ratio log 2 = 0.693147
    #   k1 = 0.693147, k2 = 0.5 * 0.480453 = 0.240227, abs = 0.693147
    #   k3 = pi_ref/pi - log(pi_ref/pi) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref_logp = jnp.array([math.log(0.5)]), jnp.array([math.log(0.25)])
    expected = {"k1": 0.693147, "k2": 0.240227, "mse": 0.240227, "k3": 0.193147, "abs": 0.693147}
    for kind, value in expected.items():
        np.testing.assert_allclose(float(kl_penalty(logp, ref_logp, kind)[0]), value, rtol=1e-5,
                                   err_msg=kind)
    # the other direction: k1 = -0.693147, abs = 0.693147, k3 = 2 - 0.693147 - 1 = 0.306853
    np.testing.assert_allclose(float(kl_penalty(ref_logp, logp, "k1")[0]), -0.693147, rtol=1e-5)
    np.testing.assert_allclose(float(kl_penalty(ref_logp, logp, "abs")[0]), 0.693147, rtol=1e-5)
    np.testing.assert_allclose(float(kl_penalty(ref_logp, logp, "k3")[0]), 0.306853, rtol=1e-5)


@FAST
@given(seed=seeds, kind=st.sampled_from(KINDS), clamp=st.sampled_from([None, 0.05, 10.0]))
def test_matches_reference(seed, kind, clamp):
    logp, ref_logp = logps(rng(seed), spread=0.5)
    out = kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp), kind, clamp=clamp)
    assert out.shape == (B, T)
    np.testing.assert_allclose(np.asarray(out), ref.kl_penalty(logp, ref_logp, kind, clamp=clamp),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_when_policies_agree(kind):
    logp, _ = logps(rng(0))
    np.testing.assert_allclose(np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(logp), kind)),
                               0.0, atol=1e-7)


@FAST
@given(seed=seeds)
def test_k2_k3_abs_are_non_negative(seed):
    logp, ref_logp = logps(rng(seed), spread=3.0)
    for kind in ["k2", "k3", "abs"]:
        assert np.all(np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp), kind)) >= 0)


def test_k1_k3_gradients():
    """d k1 / d logp = 1 ; d k3 / d logp = 1 - pi_ref / pi (hand derivation)."""
    logp, ref_logp = logps(rng(1), spread=0.5)
    g1 = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref_logp), "k1")))(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g1), 1.0, rtol=1e-6)
    g3 = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref_logp), "k3")))(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g3), 1.0 - np.exp(ref_logp.astype(np.float64) - logp),
                               rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- Monte Carlo


@pytest.mark.parametrize("kind", ["k1", "k3"])
@pytest.mark.parametrize("case", range(3))
def test_monte_carlo_estimate_converges_to_exact_kl(kind, case):
    """E_{x~pi}[k1] = E_{x~pi}[k3] = KL(pi || pi_ref) (Schulman's estimators are unbiased)."""
    g = np.random.default_rng(1234 + case)
    V = 6
    p = g.dirichlet(np.ones(V))
    q = g.dirichlet(np.ones(V))
    exact = ref.exact_kl(p, q)
    x = g.choice(V, size=(200, 1000), p=p)
    logp = np.log(p)[x].astype(np.float32)
    ref_logp = np.log(q)[x].astype(np.float32)
    est = np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp), kind), np.float64)
    stderr = est.std() / math.sqrt(est.size)
    tolerance = 4.0 * stderr
    assert tolerance < 0.1 * exact  # the test can fail: the tolerance is tight
    assert abs(est.mean() - exact) < tolerance, (est.mean(), exact, tolerance)


# ----------------------------------------------------------------------------- extremes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spread", [60.0, 1e4])
def test_extreme_log_ratios_are_finite(kind, spread):
    logp, ref_logp = logps(rng(3), spread=spread)
    fn = functools.partial(kl_penalty, kind=kind)
    out = fn(jnp.asarray(logp), jnp.asarray(ref_logp))
    assert_finite(out)
    grad = jax.grad(lambda x: jnp.sum(fn(x, jnp.asarray(ref_logp))))(jnp.asarray(logp))
    assert_finite(grad)
    if kind == "k3":
        clamped = kl_penalty(jnp.asarray(logp), jnp.asarray(ref_logp), "k3", clamp=10.0)
        assert np.all(np.asarray(clamped) <= 10.0) and np.all(np.asarray(clamped) >= -10.0)


def test_k3_log_ratio_is_clamped_at_20():
    # ref - logp = 50 -> clamped to 20: exp(20) - 20 - 1
    out = kl_penalty(jnp.array([-60.0]), jnp.array([-10.0]), "k3")
    np.testing.assert_allclose(float(out[0]), math.exp(20.0) - 21.0, rtol=1e-5)


# ----------------------------------------------------------------------------- vmap / jit


@pytest.mark.parametrize("kind", KINDS)
def test_under_jit_and_vmap(kind):
    g = rng(5)
    a, b = (jnp.asarray(x) for x in zip(*[logps(g) for _ in range(3)]))
    a, b = jnp.stack(a), jnp.stack(b)
    fn = functools.partial(kl_penalty, kind=kind, clamp=10.0)
    out = jax.jit(jax.vmap(fn))(a, b)
    np.testing.assert_allclose(np.asarray(out[2]), np.asarray(fn(a[2], b[2])), rtol=1e-6)
