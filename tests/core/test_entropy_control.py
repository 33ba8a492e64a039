"""Tests of covariance-based entropy control (core.entropy_control: Clip-Cov, KL-Cov) and their
Recipe knobs in policy_loss."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given

from jaxrl4llm.core import (LITE_PPO, Recipe, clip_cov_mask, kl_cov_mask, policy_loss, token_covariance,
                            top_k_mask)
from jaxrl4llm.core.surrogate import clip_flags
from tests.core import reference as ref
from tests.core._helpers import B, FAST, FEW, T, assert_finite, logps, mask, rng, seeds

RATIO = 0.25  # exact in binary: k = max(1, floor(N / 4)) agrees between float32 and float64
LOW, HIGH = 0.02, 1.5
CLIP_COV = LITE_PPO.replace(name="clip_cov", cov_control="clip_cov", cov_ratio=RATIO, clip_cov_low=LOW,
                            clip_cov_high=HIGH)
KL_COV = LITE_PPO.replace(name="kl_cov", cov_control="kl_cov", cov_ratio=RATIO, kl_cov_coef=0.7)


def _inputs(seed, allow_empty=True):
    g = rng(seed)
    logp, old = logps(g, spread=0.4)
    adv = g.normal(size=B).astype(np.float32)
    return logp, old, adv, mask(g, allow_empty=allow_empty)


@jax.jit
def _cov(logp, adv, m):
    return token_covariance(logp, adv, m)


@jax.jit
def _kl_cov(logp, adv, m):
    return kl_cov_mask(logp, adv, m, ratio=RATIO)


@jax.jit
def _clip_cov(logp, adv, m, key, exclude):
    return clip_cov_mask(logp, adv, m, key, ratio=RATIO, low=LOW, high=HIGH, exclude=exclude)


def _no_near_ties(values, eps=1e-4):
    v = np.sort(np.asarray(values, np.float64).ravel())
    return v.size < 2 or np.min(np.diff(v)) > eps


# ----------------------------------------------------------------------------- covariance


@FAST
@given(seed=seeds)
def test_covariance_matches_reference_and_is_shift_invariant(seed):
    logp, _, adv, m = _inputs(seed)
    cov = np.asarray(_cov(*map(jnp.asarray, (logp, adv, m))))
    np.testing.assert_allclose(cov, ref.token_covariance(logp, adv, m), rtol=1e-4, atol=1e-5)
    assert not cov[m == 0].any()
    # centred on both factors: adding a constant to every log-prob or every advantage changes nothing
    shifted = np.asarray(_cov(jnp.asarray(logp - 0.75), jnp.asarray(adv + 2.0), jnp.asarray(m)))
    np.testing.assert_allclose(shifted, cov, rtol=1e-3, atol=1e-4)


def test_covariance_hand_values():
    logp = jnp.array([[-1.0, -3.0], [-2.0, -9.0]])
    adv = jnp.array([1.0, -1.0])
    m = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    # counted: logp (-1, -3, -2) mean -2; A (1, 1, -1) mean 1/3
    expected = np.array([[1 * (2 / 3), -1 * (2 / 3)], [0 * (-4 / 3), 0.0]])
    np.testing.assert_allclose(np.asarray(token_covariance(logp, adv, m)), expected, atol=1e-6)


def test_covariance_has_no_gradient():
    logp, _, adv, m = map(jnp.asarray, _inputs(3, allow_empty=False))
    g = jax.grad(lambda x: jnp.sum(token_covariance(x, adv, m)))(logp)
    assert not np.asarray(g).any()


# ----------------------------------------------------------------------------- selection


def test_top_k_mask_ties_go_to_the_lower_index_and_k_caps_at_the_eligible():
    scores = jnp.array([[1.0, 3.0, 3.0], [3.0, 0.5, 2.0]])
    eligible = jnp.array([[True, True, True], [True, False, True]])
    np.testing.assert_array_equal(np.asarray(top_k_mask(scores, eligible, jnp.int32(2))),
                                  [[False, True, True], [False, False, False]])
    np.testing.assert_array_equal(np.asarray(top_k_mask(scores, eligible, jnp.int32(3))),
                                  [[False, True, True], [True, False, False]])
    every = np.asarray(top_k_mask(scores, eligible, jnp.int32(100)))
    np.testing.assert_array_equal(every, np.asarray(eligible))


@FAST
@given(seed=seeds)
def test_kl_cov_picks_the_largest_covariances(seed):
    logp, _, adv, m = _inputs(seed)
    cov = ref.token_covariance(logp, adv, m)
    assume(_no_near_ties(cov[m > 0]))
    picked = np.asarray(_kl_cov(*map(jnp.asarray, (logp, adv, m))))
    expected = ref.kl_cov_mask(logp, adv, m, ratio=RATIO)
    np.testing.assert_array_equal(picked, expected)
    n = int((m > 0).sum())
    assert picked.sum() == (min(max(1, n // 4), n))
    if picked.any() and (~picked & (m > 0)).any():
        assert cov[picked].min() >= cov[~picked & (m > 0)].max()


@FAST
@given(seed=seeds)
def test_clip_cov_matches_reference_given_the_key(seed):
    logp, old, adv, m = _inputs(seed)
    cov = ref.token_covariance(logp, adv, m)
    assume(np.all(np.abs(cov - LOW) > 1e-4) and np.all(np.abs(cov - HIGH) > 1e-4))
    key = jax.random.PRNGKey(seed % 1000)
    exclude = np.asarray(clip_flags(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(m)))
    picked = np.asarray(_clip_cov(*map(jnp.asarray, (logp, adv, m)), key, jnp.asarray(exclude)))
    uniforms = np.asarray(jax.random.uniform(key, logp.shape))
    expected = ref.clip_cov_mask(logp, adv, m, uniforms, ratio=RATIO, low=LOW, high=HIGH, exclude=exclude)
    np.testing.assert_array_equal(picked, expected)
    eligible = (m > 0) & (cov > LOW) & (cov < HIGH) & ~exclude
    assert not (picked & ~eligible).any()
    assert picked.sum() == min(ref.selection_count(m, RATIO), int(eligible.sum()))


def test_clip_cov_pick_is_a_function_of_the_key():
    g = rng(0)
    logp = jnp.asarray(-g.exponential(size=(B, T)).astype(np.float32))
    adv = jnp.asarray(np.repeat([3.0, -3.0], B // 2).astype(np.float32))
    m = jnp.ones((B, T))
    none = jnp.zeros((B, T), bool)
    pick = lambda seed: np.asarray(
        clip_cov_mask(logp, adv, m, jax.random.PRNGKey(seed), ratio=0.125, low=0.0, high=100.0, exclude=none))
    np.testing.assert_array_equal(pick(1), pick(1))
    assert pick(1).sum() == 6  # floor(48 / 8) tokens, many more eligible
    assert any((pick(1) != pick(s)).any() for s in range(2, 6))


def test_empty_batch_picks_nothing():
    logp, old, adv, _ = map(jnp.asarray, _inputs(1))
    m = jnp.zeros((B, T))
    assert not np.asarray(_kl_cov(logp, adv, m)).any()
    assert not np.asarray(_clip_cov(logp, adv, m, jax.random.PRNGKey(0), jnp.zeros((B, T), bool))).any()


# ----------------------------------------------------------------------------- in policy_loss


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grad(recipe, logp, old, adv, m, key):
    def num(x):
        kw = {"key": key} if recipe.needs_key else {}
        terms, metrics = policy_loss(recipe, logp=x, old_logp=old, advantages=adv, mask=m, **kw)
        return terms.numerator, (terms, metrics)

    g, (terms, metrics) = jax.grad(num, has_aux=True)(logp)
    return terms, metrics, g


@FEW
@given(seed=seeds)
def test_clip_cov_removes_the_gradient_of_the_picked_tokens_only(seed):
    logp, old, adv, m = map(jnp.asarray, _inputs(seed))
    key = jax.random.PRNGKey(seed % 1000)
    base_terms, _, base_g = _loss_and_grad(LITE_PPO, logp, old, adv, m, key)
    terms, metrics, g = _loss_and_grad(CLIP_COV, logp, old, adv, m, key)
    exclude = clip_flags(logp, old, adv, m)
    picked = np.asarray(clip_cov_mask(logp, adv, m, key, ratio=RATIO, low=LOW, high=HIGH, exclude=exclude))
    g, base_g = np.asarray(g), np.asarray(base_g)
    assert not g[picked].any()
    np.testing.assert_allclose(g[~picked], base_g[~picked], rtol=1e-6, atol=1e-8)
    # the loss value keeps the picked tokens (detached, not dropped) and their denominator share
    np.testing.assert_allclose(float(terms.numerator), float(base_terms.numerator), rtol=1e-6)
    assert float(terms.denominator) == float(base_terms.denominator)
    n = max(float(np.asarray(m).sum()), 1.0)
    np.testing.assert_allclose(float(metrics["cov_selected_frac"]), picked.sum() / n, rtol=1e-6)


@FEW
@given(seed=seeds)
def test_kl_cov_matches_reference_and_adds_the_abs_log_ratio_gradient(seed):
    logp, old, adv, m = _inputs(seed)
    cov = ref.token_covariance(logp, adv, m)
    assume(_no_near_ties(cov[m > 0]))
    args = tuple(map(jnp.asarray, (logp, old, adv, m))) + (None,)
    terms, metrics, g = _loss_and_grad(KL_COV, *args)
    _, _, base_g = _loss_and_grad(LITE_PPO, *args)
    num, den = ref.policy_loss(KL_COV, logp=logp, old_logp=old, advantages=adv, mask=m)
    np.testing.assert_allclose(float(terms.numerator), num, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-6)
    picked = ref.kl_cov_mask(logp, adv, m, ratio=RATIO)
    extra = np.where(picked, KL_COV.kl_cov_coef * np.sign(logp - old), 0.0)
    np.testing.assert_allclose(np.asarray(g), np.asarray(base_g) + extra, rtol=1e-5, atol=1e-6)
    assert_finite(*metrics.values())


def test_clip_cov_without_a_key_raises():
    logp, old, adv, m = map(jnp.asarray, _inputs(0))
    with pytest.raises(ValueError, match="key"):
        policy_loss(CLIP_COV, logp=logp, old_logp=old, advantages=adv, mask=m)


@pytest.mark.parametrize("changes,knob", [
    (dict(cov_control="entropy_cov"), "cov_control"),
    (dict(cov_ratio=0.0), "cov_ratio"),
    (dict(cov_ratio=1.5), "cov_ratio"),
    (dict(clip_cov_low=5.0, clip_cov_high=1.0), "clip_cov_low"),
    (dict(kl_cov_coef=-1.0), "kl_cov_coef"),
    (dict(sampler_logp_kind="topk"), "sampler_logp_kind"),
])
def test_recipe_validation_names_the_bad_knob(changes, knob):
    with pytest.raises(ValueError, match=re.escape(knob)):
        Recipe(**changes)


def test_only_clip_cov_needs_a_key():
    assert CLIP_COV.needs_key and not KL_COV.needs_key and not LITE_PPO.needs_key
