"""Tests of recipes: presets, compute_advantages, policy_loss, policy_loss_from_rewards."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import (CISPO, DAPO, DR_GRPO, GRPO, LITE_PPO, PPO_BASELINE, PRESETS, SCALERL, AdvantageBatch,
                            LossTerms, Recipe, compute_advantages, policy_loss,
                            policy_loss_from_rewards)
from tests.core import reference as ref
from tests.core._helpers import B, FEW, G, T, assert_finite, logps, mask, rewards, rng, seeds

PRESET_OBJECTS = {"PPO_BASELINE": PPO_BASELINE, "GRPO": GRPO, "DAPO": DAPO, "DR_GRPO": DR_GRPO,
                  "LITE_PPO": LITE_PPO}
# DAPO's overlong punishment shortened to this test's lengths (max 24, buffer 8).
SHORT_DAPO = dataclasses.replace(DAPO, overlong_max_length=24, overlong_buffer_length=8)
DR_GRPO_T = dataclasses.replace(DR_GRPO, norm_length=float(T))
VARIANTS = {
    "PPO_BASELINE": PPO_BASELINE,
    "GRPO": GRPO,
    "DAPO": SHORT_DAPO,
    "DR_GRPO": DR_GRPO_T,
    "LITE_PPO": LITE_PPO,
    "GSPO": dataclasses.replace(GRPO, name="gspo", ratio_level="sequence", eps_low=3e-4,
                                eps_high=4e-4, kl_coef=0.0),
    "GRPO_dual_clip_k1_clamped": dataclasses.replace(GRPO, dual_clip=3.0, kl_kind="k1",
                                                     kl_clamp=0.5, kl_coef=0.05),
    "RLOO_seq_sum": dataclasses.replace(PPO_BASELINE, adv_estimator="rloo",
                                        loss_agg_mode="seq-mean-token-sum"),
    "LITE_PPO_entropy_tis": dataclasses.replace(LITE_PPO, entropy_coef=0.01, tis_cap=2.0),
    "DAPO_filter_exclude": dataclasses.replace(SHORT_DAPO, overlong_filter=True,
                                               exclude_constant_groups=True,
                                               dynamic_sampling=False),
    "CISPO": CISPO,
    "CISPO_absolute": dataclasses.replace(CISPO, cispo_cap_mode="absolute", eps_high=1.5, eps_low=0.2),
    "SCALERL": SCALERL,
    "SCALERL_filter_exclude": dataclasses.replace(SCALERL, overlong_filter=True, exclude_constant_groups=True,
                                                  dynamic_sampling=False),
    "SAPO": dataclasses.replace(GRPO, name="sapo", surrogate="sapo", kl_coef=0.0),
    "GSPO_token": dataclasses.replace(GRPO, name="gspo_token", ratio_level="sequence_token",
                                      eps_low=3e-4, eps_high=4e-4, kl_coef=0.0),
}
PROMPT_LEVEL = {"SCALERL", "SCALERL_filter_exclude"}


# ----------------------------------------------------------------------------- presets


def test_presets_follow_the_papers():
    assert (PPO_BASELINE.adv_estimator, PPO_BASELINE.adv_mean, PPO_BASELINE.adv_std) == (
        "normalized", "none", "none")
    assert (PPO_BASELINE.eps_low, PPO_BASELINE.eps_high) == (0.2, 0.2)
    assert PPO_BASELINE.loss_agg_mode == "seq-mean-token-mean" and PPO_BASELINE.kl_coef == 0.0

    assert (GRPO.adv_estimator, GRPO.adv_mean, GRPO.adv_std) == ("normalized", "group", "group")
    assert (GRPO.eps_low, GRPO.eps_high) == (0.2, 0.2)
    assert GRPO.loss_agg_mode == "seq-mean-token-mean"
    assert GRPO.kl_coef == pytest.approx(0.001) and GRPO.kl_kind == "k3"

    assert (DAPO.adv_mean, DAPO.adv_std) == ("group", "group")
    assert (DAPO.eps_low, DAPO.eps_high) == (0.2, 0.28)  # Clip-Higher
    assert DAPO.loss_agg_mode == "token-mean" and DAPO.kl_coef == 0.0
    assert DAPO.dynamic_sampling
    assert DAPO.overlong_penalty == 1.0
    assert (DAPO.overlong_max_length, DAPO.overlong_buffer_length) == (20480, 4096)

    assert (DR_GRPO.adv_mean, DR_GRPO.adv_std) == ("group", "none")
    assert DR_GRPO.loss_agg_mode == "seq-mean-token-sum-norm" and DR_GRPO.norm_length

    assert (LITE_PPO.adv_mean, LITE_PPO.adv_std) == ("group", "batch")
    assert (LITE_PPO.eps_low, LITE_PPO.eps_high) == (0.2, 0.2)
    assert LITE_PPO.loss_agg_mode == "token-mean" and LITE_PPO.kl_coef == 0.0
    assert not (LITE_PPO.overlong_filter or LITE_PPO.dynamic_sampling or LITE_PPO.overlong_penalty)
    for recipe in PRESET_OBJECTS.values():
        assert recipe.ratio_level == "token" and recipe.dual_clip is None


def test_cispo_and_scalerl_presets():
    assert (CISPO.surrogate, CISPO.cispo_cap_mode, CISPO.loss_agg_mode) == ("cispo", "relative", "token-mean")
    assert (CISPO.adv_mean, CISPO.adv_std) == ("group", "group") and CISPO.kl_coef == 0.0
    assert CISPO.eps_low == 1.0 and 1.0 + CISPO.eps_high == 5.0  # no lower bound, IS cap 5
    assert (SCALERL.surrogate, SCALERL.loss_agg_mode) == ("cispo", "prompt-mean-token-mean")
    assert (SCALERL.adv_mean, SCALERL.adv_std) == ("group", "batch") and SCALERL.dynamic_sampling
    assert PRESETS["cispo"] is CISPO and PRESETS["scalerl"] is SCALERL
    for name in ("ppo_baseline", "grpo", "dapo", "dr_grpo", "lite_ppo"):
        assert PRESETS[name].surrogate == "ppo"


@pytest.mark.parametrize("changes,knob", [
    (dict(surrogate="grpo"), "surrogate='grpo'"),
    (dict(surrogate="cispo", cispo_cap_mode="abs"), "cispo_cap_mode='abs'"),
    (dict(surrogate="cispo", cispo_cap_mode="absolute", eps_high=0.28), "eps_high=0.28"),
    (dict(surrogate="sapo", sapo_tau_neg=0.0), "sapo_tau_pos/sapo_tau_neg"),
    (dict(surrogate="sapo", ratio_level="sequence"), "ratio_level='sequence' needs surrogate='ppo'"),
    (dict(surrogate="cispo", dual_clip=3.0), "dual_clip=3.0 needs surrogate='ppo'"),
    (dict(ratio_level="seq"), "ratio_level='seq'"),
    (dict(loss_agg_mode="prompt-mean"), "loss_agg_mode='prompt-mean'"),
])
def test_recipe_validation_names_the_bad_knob(changes, knob):
    with pytest.raises(ValueError, match=re.escape(knob)):
        Recipe(name="bad", **changes)


def test_prompt_level_needs_lengths_and_denominator_weights():
    r, truncated, _ = _adv_inputs(0)
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(jnp.asarray(r), G, SCALERL)
    x, *_ = _loss_inputs(0)
    with pytest.raises(ValueError, match="denominator_weights"):
        policy_loss(SCALERL, advantages=jnp.ones(B), **{k: jnp.asarray(v) for k, v in x.items()})


def test_presets_dict_and_frozen_dataclass():
    assert set(PRESETS.values()) >= set(PRESET_OBJECTS.values())
    for name, recipe in PRESETS.items():
        assert isinstance(recipe, Recipe) and recipe.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        GRPO.eps_high = 0.28
    variant = dataclasses.replace(GRPO, eps_high=0.28)
    assert variant.eps_high == 0.28 and GRPO.eps_high == 0.2
    assert dataclasses.replace(GRPO) == GRPO and hash(dataclasses.replace(GRPO)) == hash(GRPO)


def test_recipe_defaults():
    r = Recipe(name="x", adv_estimator="normalized", adv_mean="group", adv_std="group",
               eps_low=0.2, eps_high=0.2, loss_agg_mode="token-mean")
    assert r.adv_eps == 1e-6 and r.dual_clip is None and r.ratio_level == "token"
    assert r.kl_coef == 0.0 and r.kl_kind == "k3" and r.entropy_coef == 0.0
    assert not (r.overlong_filter or r.dynamic_sampling or r.exclude_constant_groups)
    assert r.overlong_penalty == 0.0 and r.tis_cap is None and r.norm_length is None


# ----------------------------------------------------------------------------- advantages


def _adv_inputs(seed, kind=None):
    g = rng(seed)
    return rewards(g, kind=kind), g.random(B) < 0.3, g.integers(0, 30, size=B).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_compute(recipe, r, truncated, lengths):
    return compute_advantages(r, G, recipe, truncated=truncated, lengths=lengths)


def _compute(recipe, r, truncated, lengths):
    return _jitted_compute(recipe, jnp.asarray(r), jnp.asarray(truncated),
                           jnp.asarray(lengths))


def _check_batch(out, expected):
    assert isinstance(out, AdvantageBatch)
    for field in ["advantages", "shaped_rewards", "row_weights", "denominator_weights"]:
        np.testing.assert_allclose(np.asarray(getattr(out, field)), expected[field], rtol=2e-4,
                                   atol=2e-4, err_msg=field)


@FEW
@given(seed=seeds, name=st.sampled_from(sorted(VARIANTS)))
def test_compute_advantages_matches_reference(seed, name):
    recipe = VARIANTS[name]
    r, truncated, lengths = _adv_inputs(seed, kind=2)  # continuous: no constant group
    expected = ref.compute_advantages(r, G, recipe, truncated=truncated, lengths=lengths)
    _check_batch(_compute(recipe, r, truncated, lengths), expected)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_compute_advantages_with_constant_groups(name):
    recipe = VARIANTS[name]
    r = np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float32)
    truncated = np.array([0, 0, 0, 1, 0, 0, 1, 0], bool)
    lengths = np.full(B, 10, np.int32)  # below max - buffer: no soft penalty
    expected = ref.compute_advantages(r, G, recipe, truncated=truncated, lengths=lengths)
    _check_batch(_compute(recipe, r, truncated, lengths), expected)


def test_dapo_hand_values():
    # group 1 all correct but lengths (10, 20, 24, 30) -> penalties (0, -.5, -1, -1);
    # group 2 mixed, short. max 24, buffer 8: free up to 16, then -1/8 per token.
    r = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
    lengths = np.array([10, 20, 24, 30, 5, 5, 5, 5], np.int32)
    out = _compute(SHORT_DAPO, r, np.zeros(B, bool), lengths)
    np.testing.assert_allclose(np.asarray(out.shaped_rewards), [1, .5, 0, 0, 1, 0, 0, 0],
                               atol=1e-6)
    # group 2 is GRPO-normalised: (0.75, -.25 x3) / 0.5
    np.testing.assert_allclose(np.asarray(out.advantages)[4:], [1.5, -.5, -.5, -.5], atol=1e-5)
    # group 1 now has spread: (.625, .125, -.375, -.375) / std
    s = np.std([1, .5, 0, 0], ddof=1)
    np.testing.assert_allclose(np.asarray(out.advantages)[:4],
                               np.array([.625, .125, -.375, -.375]) / s, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.row_weights)[4:], 1.0)


def test_dapo_dynamic_sampling_uses_raw_correctness():
    """[DAPO] eq. (11) keeps groups with 0 < #correct < G: an all-correct group is dropped even
    if the soft overlong penalty spreads its shaped rewards (verl filters on `acc`)."""
    r = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
    lengths = np.array([10, 20, 24, 30, 5, 5, 5, 5], np.int32)
    out = _compute(SHORT_DAPO, r, np.zeros(B, bool), lengths)
    np.testing.assert_array_equal(np.asarray(out.row_weights), [0, 0, 0, 0, 1, 1, 1, 1])


def test_overlong_filtered_rows_still_count_in_the_statistics():
    recipe = dataclasses.replace(LITE_PPO, overlong_filter=True)
    r, _, lengths = _adv_inputs(0, kind=2)
    truncated = np.array([1, 0, 0, 0, 0, 1, 1, 0], bool)
    out = _compute(recipe, r, truncated, lengths)
    expected = ref.normalize_advantages(r, G, mean="group", std="batch")
    np.testing.assert_allclose(np.asarray(out.advantages), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.row_weights), 1.0 - truncated)


def test_reinforce_pp_advantages_are_batch_whitened():
    recipe = dataclasses.replace(PPO_BASELINE, adv_estimator="reinforce_pp")
    r, truncated, lengths = _adv_inputs(3, kind=2)
    adv = np.asarray(_compute(recipe, r, truncated, lengths).advantages, np.float64)
    assert_finite(adv)
    np.testing.assert_allclose(adv.mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv.std(), 1.0, atol=1e-3)


def test_soft_penalty_without_lengths_raises():
    with pytest.raises((ValueError, TypeError)):
        compute_advantages(jnp.zeros(B), G, SHORT_DAPO)


def test_overlong_filter_without_truncated_raises():
    with pytest.raises((ValueError, TypeError)):
        compute_advantages(jnp.zeros(B), G, dataclasses.replace(GRPO, overlong_filter=True))


# ----------------------------------------------------------------------------- policy loss


def _loss_inputs(seed, kind=2):
    g = rng(seed)
    logp, old = logps(g, spread=0.3)
    ref_logp = (logp + 0.2 * g.normal(size=(B, T))).astype(np.float32)
    sampler = (old + 0.5 * g.normal(size=(B, T))).astype(np.float32)
    entropy = g.uniform(0, 2, size=(B, T)).astype(np.float32)
    r, truncated, lengths = _adv_inputs(seed + 1, kind=kind)
    return dict(logp=logp, old_logp=old, mask=mask(g), ref_logp=ref_logp, sampler_logp=sampler,
                entropy=entropy), r, truncated, lengths


def _expected_loss(recipe, x, r, truncated, lengths):
    adv = ref.compute_advantages(r, G, recipe, truncated=truncated, lengths=lengths)
    return ref.policy_loss(recipe, advantages=adv["advantages"], row_weights=adv["row_weights"],
                           denominator_weights=adv["denominator_weights"], group_size=G, **x)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_from_rewards(recipe, x, r, truncated, lengths):
    return policy_loss_from_rewards(recipe, rewards=r, group_size=G, truncated=truncated,
                                    lengths=lengths, **x)


@FEW
@given(seed=seeds, name=st.sampled_from(sorted(VARIANTS)), kind=st.sampled_from([0, 2]))
def test_policy_loss_from_rewards_matches_reference(seed, name, kind):
    recipe = VARIANTS[name]
    x, r, truncated, lengths = _loss_inputs(seed, kind)
    if kind == 0:
        lengths = np.minimum(lengths, 16)  # raw == shaped constant groups (see DAPO test)
    if name in PROMPT_LEVEL:  # prompt weights count the loss mask's tokens
        lengths = x["mask"].sum(axis=1).astype(np.int32)
    terms, metrics = _jitted_from_rewards(recipe, {k: jnp.asarray(v) for k, v in x.items()},
                                          jnp.asarray(r), jnp.asarray(truncated),
                                          jnp.asarray(lengths))
    num, den = _expected_loss(recipe, x, r, truncated, lengths)
    assert isinstance(terms, LossTerms) and isinstance(metrics, dict)
    np.testing.assert_allclose(float(terms.numerator), num, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-6)
    np.testing.assert_allclose(float(terms.value), ref.loss_value(num, den), rtol=2e-4,
                               atol=2e-5)
    assert_finite(*metrics.values())


@functools.partial(jax.jit, static_argnums=0)
def _jitted_policy_loss(recipe, x, adv):
    return policy_loss(recipe, advantages=adv.advantages, row_weights=adv.row_weights,
                       denominator_weights=adv.denominator_weights, **x)


@pytest.mark.parametrize("name", ["DAPO", "DAPO_filter_exclude", "GRPO"])
def test_policy_loss_equals_compute_advantages_then_policy_loss(name):
    recipe = VARIANTS[name]
    x, r, truncated, lengths = _loss_inputs(5)
    x = {k: jnp.asarray(v) for k, v in x.items()}
    a = _compute(recipe, r, truncated, lengths)
    direct, _ = _jitted_policy_loss(recipe, x, a)
    composed, _ = _jitted_from_rewards(recipe, x, jnp.asarray(r), jnp.asarray(truncated),
                                       jnp.asarray(lengths))
    np.testing.assert_allclose(float(direct.value), float(composed.value), rtol=1e-5, atol=1e-7)


def test_grpo_hand_value_on_policy():
    # on-policy, ref == logp: r = 1, KL = 0; loss = mean over rows of -A_row.
    # rewards (1, 0, 0, 0 | 1, 1, 0, 0): A = (1.5, -.5, -.5, -.5 | .866, .866, -.866, -.866)
    # seq-mean-token-mean: sum(-A) / 8 = 0.
    logp = jnp.full((B, T), -1.0)
    m = jnp.ones((B, T))
    adv = jnp.array([1.5, -.5, -.5, -.5, .866, .866, -.866, -.866])
    terms, _ = policy_loss(GRPO, logp=logp, old_logp=logp, advantages=adv, mask=m, ref_logp=logp)
    np.testing.assert_allclose(float(terms.value), 0.0, atol=1e-6)
    # only row 0 counts: loss = -1.5
    m0 = jnp.zeros((B, T)).at[0].set(1.0)
    terms, _ = policy_loss(GRPO, logp=logp, old_logp=logp, advantages=adv, mask=m0,
                           ref_logp=logp)
    np.testing.assert_allclose(float(terms.value), -1.5, rtol=1e-6)


def test_kl_without_ref_logp_raises():
    x, _, _, _ = _loss_inputs(0)
    with pytest.raises(ValueError):
        policy_loss(GRPO, logp=jnp.asarray(x["logp"]), old_logp=jnp.asarray(x["old_logp"]),
                    advantages=jnp.zeros(B), mask=jnp.asarray(x["mask"]))


def test_entropy_bonus_without_entropy_raises():
    x, _, _, _ = _loss_inputs(0)
    with pytest.raises((ValueError, TypeError)):
        policy_loss(dataclasses.replace(LITE_PPO, entropy_coef=0.01),
                    logp=jnp.asarray(x["logp"]), old_logp=jnp.asarray(x["old_logp"]),
                    advantages=jnp.zeros(B), mask=jnp.asarray(x["mask"]))


# ----------------------------------------------------------------------------- micro-batches


@functools.partial(jax.jit, static_argnums=0)
def _full_and_split(recipe, x, adv):
    def full(lp):
        return policy_loss(recipe, advantages=adv.advantages, row_weights=adv.row_weights,
                           denominator_weights=adv.denominator_weights, **{**x, "logp": lp})[0]

    def split(lp):
        parts = []
        for i in range(0, B, 2):
            sl = slice(i, i + 2)
            xi = {k: v[sl] for k, v in {**x, "logp": lp}.items()}
            parts.append(policy_loss(recipe, advantages=adv.advantages[sl],
                                     row_weights=adv.row_weights[sl],
                                     denominator_weights=adv.denominator_weights[sl], **xi)[0])
        return sum(p.numerator for p in parts) / sum(p.denominator for p in parts)

    return full(x["logp"]).value, split(x["logp"]), jax.grad(lambda lp: full(lp).value)(
        x["logp"]), jax.grad(split)(x["logp"])


@pytest.mark.parametrize("name", ["GRPO", "DR_GRPO", "GSPO", "DAPO_filter_exclude", "SCALERL",
                                  "SCALERL_filter_exclude", "CISPO", "SAPO", "GSPO_token"])
def test_micro_batches_of_one_group_half_equal_the_full_batch(name):
    recipe = VARIANTS[name]
    x, r, truncated, lengths = _loss_inputs(7, kind=0)
    lengths = x["mask"].sum(axis=1).astype(np.int32) if name in PROMPT_LEVEL else np.minimum(lengths, 20)
    x = {k: jnp.asarray(v) for k, v in x.items()}
    adv = _compute(recipe, r, truncated, lengths)
    vf, vs, gf, gs = _full_and_split(recipe, x, adv)
    np.testing.assert_allclose(float(vs), float(vf), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gf), rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------- degenerate input


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grad(recipe, x, r, truncated, lengths):
    def value(lp):
        return policy_loss_from_rewards(recipe, rewards=r, group_size=G, truncated=truncated,
                                        lengths=lengths, **{**x, "logp": lp})[0].value

    return jax.value_and_grad(value)(x["logp"])


@pytest.mark.parametrize("name", ["DAPO", "DAPO_filter_exclude", "DR_GRPO", "GRPO",
                                  "GRPO_dual_clip_k1_clamped", "GSPO", "LITE_PPO_entropy_tis",
                                  "PPO_BASELINE", "CISPO", "SCALERL", "SAPO", "GSPO_token"])
def test_degenerate_batches_are_finite(name):
    recipe = VARIANTS[name]
    x, _, truncated, lengths = _loss_inputs(11)
    g = rng(12)
    cases = {
        "all_masked": dict(mask=np.zeros((B, T), np.float32)),
        "extreme_logp": dict(logp=(x["old_logp"] + g.choice([-60.0, 60.0], size=(B, T))
                                   ).astype(np.float32)),
        "zero_length_rows": dict(mask=np.where(np.arange(B)[:, None] % 2 == 0, 0.0,
                                               x["mask"]).astype(np.float32)),
    }
    for case, override in cases.items():
        xi = {k: jnp.asarray(v) for k, v in {**x, **override}.items()}
        for r in [np.full(B, 0.3, np.float32), np.zeros(B, np.float32), rewards(g, kind=0)]:
            v, grad = _value_and_grad(recipe, xi, jnp.asarray(r), jnp.asarray(truncated),
                                      jnp.asarray(lengths))
            assert_finite(v, grad)
            if case == "all_masked":
                assert float(v) == 0.0, (case, r)


# ----------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("name", ["GRPO", "DAPO"])
def test_policy_loss_from_rewards_under_vmap(name):
    recipe = VARIANTS[name]
    items = [_loss_inputs(s, kind=0) for s in (20, 21)]
    x = {k: jnp.stack([jnp.asarray(it[0][k]) for it in items]) for k in items[0][0]}
    r, truncated, lengths = (jnp.stack([jnp.asarray(it[i]) for it in items]) for i in (1, 2, 3))

    def value(xi, ri, ti, li):
        return policy_loss_from_rewards(recipe, rewards=ri, group_size=G, truncated=ti,
                                        lengths=li, **xi)[0].value

    batched = jax.jit(jax.vmap(value))(x, r, truncated, lengths)
    for i in range(2):
        single = _jitted_from_rewards(recipe, {k: v[i] for k, v in x.items()}, r[i],
                                      truncated[i], lengths[i])[0].value
        np.testing.assert_allclose(float(batched[i]), float(single), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- padding, options


@pytest.mark.parametrize("name", ["GRPO", "GSPO", "LITE_PPO_entropy_tis"])
def test_masked_padding_columns_change_nothing(name):
    """Two extra columns with mask 0 and garbage log-probs/entropies leave the loss unchanged."""
    recipe = VARIANTS[name]
    x, r, truncated, lengths = _loss_inputs(30)
    g = rng(31)
    padded = {k: np.concatenate([v, g.uniform(-50, 0, size=(B, 2)).astype(np.float32)], axis=1)
              for k, v in x.items()}
    padded["mask"] = np.concatenate([x["mask"], np.zeros((B, 2), np.float32)], axis=1)
    args = (jnp.asarray(r), jnp.asarray(truncated), jnp.asarray(lengths))
    a = _jitted_from_rewards(recipe, {k: jnp.asarray(v) for k, v in x.items()}, *args)[0]
    b = _jitted_from_rewards(recipe, {k: jnp.asarray(v) for k, v in padded.items()}, *args)[0]
    np.testing.assert_allclose(float(b.numerator), float(a.numerator), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(b.denominator), float(a.denominator))


def test_tis_needs_sampler_logp_else_it_is_off():
    x, r, truncated, lengths = _loss_inputs(40)
    x = {k: jnp.asarray(v) for k, v in x.items() if k != "sampler_logp"}
    a = _compute(LITE_PPO, r, truncated, lengths)
    with_cap, _ = _jitted_policy_loss(dataclasses.replace(LITE_PPO, tis_cap=2.0), x, a)
    without, _ = _jitted_policy_loss(LITE_PPO, x, a)
    np.testing.assert_allclose(float(with_cap.value), float(without.value), rtol=1e-6)


def test_dr_grpo_without_norm_length_raises():
    x, _, _, _ = _loss_inputs(0)
    with pytest.raises(ValueError):
        policy_loss(dataclasses.replace(DR_GRPO, norm_length=None),
                    logp=jnp.asarray(x["logp"]), old_logp=jnp.asarray(x["old_logp"]),
                    advantages=jnp.zeros(B), mask=jnp.asarray(x["mask"]))


def test_rows_excluded_as_constant_groups_carry_no_kl_or_entropy():
    """exclude_constant_groups leaves a constant group out of the denominators; its KL and entropy
    terms must leave the numerator too (they stayed there, uncounted). The loss does not move when
    the reference log-probs or entropies of that group's rows change."""
    from jaxrl4llm.core import LITE_PPO, compute_advantages, policy_loss

    recipe = dataclasses.replace(LITE_PPO, exclude_constant_groups=True, kl_coef=0.5, entropy_coef=0.1)
    rng = np.random.default_rng(0)
    r = np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float32)  # group 0 constant
    b, t = 8, 5
    logp = jnp.asarray(-rng.random((b, t)), jnp.float32)
    mask = jnp.ones((b, t), jnp.float32)
    adv = compute_advantages(jnp.asarray(r), 4, recipe)

    def loss(ref_shift, entropy_shift):
        ref = logp - 0.1 + jnp.zeros((b, t)).at[:4].set(ref_shift)
        ent = jnp.ones((b, t)) + jnp.zeros((b, t)).at[:4].set(entropy_shift)
        terms, _ = policy_loss(recipe, logp=logp, old_logp=logp, advantages=adv.advantages, mask=mask,
                               row_weights=adv.row_weights, denominator_weights=adv.denominator_weights,
                               ref_logp=ref, entropy=ent)
        return float(terms.numerator / terms.denominator)

    assert np.asarray(adv.denominator_weights)[:4].sum() == 0 and np.asarray(adv.row_weights)[:4].all()
    assert loss(0.0, 0.0) == pytest.approx(loss(-2.0, 3.0), abs=1e-7)
