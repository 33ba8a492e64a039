"""Tests of the sampler-trainer mismatch corrections (core.mismatch) and their Recipe knobs."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import (GRPO, IS_CORRECTIONS, LITE_PPO, PRESETS, SCALERL, LossTerms, Recipe, agreement_stats,
                            compute_advantages,
                            mismatch_correction, policy_loss, truncated_is_weights)
from tests.core import reference as ref
from tests.core._helpers import B, FAST, FEW, G, T, assert_finite, logps, mask, rewards, rng, seeds

CAP = 1.5
KW = dict(cap=CAP, low=0.6, high=1.6, delta=0.05)
CAPPED = ("tis_token", "tis_seq", "mis_token", "mis_seq")


@functools.partial(jax.jit, static_argnames=("kind",))
def _correct(kind, old, sampler, m, adv):
    return mismatch_correction(kind, old, sampler, m, advantages=adv, **KW)


def _inputs(seed, spread=0.3, gap=0.4):
    g = rng(seed)
    old, _ = logps(g, spread=spread)
    sampler = (old + gap * g.normal(size=(B, T))).astype(np.float32)
    adv = g.normal(size=B).astype(np.float32)
    return old, sampler, mask(g), adv


def _run(kind, old, sampler, m, adv):
    w, touched = _correct(kind, *map(jnp.asarray, (old, sampler, m, adv)))
    return np.asarray(w), np.asarray(touched)


# ----------------------------------------------------------------------------- vs reference


@FAST
@given(seed=seeds, kind=st.sampled_from(IS_CORRECTIONS))
def test_matches_reference(seed, kind):
    old, sampler, m, adv = _inputs(seed)
    w, touched = _run(kind, old, sampler, m, adv)
    rw, rt = ref.mismatch_correction(kind, old, sampler, m, advantages=adv, **KW)
    counted = m > 0
    np.testing.assert_allclose(w[counted], rw[counted], rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(touched, rt)
    assert not touched[~counted].any()


@FAST
@given(seed=seeds, kind=st.sampled_from(IS_CORRECTIONS))
def test_finite_and_bounded_for_any_gap(seed, kind):
    """Gaps of +-1e3 nats, infinities and NaN give finite weights in [0, C] (tis/mis) or {0, 1}."""
    old, sampler, m, adv = _inputs(seed)
    g = rng(seed + 1)
    sampler = (sampler + g.choice([-1e3, 0.0, 1e3], size=(B, T))).astype(np.float32)
    sampler[0, 0], sampler[1, 1], old[2, 2] = np.inf, np.nan, -np.inf
    w, touched = _run(kind, old, sampler, m, adv)
    assert_finite(w)
    assert (w >= 0).all()
    if kind in CAPPED:
        assert (w <= CAP * (1 + 1e-6)).all()
    else:
        assert set(np.unique(w)) <= {0.0, 1.0}


@pytest.mark.parametrize("kind", IS_CORRECTIONS)
def test_no_gradient_flows_through_the_weights(kind):
    old, sampler, m, adv = map(jnp.asarray, _inputs(3))
    go, gs = jax.grad(lambda a, b: jnp.sum(mismatch_correction(kind, a, b, m, advantages=adv, **KW).weights),
                      argnums=(0, 1))(old, sampler)
    assert not np.asarray(go).any() and not np.asarray(gs).any()


# ----------------------------------------------------------------------------- properties


@FAST
@given(seed=seeds)
def test_tis_token_is_the_legacy_truncated_is_weight(seed):
    old, sampler, m, adv = _inputs(seed)
    w, touched = _run("tis_token", old, sampler, m, adv)
    legacy = np.asarray(truncated_is_weights(jnp.asarray(old), jnp.asarray(sampler), CAP))
    # The same float32 formula; XLA may evaluate exp inside the jitted correction's fusion and in the
    # eager call's own program differently (reported on jax 0.12.0.1): equal to within one ulp, not bit for bit.
    np.testing.assert_array_max_ulp(w, legacy, maxulp=1)
    np.testing.assert_array_equal(touched, (m > 0) & (np.exp(old.astype(np.float64) - sampler) > CAP))


@FAST
@given(seed=seeds, level=st.sampled_from(["token", "seq"]))
def test_mis_keeps_the_tis_weight_and_masks_what_tis_truncates(seed, level):
    """MIS = TIS where TIS does not truncate, 0 where it does: same touched tokens."""
    old, sampler, m, adv = _inputs(seed)
    tw, tt = _run(f"tis_{level}", old, sampler, m, adv)
    mw, mt = _run(f"mis_{level}", old, sampler, m, adv)
    np.testing.assert_array_equal(mt, tt)
    counted = m > 0
    np.testing.assert_allclose(mw[counted], np.where(tt, 0.0, tw)[counted], rtol=1e-6)
    assert (mw[counted & ~mt] <= CAP).all() and (mw[mt] == 0).all()


@FAST
@given(seed=seeds, kind=st.sampled_from(["tis_seq", "mis_seq", "seq_mask"]))
def test_sequence_level_weights_are_constant_over_a_row(seed, kind):
    old, sampler, m, adv = _inputs(seed)
    w, touched = _run(kind, old, sampler, m, adv)
    for b in range(B):
        counted = m[b] > 0
        if counted.any():
            assert np.ptp(w[b][counted]) <= 1e-6 * max(1.0, w[b][counted].max())
            assert touched[b][counted].all() or not touched[b].any()


@FAST
@given(seed=seeds, level=st.sampled_from(["tis", "mis"]))
def test_sequence_level_with_one_token_per_row_is_token_level(seed, level):
    old, sampler, _, adv = _inputs(seed)
    one = np.zeros((B, T), np.float32)
    one[:, 0] = 1.0
    sw, st_ = _run(f"{level}_seq", old, sampler, one, adv)
    tw, tt = _run(f"{level}_token", old, sampler, one, adv)
    np.testing.assert_allclose(sw[:, 0], tw[:, 0], rtol=1e-6)
    np.testing.assert_array_equal(st_, tt)


@FAST
@given(seed=seeds, kind=st.sampled_from(IS_CORRECTIONS))
def test_on_policy_changes_nothing(seed, kind):
    """sampler == trainer: every ratio is 1 (inside the IcePop band, below the cap), D_i = 0 <= delta."""
    old, _, m, adv = _inputs(seed)
    w, touched = _run(kind, old, old, m, adv)
    np.testing.assert_allclose(w, 1.0)
    assert not touched.any()


@FAST
@given(seed=seeds)
def test_icepop_masks_exactly_the_tokens_outside_the_band(seed):
    old, sampler, m, adv = _inputs(seed, gap=0.6)
    w, touched = _run("icepop", old, sampler, m, adv)
    rho = np.exp(old.astype(np.float64) - sampler)
    outside = (rho < KW["low"]) | (rho > KW["high"])
    counted = m > 0
    np.testing.assert_array_equal(touched, counted & outside)
    np.testing.assert_array_equal(w[counted], np.where(outside, 0.0, 1.0)[counted])


def test_icepop_low_zero_means_no_lower_bound():
    old = jnp.zeros((1, 3))
    sampler = jnp.array([[30.0, 0.0, -30.0]])  # ratios e^-30, 1, e^30
    w, touched = mismatch_correction("icepop", old, sampler, jnp.ones((1, 3)), low=0.0, high=2.0)
    np.testing.assert_array_equal(np.asarray(w), [[1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(touched), [[False, False, True]])


@FAST
@given(seed=seeds)
def test_seq_mask_never_masks_non_negative_advantages(seed):
    old, sampler, m, adv = _inputs(seed, gap=1.0)
    sampler = (sampler + 0.5).astype(np.float32)  # pi_sampler > pi_old: D_i ~ 0.5 > delta
    w, touched = _run("seq_mask", old, sampler, m, adv)
    pos = adv >= 0
    np.testing.assert_allclose(w[pos], 1.0)
    assert not touched[pos].any()
    div = np.array([(sampler[b] - old[b].astype(np.float64))[m[b] > 0].mean() if m[b].any() else 0.0
                    for b in range(B)])
    hit = (adv < 0) & (div > KW["delta"])
    np.testing.assert_allclose(w, np.broadcast_to(np.where(hit[:, None], 0.0, 1.0), (B, T)))


def test_seq_mask_hand_values():
    # rows: A < 0 drifted (masked), A < 0 small drift, A > 0 drifted, A < 0 empty row
    old = jnp.zeros((4, 2))
    sampler = jnp.array([[0.2, 0.0], [0.02, 0.02], [1.0, 1.0], [5.0, 5.0]])
    m = jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv = jnp.array([-1.0, -1.0, 1.0, -1.0])
    w, touched = mismatch_correction("seq_mask", old, sampler, m, advantages=adv, delta=0.05)
    np.testing.assert_array_equal(np.asarray(w), [[0, 0], [1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(np.asarray(touched).sum(axis=1), [2, 0, 0, 0])


def test_sequence_tis_and_mis_hand_values():
    old = jnp.zeros((2, 3))
    sampler = jnp.array([[-0.2, -0.2, 9.0], [-0.5, -0.5, 0.0]])  # 3rd column masked
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tw, tt = mismatch_correction("tis_seq", old, sampler, m, cap=2.0)
    mw, mt = mismatch_correction("mis_seq", old, sampler, m, cap=2.0)
    np.testing.assert_allclose(np.asarray(tw), [[math.exp(0.4)] * 3, [2.0] * 3], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mw), [[math.exp(0.4)] * 3, [0.0] * 3], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(tt), [[False] * 3, [True] * 3])
    np.testing.assert_array_equal(np.asarray(mt), np.asarray(tt))


def test_unknown_kind_and_bad_arguments_raise():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="kind"):
        mismatch_correction("tis", z, z, z, cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        mismatch_correction("mis_token", z, z, z, cap=0.0)
    with pytest.raises(ValueError, match="low"):
        mismatch_correction("icepop", z, z, z, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="delta"):
        mismatch_correction("seq_mask", z, z, z, advantages=jnp.zeros(1))


# ----------------------------------------------------------------------------- recipes

RECIPES = {
    "tis_token": LITE_PPO.replace(is_correction="tis_token", is_cap=CAP),
    "tis_seq": GRPO.replace(is_correction="tis_seq", is_cap=CAP),
    "mis_token": LITE_PPO.replace(is_correction="mis_token", is_cap=CAP),
    "mis_seq": GRPO.replace(is_correction="mis_seq", is_cap=CAP),
    "icepop": LITE_PPO.replace(is_correction="icepop", icepop_low=0.6, icepop_high=1.6),
    "seq_mask": GRPO.replace(is_correction="seq_mask", seq_mask_delta=0.05),
    "scalerl_mis_seq": SCALERL.replace(is_correction="mis_seq", is_cap=CAP),
    "scalerl_icepop": SCALERL.replace(is_correction="icepop", icepop_low=0.6, icepop_high=1.6),
}
METRIC = {"tis_token": "is_truncated_frac", "tis_seq": "is_truncated_frac"}


def _loss_inputs(seed, r_kind=2):
    g = rng(seed)
    logp, old = logps(g, spread=0.3)
    sampler = (old + 0.4 * g.normal(size=(B, T))).astype(np.float32)
    m = mask(g)
    r = rewards(g, kind=r_kind)
    x = dict(logp=logp, old_logp=old, mask=m, ref_logp=(logp + 0.1).astype(np.float32), sampler_logp=sampler)
    return x, r, m.sum(axis=1).astype(np.int32)


def _advantages(recipe, r, lengths):
    return compute_advantages(jnp.asarray(r), G, recipe, lengths=jnp.asarray(lengths))


@functools.partial(jax.jit, static_argnums=0)
def _loss(recipe, x, adv):
    return policy_loss(recipe, advantages=adv.advantages, row_weights=adv.row_weights,
                       denominator_weights=adv.denominator_weights, **x)


@FEW
@given(seed=seeds, name=st.sampled_from(sorted(RECIPES)))
def test_policy_loss_matches_reference(seed, name):
    recipe = RECIPES[name]
    x, r, lengths = _loss_inputs(seed)
    adv = _advantages(recipe, r, lengths)
    terms, metrics = _loss(recipe, {k: jnp.asarray(v) for k, v in x.items()}, adv)
    ra = ref.compute_advantages(r, G, recipe, lengths=lengths)
    num, den = ref.policy_loss(recipe, advantages=ra["advantages"], row_weights=ra["row_weights"],
                               denominator_weights=ra["denominator_weights"], group_size=G, **x)
    np.testing.assert_allclose(float(terms.numerator), num, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-6)
    # the touched-fraction metric is the fraction of counted tokens the reference touches
    m = x["mask"] * np.asarray(adv.row_weights)[:, None]
    _, touched = ref.mismatch_correction(recipe.is_correction, x["old_logp"], x["sampler_logp"], m,
                                         advantages=np.asarray(adv.advantages), cap=recipe.is_cap,
                                         low=recipe.icepop_low, high=recipe.icepop_high, delta=recipe.seq_mask_delta)
    key = METRIC.get(recipe.is_correction, "is_masked_frac")
    np.testing.assert_allclose(float(metrics[key]), touched.sum() / max(m.sum(), 1.0), rtol=1e-6, atol=1e-7)
    assert_finite(*metrics.values())


def _full_and_split_value_and_grad(recipe, x, adv, k, strided):
    """Loss and gradient of the full batch, and of k micro-batches summed as LossTerms (num / den)."""
    pick = (lambda v, i: v[i::k]) if strided else (lambda v, i: v[i * (B // k):(i + 1) * (B // k)])

    def full(lp):
        return _loss(recipe, {**x, "logp": lp}, adv)[0].value

    def split(lp):
        parts = [_loss(recipe, {kk: pick(v, i) for kk, v in {**x, "logp": lp}.items()},
                       jax.tree.map(lambda a: pick(a, i), adv))[0] for i in range(k)]
        return sum(p.numerator for p in parts) / sum(p.denominator for p in parts)

    lp = x["logp"]
    return full(lp), split(lp), jax.grad(full)(lp), jax.grad(split)(lp)


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("k,strided", [(2, False), (4, True)])
def test_micro_batches_equal_the_full_batch(name, k, strided):
    """Masks are row-local and masked tokens stay in the denominators: any split is exact."""
    recipe = RECIPES[name]
    x, r, lengths = _loss_inputs(7, r_kind=0)
    x = {kk: jnp.asarray(v) for kk, v in x.items()}
    adv = _advantages(recipe, r, lengths)
    vf, vs, gf, gs = _full_and_split_value_and_grad(recipe, x, adv, k, strided)
    np.testing.assert_allclose(float(vs), float(vf), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gf), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["mis_token", "icepop", "mis_seq", "seq_mask"])
def test_masked_tokens_get_no_gradient_but_stay_in_the_denominator(name):
    recipe = RECIPES[name]
    x, r, lengths = _loss_inputs(9, r_kind=2)
    x["sampler_logp"] = (x["sampler_logp"] + np.where(np.arange(B)[:, None] < 4, 0.0, -2.0)).astype(np.float32)
    adv = _advantages(recipe, r, lengths)
    if name == "seq_mask":  # drift the other way, so D_i > delta on rows 4..7
        x["sampler_logp"] = (x["old_logp"] + np.where(np.arange(B)[:, None] < 4, 0.0, 2.0)).astype(np.float32)
    xj = {k: jnp.asarray(v) for k, v in x.items()}
    m = x["mask"]
    w, touched = ref.mismatch_correction(recipe.is_correction, x["old_logp"], x["sampler_logp"], m,
                                         advantages=np.asarray(adv.advantages), cap=recipe.is_cap,
                                         low=recipe.icepop_low, high=recipe.icepop_high, delta=recipe.seq_mask_delta)
    assert touched.any(), "the case must mask something"
    grad = np.asarray(jax.grad(lambda lp: _loss(recipe, {**xj, "logp": lp}, adv)[0].value)(xj["logp"]))
    assert not grad[touched].any()
    with_c, _ = _loss(recipe, xj, adv)
    without, _ = _loss(recipe.replace(is_correction=None), xj, adv)
    np.testing.assert_allclose(float(with_c.denominator), float(without.denominator))


def test_correction_without_sampler_logp_raises():
    x, r, lengths = _loss_inputs(0)
    x = {k: jnp.asarray(v) for k, v in x.items() if k != "sampler_logp"}
    for name, recipe in RECIPES.items():
        adv = _advantages(recipe, r, lengths)
        with pytest.raises(ValueError, match=r"is_correction=.*sampler_logp"):
            policy_loss(recipe, advantages=adv.advantages, row_weights=adv.row_weights,
                        denominator_weights=adv.denominator_weights, **x)


def test_tis_token_equals_the_legacy_tis_cap():
    x, r, lengths = _loss_inputs(4)
    x = {k: jnp.asarray(v) for k, v in x.items()}
    adv = _advantages(LITE_PPO, r, lengths)
    new, m_new = _loss(RECIPES["tis_token"], x, adv)
    old, m_old = _loss(LITE_PPO.replace(tis_cap=CAP), x, adv)
    assert float(new.numerator) == float(old.numerator) and float(new.denominator) == float(old.denominator)
    assert float(m_new["is_weight_mean"]) == float(m_old["is_weight_mean"])
    assert float(m_new["is_truncated_frac"]) == float(m_old["is_truncated_frac"])


def test_presets_have_no_correction():
    for recipe in PRESETS.values():
        assert recipe.is_correction is None and recipe.tis_cap is None and not recipe.uses_sampler_logp
    assert RECIPES["icepop"].uses_sampler_logp and LITE_PPO.replace(tis_cap=2.0).uses_sampler_logp


@pytest.mark.parametrize("changes,knob", [
    (dict(is_correction="tis"), "is_correction='tis'"),
    (dict(is_correction="mis_token"), "is_correction='mis_token' needs is_cap"),
    (dict(is_correction="tis_seq", is_cap=0.0), "is_cap"),
    (dict(is_correction="tis_token", is_cap=2.0, tis_cap=2.0), "tis_cap=2.0 with is_correction='tis_token'"),
    (dict(tis_cap=-1.0), "tis_cap must be > 0"),
    (dict(is_correction="icepop", icepop_low=2.0, icepop_high=1.0), "icepop_low/icepop_high"),
    (dict(icepop_low=-0.1), "icepop_low/icepop_high"),
    (dict(is_correction="seq_mask"), "seq_mask_delta"),
])
def test_recipe_validation_names_the_bad_knob(changes, knob):
    with pytest.raises(ValueError, match=re.escape(knob)):
        Recipe(name="bad", **changes)


def test_metrics_hand_values():
    """2 rows x 2 tokens, token-mean: MIS masks 1 of 3 counted tokens; is_weight_mean over counted tokens."""
    logp = jnp.zeros((2, 2))
    old = jnp.zeros((2, 2))
    sampler = jnp.array([[0.0, -1.0], [0.0, 5.0]])  # ratios 1, e (> 1.5, masked); 1, masked column
    m = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    terms, metrics = policy_loss(RECIPES["mis_token"], logp=logp, old_logp=old, advantages=jnp.array([1.0, 1.0]),
                                 mask=m, sampler_logp=sampler)
    np.testing.assert_allclose(float(metrics["is_masked_frac"]), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["is_weight_mean"]), 2 / 3, rtol=1e-6)
    # on-policy PPO: loss -A = -1 on the 2 kept tokens, 0 on the masked one, denominator 3
    np.testing.assert_allclose([float(terms.numerator), float(terms.denominator)], [-2.0, 3.0], rtol=1e-6)
    assert isinstance(terms, LossTerms)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_degenerate_batches_are_finite(name):
    """All tokens masked (loss 0), and sampler gaps of +-60 nats: finite loss, gradient and metrics."""
    recipe = RECIPES[name]
    x, r, lengths = _loss_inputs(11)
    g = rng(12)
    cases = {"all_masked": dict(mask=np.zeros((B, T), np.float32)),
             "extreme_gap": dict(sampler_logp=(x["old_logp"] + g.choice([-60.0, 60.0], size=(B, T))).astype(np.float32))}
    for case, override in cases.items():
        xj = {k: jnp.asarray(v) for k, v in {**x, **override}.items()}
        adv = _advantages(recipe, r, lengths)
        v, grad = jax.value_and_grad(lambda lp: _loss(recipe, {**xj, "logp": lp}, adv)[0].value)(xj["logp"])
        _, metrics = _loss(recipe, xj, adv)
        assert_finite(v, grad, *metrics.values())
        if case == "all_masked":
            assert float(v) == 0.0


# ---------------------------------------------------------------- agreement_stats (issue #39)

def _agreement_reference(old, sampler, m, ids=None):
    """numpy: the figures of agreement_stats, one token and one sequence at a time."""
    counted = m > 0
    d = (old - sampler)[counted].astype(np.float64)
    rho = np.exp(d)
    seq = {}
    for (b, t) in zip(*np.nonzero(counted)):
        key = b if ids is None else ids[b, t]
        seq[key] = seq.get(key, 0.0) + float(old[b, t]) - float(sampler[b, t])
    s = np.array(list(seq.values()))
    return {"tokens": counted.sum(), "out_10": np.mean((rho < 0.9) | (rho > 1.1)) if d.size else 0.0,
            "out_1": np.mean((rho < 0.99) | (rho > 1.01)) if d.size else 0.0,
            "max_abs": np.abs(d).max() if d.size else 0.0, "mean_abs": np.abs(d).mean() if d.size else 0.0,
            "seq_out": np.mean((s < np.log(0.5)) | (s > np.log(2.0))) if s.size else 0.0}


@FAST
@given(seeds, st.sampled_from([0.003, 0.05, 0.3]), st.booleans())
def test_agreement_stats_match_a_token_by_token_count(seed, gap, packed):
    """Every figure equals the numpy count, for rows as sequences and for packed sequence ids."""
    g = rng(seed)
    old, _ = logps(g)
    sampler = (old + gap * g.normal(size=(B, T))).astype(np.float32)
    m = mask(g)
    ids = None
    if packed:  # two sequences a row: the first half of the row and the second
        ids = (np.arange(B)[:, None] * 2 + (np.arange(T)[None, :] >= T // 2)).astype(np.int32)
    got = jax.jit(agreement_stats, static_argnums=4)(old, sampler, m, None if ids is None else jnp.asarray(ids),
                                                     None if ids is None else 2 * B)
    want = _agreement_reference(old, sampler, m, ids)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_agreement_stats_band_edges_are_ratios():
    """A ratio of 1.105 is outside [0.9, 1.1] and 0.905 is inside (not a symmetric log band)."""
    old = np.log(np.array([[1.105, 0.905, 1.0, 1.0]], np.float32))
    got = agreement_stats(old, np.zeros_like(old), np.ones_like(old))
    assert float(got["out_10"]) == pytest.approx(0.25)
    assert float(got["out_1"]) == pytest.approx(0.5)
    assert float(got["seq_out"]) == 0.0  # the row's product is 1.0
