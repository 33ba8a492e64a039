"""Tests of clipped_surrogate (PPO / Clip-Higher / dual clip / GSPO) and truncated_is_weights."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import SurrogateStats, clipped_surrogate, truncated_is_weights
from tests.core import reference as ref
from tests.core._helpers import B, FAST, T, assert_finite, logps, mask, rng, seeds

STAT_NAMES = ["clip_frac_low", "clip_frac_high", "clip_frac", "dual_clip_frac", "ratio_mean",
              "ratio_min", "ratio_max", "approx_kl", "num_tokens"]
# One asymmetric clip range (Clip-Higher style, eps_low != eps_high) for the property tests: it
# tells the two sides apart, and every extra static value is one more XLA compile.
EPS = st.just((0.1, 0.28))
DUAL = st.sampled_from([None, 3.0])


@functools.partial(jax.jit, static_argnames=("eps_low", "eps_high", "dual_clip", "ratio_level"))
def _surrogate_and_grad(logp, old_logp, adv, m, eps_low=0.2, eps_high=0.2, dual_clip=None,
                        ratio_level="token"):
    """(loss, stats, d sum(loss * mask) / d logp): one compile serves value and gradient tests."""
    def total(x):
        loss, stats = clipped_surrogate(x, old_logp, adv, m, eps_low=eps_low, eps_high=eps_high,
                                        dual_clip=dual_clip, ratio_level=ratio_level)
        return jnp.sum(loss * m), (loss, stats)

    grad, (loss, stats) = jax.grad(total, has_aux=True)(logp)
    return loss, stats, grad


def _full(kw):
    """All four static options spelled out, so equal configurations share one cache entry."""
    return {"eps_low": 0.1, "eps_high": 0.28, "dual_clip": None, "ratio_level": "token", **kw}


def _surrogate(*args, **kw):
    return _surrogate_and_grad(*args, **_full(kw))[:2]


def _surrogate_grad(*args, **kw):
    return _surrogate_and_grad(*args, **_full(kw))[2]


def _call(logp, old, adv, m, **kw):
    loss, stats = _surrogate(*map(jnp.asarray, (logp, old, adv, m)), **kw)
    return np.asarray(loss), stats


def _inputs(seed, per_token_adv=False, spread=0.3):
    g = rng(seed)
    logp, old = logps(g, spread=spread)
    shape = (B, T) if per_token_adv else (B,)
    adv = g.normal(size=shape).astype(np.float32)
    return logp, old, adv, mask(g)


# ----------------------------------------------------------------------------- hand values


def test_hand_values():
    #            r = 1, A = 2 -> -2 ; r = 1.5, A = 1 -> max(-1.5, -1.2) = -1.2
    #            r = 0.5, A = -1 -> max(0.5, 0.8) = 0.8 ; r = 5, A = -1 -> max(5, 0.8) = 5
    #            r = 0.5, A = 1 -> max(-0.5, -0.8) = -0.5 (no clip on the pessimistic side)
    r = np.array([[1.0, 1.5, 0.5, 5.0, 0.5]])
    adv = np.array([[2.0, 1.0, -1.0, -1.0, 1.0]], np.float32)
    old = np.full((1, 5), -1.0, np.float32)
    logp = (old + np.log(r)).astype(np.float32)
    m = np.ones((1, 5), np.float32)
    loss, stats = _call(logp, old, adv, m, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(loss, [[-2.0, -1.2, 0.8, 5.0, -0.5]], rtol=1e-5)
    # clipped: token 1 (high), token 2 (low) -> 1/5 each
    np.testing.assert_allclose(float(stats.clip_frac_high), 0.2, atol=1e-6)
    np.testing.assert_allclose(float(stats.clip_frac_low), 0.2, atol=1e-6)
    np.testing.assert_allclose(float(stats.clip_frac), 0.4, atol=1e-6)
    np.testing.assert_allclose(float(stats.ratio_min), 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(stats.ratio_max), 5.0, rtol=1e-5)
    np.testing.assert_allclose(float(stats.ratio_mean), 8.5 / 5, rtol=1e-5)
    np.testing.assert_allclose(float(stats.approx_kl), -np.log(r).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(stats.num_tokens), 5.0)
    # dual clip c = 3: the r = 5, A = -1 token is bounded by 3 |A| = 3
    loss, stats = _call(logp, old, adv, m, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    np.testing.assert_allclose(loss, [[-2.0, -1.2, 0.8, 3.0, -0.5]], rtol=1e-5)
    np.testing.assert_allclose(float(stats.dual_clip_frac), 0.2, atol=1e-6)
    # Clip-Higher eps_high = 0.6: r = 1.5 is no longer clipped
    loss, stats = _call(logp, old, adv, m, eps_low=0.2, eps_high=0.6)
    np.testing.assert_allclose(loss[0, 1], -1.5, rtol=1e-5)
    np.testing.assert_allclose(float(stats.clip_frac_high), 0.0)


def test_stats_is_a_named_tuple_with_the_documented_fields():
    _, stats = _call(*_inputs(0))
    assert isinstance(stats, SurrogateStats)
    for name in STAT_NAMES:
        assert np.shape(getattr(stats, name)) == ()


# ----------------------------------------------------------------------------- vs reference


@FAST
@given(seed=seeds, eps=EPS, dual=DUAL, per_token_adv=st.booleans(),
       ratio_level=st.sampled_from(["token", "sequence"]))
def test_matches_reference(seed, eps, dual, per_token_adv, ratio_level):
    if ratio_level == "sequence":
        per_token_adv = False
    logp, old, adv, m = _inputs(seed, per_token_adv, spread=0.5)
    kw = dict(eps_low=eps[0], eps_high=eps[1], dual_clip=dual, ratio_level=ratio_level)
    loss, stats = _call(logp, old, adv, m, **kw)
    exp_loss, exp_stats = ref.clipped_surrogate(logp, old, adv, m, **kw)
    np.testing.assert_allclose(loss, exp_loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(loss[m == 0], 0.0)
    for name in STAT_NAMES:
        if name == "dual_clip_frac" and dual is None:
            continue
        np.testing.assert_allclose(float(getattr(stats, name)), exp_stats[name], rtol=1e-4,
                                   atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------- gradients


@FAST
@given(seed=seeds, eps=EPS, dual=DUAL, per_token_adv=st.booleans())
def test_on_policy_gradient_is_reinforce(seed, eps, dual, per_token_adv):
    """logp == old_logp: r = 1, nothing clips, d loss / d logp = -A * mask."""
    logp, _, adv, m = _inputs(seed, per_token_adv)
    grad = np.asarray(_surrogate_grad(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(adv),
                                      jnp.asarray(m), eps_low=eps[0], eps_high=eps[1],
                                      dual_clip=dual))
    a = adv if per_token_adv else np.repeat(adv[:, None], T, axis=1)
    np.testing.assert_allclose(grad, -a * m, rtol=1e-5, atol=1e-6)


def _away_from_kinks(r, eps, dual, tol=1e-3):
    far = (np.abs(r - (1 - eps[0])) > tol) & (np.abs(r - (1 + eps[1])) > tol)
    if dual is not None:
        far &= np.abs(r - dual) > tol
    return far


@FAST
@given(seed=seeds, eps=EPS, dual=DUAL, per_token_adv=st.booleans(),
       ratio_level=st.sampled_from(["token", "sequence"]))
def test_gradient_is_zero_exactly_where_the_clip_binds(seed, eps, dual, per_token_adv,
                                                       ratio_level):
    if ratio_level == "sequence":
        per_token_adv = False
    logp, old, adv, m = _inputs(seed, per_token_adv, spread=0.6)
    kw = dict(eps_low=eps[0], eps_high=eps[1], dual_clip=dual, ratio_level=ratio_level)
    grad = np.asarray(_surrogate_grad(*map(jnp.asarray, (logp, old, adv, m)), **kw))
    expected = ref.surrogate_grad(logp, old, adv, m, **kw)
    r = ref.ratio(logp, old, m, ratio_level)
    far = _away_from_kinks(r, eps, dual)
    np.testing.assert_allclose(grad[far], expected[far], rtol=1e-4, atol=1e-6)
    a = adv if per_token_adv else np.repeat(adv[:, None], T, axis=1)
    binds = far & (((a > 0) & (r > 1 + eps[1])) | ((a < 0) & (r < 1 - eps[0])))
    np.testing.assert_array_equal(grad[binds], 0.0)
    assert np.all(grad[far & ~binds & (m > 0) & (a != 0) & (r < (dual or np.inf))] != 0.0)


# ----------------------------------------------------------------------------- dual clip


@FAST
@given(seed=seeds, c=st.sampled_from([1.5, 3.0]), spread=st.sampled_from([1.0, 5.0, 60.0]))
def test_dual_clip_bounds_the_loss_by_c_abs_a(seed, c, spread):
    logp, old, adv, m = _inputs(seed, spread=spread)
    loss, stats = _call(logp, old, adv, m, dual_clip=c)
    a = np.repeat(adv[:, None], T, axis=1)
    neg = (a < 0) & (m > 0)
    assert np.all(loss[neg] <= c * np.abs(a[neg]) * (1 + 1e-5) + 1e-6)
    assert_finite(loss)
    r = ref.ratio(logp, old)
    frac = ((a < 0) & (r > c) & (m > 0)).sum() / max(m.sum(), 1)
    np.testing.assert_allclose(float(stats.dual_clip_frac), frac, atol=1e-6)


# ----------------------------------------------------------------------------- GSPO


@FAST
@given(seed=seeds)
def test_sequence_ratio_is_exp_of_masked_mean_log_ratio(seed):
    """With A = -1 and clip range wide open, loss = s_i on every counted token of row i."""
    logp, old, _, m = _inputs(seed, spread=0.5)
    adv = -np.ones(B, np.float32)
    loss, stats = _call(logp, old, adv, m, eps_low=100.0, eps_high=100.0,
                        ratio_level="sequence")
    for b in range(B):
        n = m[b].sum()
        if n == 0:
            np.testing.assert_array_equal(loss[b], 0.0)
            continue
        s = math.exp(((logp[b].astype(np.float64) - old[b]) * m[b]).sum() / n)
        np.testing.assert_allclose(loss[b][m[b] > 0], s, rtol=1e-5)
    if m.sum() > 0:
        np.testing.assert_allclose(float(stats.ratio_mean), (loss * m).sum() / m.sum(),
                                   rtol=1e-5)


def test_sequence_ratio_hand_values():
    # row log-ratios (0.2, -0.1, [masked 5.0]) -> mean 0.05 -> s = exp(0.05) = 1.051271
    old = np.zeros((1, 3), np.float32)
    logp = np.array([[0.2, -0.1, 5.0]], np.float32)
    m = np.array([[1.0, 1.0, 0.0]], np.float32)
    loss, _ = _call(logp, old, np.array([-1.0], np.float32), m, ratio_level="sequence")
    np.testing.assert_allclose(loss, [[1.051271, 1.051271, 0.0]], rtol=1e-5)
    # A = +1: s < 1.2 is not clipped: -s
    loss, _ = _call(logp, old, np.array([1.0], np.float32), m, ratio_level="sequence")
    np.testing.assert_allclose(loss, [[-1.051271, -1.051271, 0.0]], rtol=1e-5)


# ----------------------------------------------------------------------------- degenerate input


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("spread", [60.0, 1e4])
def test_extreme_log_ratios_are_finite(ratio_level, dual, spread):
    """|logp - old_logp| > 50 (the log-ratio is clamped to +-20 before exp)."""
    logp, old, adv, m = _inputs(7, spread=spread)
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))
    kw = dict(eps_low=0.1, eps_high=0.28, dual_clip=dual, ratio_level=ratio_level)
    loss, stats = _surrogate(*args, **kw)
    assert_finite(loss, *stats)
    assert_finite(_surrogate_grad(*args, **kw))


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_all_masked_batch(ratio_level):
    logp, old, adv, _ = _inputs(1)
    loss, stats = _call(logp, old, adv, np.zeros((B, T), np.float32), ratio_level=ratio_level,
                        dual_clip=3.0)
    np.testing.assert_array_equal(loss, 0.0)
    assert_finite(*stats)
    for name in ["ratio_mean", "ratio_min", "ratio_max"]:
        assert float(getattr(stats, name)) == 1.0, name
    for name in ["clip_frac_low", "clip_frac_high", "clip_frac", "dual_clip_frac", "num_tokens"]:
        assert float(getattr(stats, name)) == 0.0, name
    grad = _surrogate_grad(*map(jnp.asarray, (logp, old, adv, np.zeros((B, T), np.float32))),
                           ratio_level=ratio_level, dual_clip=3.0)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_garbage_in_masked_positions_changes_nothing(ratio_level):
    logp, old, adv, m = _inputs(2)
    g = rng(9)
    logp2 = np.where(m > 0, logp, g.uniform(-1e4, 1e4, size=(B, T))).astype(np.float32)
    old2 = np.where(m > 0, old, g.uniform(-1e4, 1e4, size=(B, T))).astype(np.float32)
    a, sa = _call(logp, old, adv, m, ratio_level=ratio_level)
    b, sb = _call(logp2, old2, adv, m, ratio_level=ratio_level)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for name in STAT_NAMES:
        np.testing.assert_allclose(float(getattr(sa, name)), float(getattr(sb, name)),
                                   rtol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- TIS


def test_truncated_is_weights_hand_values():
    # exp(log 1.5) = 1.5 (kept), exp(log 3) = 3 -> cap 2, exp(-1000) -> 0, exp(1000) -> cap
    trainer = jnp.array([[math.log(1.5), math.log(3.0), -1000.0, 1000.0]])
    out = np.asarray(truncated_is_weights(trainer, jnp.zeros((1, 4)), cap=2.0))
    np.testing.assert_allclose(out, [[1.5, 2.0, 0.0, 2.0]], rtol=1e-6, atol=1e-30)


@FAST
@given(seed=seeds, cap=st.sampled_from([1.0, 2.0, 5.0]))
def test_truncated_is_weights_match_reference_and_have_no_gradient(seed, cap):
    trainer, sampler = logps(rng(seed), spread=1.0)
    out = truncated_is_weights(jnp.asarray(trainer), jnp.asarray(sampler), cap=cap)
    np.testing.assert_allclose(np.asarray(out), ref.truncated_is_weights(trainer, sampler, cap),
                               rtol=1e-5)
    gt, gs = jax.grad(lambda a, b: jnp.sum(truncated_is_weights(a, b, cap=cap)),
                      argnums=(0, 1))(jnp.asarray(trainer), jnp.asarray(sampler))
    np.testing.assert_array_equal(np.asarray(gt), 0.0)
    np.testing.assert_array_equal(np.asarray(gs), 0.0)


# ----------------------------------------------------------------------------- jit / vmap


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_surrogate_under_vmap(ratio_level):
    xs = [_inputs(s) for s in range(3)]
    logp, old, adv, m = (jnp.asarray(np.stack(a)) for a in zip(*xs))
    fn = functools.partial(clipped_surrogate, eps_low=0.1, eps_high=0.28, dual_clip=3.0,
                           ratio_level=ratio_level)
    loss, stats = jax.jit(jax.vmap(fn))(logp, old, adv, m)
    for i in range(3):
        li, si = _surrogate(logp[i], old[i], adv[i], m[i], eps_low=0.1, eps_high=0.28,
                            dual_clip=3.0, ratio_level=ratio_level)
        np.testing.assert_allclose(np.asarray(loss[i]), np.asarray(li), rtol=1e-6)
        for name in STAT_NAMES:
            np.testing.assert_allclose(float(getattr(stats, name)[i]), float(getattr(si, name)),
                                       rtol=1e-6, err_msg=name)
    w = jax.jit(jax.vmap(functools.partial(truncated_is_weights, cap=2.0)))(logp, old)
    np.testing.assert_allclose(np.asarray(w[1]),
                               np.asarray(truncated_is_weights(logp[1], old[1], cap=2.0)))
