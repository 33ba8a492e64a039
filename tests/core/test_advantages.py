"""Tests of jaxrl4llm.core advantages: normalize_advantages, rloo_advantages, batch_whiten."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import batch_whiten, normalize_advantages, rloo_advantages, scale_rewards
from tests.core import reference as ref
from tests.core._helpers import B, FAST, G, assert_finite, rewards, rng, seeds

MODES = ["group", "batch", "none"]


def _adv(r, group_size=G, **kw):
    return np.asarray(normalize_advantages(jnp.asarray(r, jnp.float32), group_size, **kw))


# ----------------------------------------------------------------------------- hand values


def test_grpo_hand_values():
    # group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> (1 - .25)/.5 = 1.5, -0.5
    # group 2: mean 0.5, std sqrt(1 / 3) = 0.57735 -> +-0.866025
    out = _adv([1, 0, 0, 0, 1, 1, 0, 0], mean="group", std="group")
    np.testing.assert_allclose(
        out, [1.5, -0.5, -0.5, -0.5, 0.866025, 0.866025, -0.866025, -0.866025], atol=1e-5)


def test_lite_ppo_hand_values():
    # batch of 8 with 3 ones: unbiased batch std = sqrt(8 * 3/8 * 5/8 / 7) = 0.517549
    out = _adv([1, 0, 0, 0, 1, 1, 0, 0], mean="group", std="batch")
    s = 0.517549
    np.testing.assert_allclose(
        out, np.array([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / s, rtol=1e-5)


def test_dr_grpo_hand_values_have_no_eps():
    # std="none": A = r - group mean exactly (eps is not added)
    out = _adv([1, 0, 0, 0, 1, 1, 0, 0], mean="group", std="none", eps=0.5)
    np.testing.assert_allclose(out, [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5], atol=1e-7)


def test_mean_none_std_none_is_identity():
    r = np.array([0.3, -2.0, 7.5, 0.1, 1e-3, 0.0, 4.0, -1.0], np.float32)
    np.testing.assert_array_equal(_adv(r, mean="none", std="none"), r)


def test_rloo_hand_values():
    # A_i = r_i - mean of the other three: 1 - 0 = 1; 0 - 1/3; 1 - 1/3 = 2/3; 0 - 2/3
    out = np.asarray(rloo_advantages(jnp.array([1.0, 0, 0, 0, 1, 1, 0, 0]), 4))
    np.testing.assert_allclose(out, [1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3],
                               atol=1e-6)


def test_batch_whiten_hand_values():
    # values 1, 3 (mask 1) and 100 (mask 0): mean 2, std (ddof 0) 1 -> -1, 1, 0
    out = np.asarray(batch_whiten(jnp.array([1.0, 3.0, 100.0]), jnp.array([1.0, 1.0, 0.0])))
    np.testing.assert_allclose(out, [-1.0, 1.0, 0.0], atol=1e-5)


# ----------------------------------------------------------------------------- vs reference


@FAST
@given(seed=seeds, mean=st.sampled_from(MODES), std=st.sampled_from(MODES),
       ddof=st.sampled_from([0, 1]))
def test_normalize_matches_reference(seed, mean, std, ddof):
    r = rewards(rng(seed))
    out = _adv(r, mean=mean, std=std, ddof=ddof)
    expected = ref.normalize_advantages(r, G, mean=mean, std=std, ddof=ddof)
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


@FAST
@given(seed=seeds, std=st.sampled_from(MODES))
def test_group_centred_advantages_sum_to_zero_per_group(seed, std):
    out = _adv(rewards(rng(seed)), mean="group", std=std)
    sums = out.reshape(-1, G).sum(axis=1)
    scale = np.abs(out).reshape(-1, G).sum(axis=1) + 1.0
    np.testing.assert_array_less(np.abs(sums), 1e-5 * scale)


@FAST
@given(seed=seeds, std=st.sampled_from(["group", "batch"]),
       a=st.floats(0.2, 10.0), b=st.floats(-2.0, 2.0))
def test_invariant_to_positive_affine_maps_of_rewards(seed, std, a, b):
    """A(a r + b; eps a) == A(r; eps) exactly in real arithmetic, for group/group (GRPO) and
    group/batch (Lite PPO). Rewards on a 0.01 grid, so that float32 rounding of a r + b stays
    far below the spread of any non-constant group."""
    r = np.round(rewards(rng(seed)), 2).astype(np.float32)
    mapped = (a * r.astype(np.float64) + b).astype(np.float32)
    out = _adv(mapped, mean="group", std=std, eps=1e-6 * a)
    expected = _adv(r, mean="group", std=std, eps=1e-6)
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=2e-3)


@FAST
@given(seed=seeds, a=st.floats(0.5, 4.0), b=st.floats(-3.0, 3.0))
def test_invariant_to_affine_maps_with_default_eps(seed, a, b):
    r = rewards(rng(seed), kind=0)  # 0/1 rewards: std is either 0 or >= 0.5
    mapped = (a * r + b).astype(np.float32)
    np.testing.assert_allclose(_adv(mapped), _adv(r), rtol=1e-4, atol=1e-4)


@FAST
@given(seed=seeds, a=st.floats(0.5, 4.0), b=st.floats(-3.0, 3.0), mean=st.sampled_from(["group", "batch"]))
def test_scaled_rewards_scale_dr_grpo_advantages_and_leave_std_arms(seed, a, b, mean):
    """The study's reward-scale setting through scale_rewards: without a std level (Dr. GRPO) the
    advantages scale by `a` and the offset cancels; with one they do not move (0/1 rewards)."""
    r = rewards(rng(seed), kind=0)
    shaped = np.asarray(scale_rewards(jnp.asarray(r), a, b))
    np.testing.assert_allclose(shaped, a * r + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_adv(shaped, mean=mean, std="none"), a * _adv(r, mean=mean, std="none"),
                               rtol=1e-4, atol=1e-4)
    for std in (("group", "batch") if mean == "group" else ("batch",)):  # the study's three std arms
        np.testing.assert_allclose(_adv(shaped, mean=mean, std=std), _adv(r, mean=mean, std=std), rtol=1e-4, atol=1e-4)


def test_study_reward_setting_is_minus_one_one():
    np.testing.assert_array_equal(np.asarray(scale_rewards(jnp.array([0.0, 1.0]), 2.0, -1.0)), [-1.0, 1.0])


@FAST
@given(seed=seeds)
def test_lite_ppo_is_group_centred_rewards_over_batch_std(seed):
    r = rewards(rng(seed)).astype(np.float64)
    centred = r - np.repeat(r.reshape(-1, G).mean(axis=1), G)
    centred[np.repeat((r.reshape(-1, G) == r.reshape(-1, G)[:, :1]).all(axis=1), G)] = 0.0
    expected = centred / (np.std(r, ddof=1) + 1e-6)
    np.testing.assert_allclose(_adv(r, mean="group", std="batch"), expected, rtol=2e-4, atol=2e-4)


# ----------------------------------------------------------------------------- degenerate input


@pytest.mark.parametrize("std", MODES)
def test_group_of_size_one_gives_zero(std):
    r = np.array([0.0, 1.0, 0.5, -3.0, 2.0, 2.0, 0.1, 7.0], np.float32)
    out = _adv(r, group_size=1, mean="group", std=std)
    np.testing.assert_array_equal(out, np.zeros(8))


def test_rloo_group_of_size_one_gives_zero():
    r = jnp.array([0.0, 1.0, 0.5, -3.0, 2.0, 2.0, 0.1, 7.0])
    np.testing.assert_array_equal(np.asarray(rloo_advantages(r, 1)), np.zeros(8))


@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, 0.7, 1e4 + 0.1])
@pytest.mark.parametrize("std", MODES)
def test_all_equal_group_is_exactly_zero(value, std):
    """Group of 3 equal non-dyadic values: a float32 mean need not equal the value, the spec
    still promises exactly 0 (GRPO / Lite PPO / Dr. GRPO)."""
    r = np.array([value] * 3 + [0.0, 1.0, 0.5], np.float32)
    out = _adv(r, group_size=3, mean="group", std=std)
    np.testing.assert_array_equal(out[:3], np.zeros(3))
    assert_finite(out)


@pytest.mark.parametrize("mean,std", [(m, s) for m in MODES for s in MODES])
def test_all_equal_batch_is_finite(mean, std):
    r = np.full(8, 0.1, np.float32)
    out = _adv(r, mean=mean, std=std)
    assert_finite(out)
    if mean == "group":
        np.testing.assert_array_equal(out, np.zeros(8))
    elif mean == "batch":
        # (r - m) / (0 + eps): r - m is at most float32 rounding of the mean
        np.testing.assert_array_less(np.abs(out), 0.1)
    else:  # mean "none": r / (0 + eps) with a std, r itself without
        if std == "none":
            np.testing.assert_array_equal(out, r)


def test_ddof_larger_or_equal_group_size_means_std_zero():
    # groups of 2 with ddof=2: std 0 -> (r - m) / eps; a constant group stays 0
    r = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
    out = _adv(r, group_size=2, mean="group", std="group", ddof=2, eps=1.0)
    np.testing.assert_allclose(out, [0.0, 0.0, -0.5, 0.5], atol=1e-6)


def test_batch_size_not_multiple_of_group_raises():
    with pytest.raises(ValueError):
        normalize_advantages(jnp.zeros(6), 4)


@pytest.mark.parametrize("mean,std", [("group", "group"), ("group", "batch"), ("batch", "batch")])
def test_extreme_rewards_are_finite(mean, std):
    r = np.array([1e30, -1e30, 0.0, 1.0, 1e-30, 1e-30, 1e-30, 1e-30], np.float32)
    assert_finite(_adv(r, mean=mean, std=std))


# ----------------------------------------------------------------------------- RLOO


@FAST
@given(seed=seeds, group_size=st.sampled_from([1, 2, 4, 8]))
def test_rloo_matches_leave_one_out_loops(seed, group_size):
    r = rewards(rng(seed))
    out = np.asarray(rloo_advantages(jnp.asarray(r), group_size))
    np.testing.assert_allclose(out, ref.rloo_advantages(r, group_size), rtol=1e-5, atol=1e-5)


@FAST
@given(seed=seeds)
def test_rloo_is_scaled_group_centring(seed):
    # A_i = G/(G-1) (r_i - mean_group)  [RLOO]
    r = rewards(rng(seed))
    out = np.asarray(rloo_advantages(jnp.asarray(r), G))
    expected = G / (G - 1) * (r - np.repeat(r.reshape(-1, G).mean(axis=1), G))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- batch whiten


@FAST
@given(seed=seeds, use_mask=st.booleans(), two_d=st.booleans())
def test_batch_whiten_matches_reference(seed, use_mask, two_d):
    g = rng(seed)
    shape = (B, 6) if two_d else (B,)
    x = (3.0 * g.normal(size=shape) + 1.0).astype(np.float32)
    m = (g.random(shape) < 0.7).astype(np.float32) if use_mask else None
    out = np.asarray(batch_whiten(jnp.asarray(x), None if m is None else jnp.asarray(m)))
    np.testing.assert_allclose(out, ref.batch_whiten(x, m), rtol=1e-4, atol=1e-4)
    if m is not None:
        assert np.all(out[m == 0] == 0.0)
        if m.sum() > 1 and np.ptp(x[m > 0]) > 1e-3:
            np.testing.assert_allclose(out[m > 0].mean(), 0.0, atol=1e-5)
            np.testing.assert_allclose(out[m > 0].std(), 1.0, atol=1e-3)


def test_batch_whiten_degenerate_is_finite():
    x = jnp.full((B, 6), 3.0)
    assert_finite(batch_whiten(x), batch_whiten(x, jnp.zeros((B, 6))))
    np.testing.assert_array_equal(np.asarray(batch_whiten(x, jnp.zeros((B, 6)))), 0.0)


# ----------------------------------------------------------------------------- jit / vmap


_VMAP_FNS = {
    "grpo": functools.partial(normalize_advantages, group_size=G, mean="group", std="group"),
    "lite": functools.partial(normalize_advantages, group_size=G, mean="group", std="batch"),
    "rloo": functools.partial(rloo_advantages, group_size=G),
    "whiten": batch_whiten,
}


@pytest.mark.parametrize("name", sorted(_VMAP_FNS))
def test_advantages_under_jit_and_vmap(name):
    g = rng(0)
    r = np.stack([rewards(g, kind=k) for k in range(3)])  # [3, B]
    fn = _VMAP_FNS[name]
    batched = np.asarray(jax.jit(jax.vmap(fn))(jnp.asarray(r)))
    rows = np.stack([np.asarray(fn(jnp.asarray(x))) for x in r])
    np.testing.assert_allclose(batched, rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batched[2], np.asarray(jax.jit(fn)(jnp.asarray(r[2]))),
                               rtol=1e-6, atol=1e-7)


@FAST
@given(seed=seeds, filler=st.integers(1, 3), value=st.sampled_from([0.0, 1.0]))
def test_dynamic_sampling_filler_groups_leave_the_batch_statistics(seed, filler, value):
    """Lite PPO with dynamic sampling: constant filler groups (kept only for the batch shape, zero
    weight in the loss) do not enter the batch mean/std; the training rows' advantages equal those
    of the varied groups alone. They entered it before (a smaller std, larger advantages)."""
    import dataclasses

    from jaxrl4llm.core import LITE_PPO, compute_advantages

    r = rewards(rng(seed)).astype(np.float32)
    varied = np.concatenate([g for g in r.reshape(-1, G) if g.max() != g.min()] or [np.array([0, 1] * (G // 2), np.float32)])
    batch = np.concatenate([varied, np.full(filler * G, value, np.float32)])
    for mean in ("group", "batch"):
        recipe = dataclasses.replace(LITE_PPO, dynamic_sampling=True, adv_mean=mean)
        alone = compute_advantages(jnp.asarray(varied), G, recipe)
        mixed = compute_advantages(jnp.asarray(batch), G, recipe)
        np.testing.assert_allclose(np.asarray(mixed.advantages)[: len(varied)], np.asarray(alone.advantages),
                                   rtol=1e-5, atol=1e-6)
        assert not np.asarray(mixed.row_weights)[len(varied):].any()
