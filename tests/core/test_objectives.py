"""Tests of the objectives beyond the clipped PPO surrogate: CISPO (both cap conventions), SAPO,
GSPO vs GSPO-token, against the float64 references and their defining properties."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from jaxrl4llm.core import cispo_surrogate, clipped_surrogate, sapo_gate, sapo_surrogate
from tests.core import reference as ref
from tests.core._helpers import B, FAST, T, assert_finite, logps, mask, rng, seeds


def _inputs(seed, per_token_adv=False, spread=0.5):
    g = rng(seed)
    logp, old = logps(g, spread=spread)
    adv = g.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    return logp, old, adv, mask(g)


def _with_grad(fn):
    """(loss, stats, d sum(loss) / d logp) of a per-token surrogate."""
    def run(logp, old, adv, m, **kw):
        def total(x):
            loss, stats = fn(x, old, adv, m, **kw)
            return jnp.sum(loss), (loss, stats)
        grad, (loss, stats) = jax.grad(total, has_aux=True)(logp)
        return loss, stats, grad
    return run


_cispo = jax.jit(_with_grad(cispo_surrogate), static_argnames=("eps_low", "eps_high", "cap_mode"))
_sapo = jax.jit(_with_grad(sapo_surrogate), static_argnames=("tau_pos", "tau_neg"))
_ppo = jax.jit(_with_grad(clipped_surrogate),
               static_argnames=("eps_low", "eps_high", "dual_clip", "ratio_level"))


def _np(loss, stats, grad):
    return np.asarray(loss), stats, np.asarray(grad)


# ----------------------------------------------------------------------------- CISPO

# (eps_low, eps_high, cap_mode): the paper's no-lower-bound relative form, a verl-style
# two-sided relative form, TRL's absolute cap. Fixed set: every static value is a compile.
CISPO_KW = st.sampled_from([(1.0, 0.28, "relative"), (0.2, 0.28, "relative"), (1.0, 1.5, "absolute")])


@FAST
@given(seed=seeds, kw=CISPO_KW, per_token_adv=st.booleans())
def test_cispo_matches_reference_value_and_gradient(seed, kw, per_token_adv):
    logp, old, adv, m = _inputs(seed, per_token_adv, spread=0.6)
    kw = dict(eps_low=kw[0], eps_high=kw[1], cap_mode=kw[2])
    loss, _, grad = _np(*_cispo(*map(jnp.asarray, (logp, old, adv, m)), **kw))
    exp_loss, exp_grad = ref.cispo_surrogate(logp, old, adv, m, **kw)
    np.testing.assert_allclose(loss, exp_loss, rtol=1e-4, atol=1e-5)
    # d loss / d logp = -clip(r) A, away from the clip bounds (where jnp.clip's kink is).
    np.testing.assert_allclose(grad, exp_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(loss[m == 0], 0.0)
    np.testing.assert_array_equal(grad[m == 0], 0.0)


@FAST
@given(seed=seeds)
def test_cispo_keeps_a_gradient_where_the_ppo_clip_binds(seed):
    """Tokens whose PPO clip binds get 0 from PPO and -clip(r)·A != 0 from CISPO."""
    logp, old, adv, m = _inputs(seed, spread=1.0)
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))
    _, _, g_ppo = _np(*_ppo(*args, eps_low=0.2, eps_high=0.28, dual_clip=None, ratio_level="token"))
    _, stats, g_cispo = _np(*_cispo(*args, eps_low=0.2, eps_high=0.28, cap_mode="relative"))
    r = ref.ratio(logp, old)
    a = np.repeat(adv[:, None], T, axis=1)
    binds = (m > 0) & (a != 0) & (((a > 0) & (r > 1.28 + 1e-3)) | ((a < 0) & (r < 0.8 - 1e-3)))
    np.testing.assert_array_equal(g_ppo[binds], 0.0)
    assert np.all(g_cispo[binds] != 0.0)
    np.testing.assert_allclose(g_cispo[binds], -np.clip(r, 0.8, 1.28)[binds] * a[binds], rtol=1e-4)
    clipped = (m > 0) & ((r < 0.8) | (r > 1.28))
    np.testing.assert_allclose(float(stats.clip_frac), clipped.sum() / max(m.sum(), 1), atol=1e-6)


@FAST
@given(seed=seeds, kw=CISPO_KW, per_token_adv=st.booleans())
def test_cispo_on_policy_gradient_is_reinforce(seed, kw, per_token_adv):
    """r = 1: the CISPO gradient is -A·m, that of REINFORCE and of PPO."""
    logp, _, adv, m = _inputs(seed, per_token_adv)
    args = tuple(map(jnp.asarray, (logp, logp, adv, m)))
    _, _, g = _np(*_cispo(*args, eps_low=kw[0], eps_high=kw[1], cap_mode=kw[2]))
    _, _, g_ppo = _np(*_ppo(*args, eps_low=0.2, eps_high=0.28, dual_clip=None, ratio_level="token"))
    a = adv if per_token_adv else np.repeat(adv[:, None], T, axis=1)
    np.testing.assert_allclose(g, -a * m, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g, g_ppo, rtol=1e-6, atol=1e-7)


def test_cispo_cap_conventions_hand_values():
    # r = 0.5, 1, 3, 8 with A = 1, logp = log r (old = 0).
    r = np.array([[0.5, 1.0, 3.0, 8.0]])
    logp = jnp.asarray(np.log(r), jnp.float32)
    args = (logp, jnp.zeros_like(logp), jnp.ones((1,)), jnp.ones_like(logp))
    # relative (verl): upper bound 1 + 4 = 5, no lower bound (eps_low = 1) -> weights .5 1 3 5
    _, stats, g = _cispo(*args, eps_low=1.0, eps_high=4.0, cap_mode="relative")
    np.testing.assert_allclose(np.asarray(g), [[-0.5, -1.0, -3.0, -5.0]], rtol=1e-5)
    np.testing.assert_allclose(float(stats.clip_frac_high), 0.25)
    np.testing.assert_allclose(float(stats.clip_frac_low), 0.0)
    # absolute (TRL epsilon_high = 5.0): the same weights from the cap itself
    _, _, g = _cispo(*args, eps_low=1.0, eps_high=5.0, cap_mode="absolute")
    np.testing.assert_allclose(np.asarray(g), [[-0.5, -1.0, -3.0, -5.0]], rtol=1e-5)
    # relative eps_high = 0.28 and eps_low = 0.2: weights .8 1 1.28 1.28
    _, stats, g = _cispo(*args, eps_low=0.2, eps_high=0.28, cap_mode="relative")
    np.testing.assert_allclose(np.asarray(g), [[-0.8, -1.0, -1.28, -1.28]], rtol=1e-5)
    np.testing.assert_allclose(float(stats.clip_frac), 0.75)


def test_cispo_rejects_bad_bounds():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="cap_mode"):
        cispo_surrogate(x, x, jnp.ones((1,)), x + 1, cap_mode="ratio")
    with pytest.raises(ValueError, match="upper bound"):
        cispo_surrogate(x, x, jnp.ones((1,)), x + 1, eps_high=0.5, cap_mode="absolute", eps_low=0.2)


@pytest.mark.parametrize("spread", [60.0, 1e4])
def test_cispo_and_sapo_extreme_log_ratios_are_finite(spread):
    logp, old, adv, m = _inputs(3, spread=spread)
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))
    loss, stats, g = _cispo(*args, eps_low=1.0, eps_high=1.5, cap_mode="absolute")
    assert_finite(loss, g, *stats)
    loss, stats, g = _sapo(*args, tau_pos=1.0, tau_neg=1.05)
    assert_finite(loss, g, *stats)


# ----------------------------------------------------------------------------- SAPO

TAUS = st.sampled_from([(1.0, 1.05), (0.5, 2.0)])


@FAST
@given(seed=seeds, taus=TAUS, per_token_adv=st.booleans())
@example(seed=554431908, taus=(0.5, 2.0), per_token_adv=False)  # a float32 gradient 1.08e-6 off (CI, 2026-11-28)
def test_sapo_matches_reference_value_and_gradient(seed, taus, per_token_adv):
    """Against the float64 reference; float32 tolerances: gradients of order 1 lose ~1e-6 absolute
    to cancellation (an element of 4e-4 came out 1.08e-6 off), as the loss does (atol 1e-5 both)."""
    logp, old, adv, m = _inputs(seed, per_token_adv, spread=0.6)
    loss, _, grad = _np(*_sapo(*map(jnp.asarray, (logp, old, adv, m)), tau_pos=taus[0], tau_neg=taus[1]))
    exp_loss, exp_grad = ref.sapo_surrogate(logp, old, adv, m, tau_pos=taus[0], tau_neg=taus[1])
    np.testing.assert_allclose(loss, exp_loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grad, exp_grad, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(loss[m == 0], 0.0)


@FAST
@given(seed=seeds, taus=TAUS, per_token_adv=st.booleans())
def test_sapo_on_policy_gradient_is_reinforce(seed, taus, per_token_adv):
    """r = 1: f'(1) = 1, so d loss / d logp = -A·m (the unclipped gradient)."""
    logp, _, adv, m = _inputs(seed, per_token_adv)
    _, _, g = _np(*_sapo(*map(jnp.asarray, (logp, logp, adv, m)), tau_pos=taus[0], tau_neg=taus[1]))
    a = adv if per_token_adv else np.repeat(adv[:, None], T, axis=1)
    np.testing.assert_allclose(g, -a * m, rtol=1e-5, atol=1e-6)


@FAST
@given(tau=st.floats(0.1, 10.0), r=st.floats(0.0, 5.0))
def test_sapo_gate_derivative_is_one_at_one_and_decays_away(tau, r):
    d = jax.grad(lambda x: sapo_gate(x, tau))
    np.testing.assert_allclose(float(d(1.0)), 1.0, rtol=1e-5)
    # f'(r) = 4 s (1 - s) <= 1, decreasing in |r - 1|
    assert float(d(r)) <= 1.0 + 1e-6
    far = 1.0 + 2.0 * (r - 1.0)
    assert float(d(far)) <= float(d(r)) + 1e-6


def test_sapo_gate_decays_for_ratios_far_from_one():
    d = jax.grad(lambda x: sapo_gate(x, 1.0))
    weights = [float(d(1.0 + k)) for k in (0.0, 1.0, 3.0, 10.0, 30.0)]
    assert all(a > b for a, b in zip(weights, weights[1:]))
    assert weights[-1] < 1e-10


@pytest.mark.parametrize("r", [1.5, 3.0, 0.5, 0.1])
def test_sapo_larger_negative_temperature_decays_negative_tokens_faster(r):
    """tau_neg > tau_pos: the per-token gradient weight r·f'(r) of an A < 0 token is smaller than
    that of an A > 0 token at the same ratio r != 1 (and both are 1 at r = 1)."""
    logp = jnp.log(jnp.array([[r, r, 1.0, 1.0]], jnp.float32))
    adv = jnp.array([[1.0, -1.0, 1.0, -1.0]])
    _, _, g = _sapo(logp, jnp.zeros_like(logp), adv, jnp.ones_like(logp), tau_pos=1.0, tau_neg=2.0)
    w = np.abs(np.asarray(g))[0]
    assert w[1] < w[0]
    np.testing.assert_allclose(w[2:], [1.0, 1.0], rtol=1e-6)


# ----------------------------------------------------------------------------- GSPO / GSPO-token


def _seq_kw(level):
    return dict(eps_low=0.2, eps_high=0.28, dual_clip=None, ratio_level=level)


@FAST
@given(seed=seeds)
def test_gspo_token_equals_gspo_for_row_constant_advantages(seed):
    """A per-token but constant across each row: same loss and gradient (GSPO paper, Sec. 4.3)."""
    logp, old, adv_row, m = _inputs(seed, spread=0.3)
    adv = np.repeat(adv_row[:, None], T, axis=1)
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))
    l_seq, s_seq, g_seq = _np(*_ppo(*args, **_seq_kw("sequence")))
    l_tok, s_tok, g_tok = _np(*_ppo(*args, **_seq_kw("sequence_token")))
    np.testing.assert_allclose(l_tok, l_seq, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(s_tok.ratio_mean), float(s_seq.ratio_mean), rtol=1e-6)
    np.testing.assert_allclose(g_seq, ref.surrogate_grad(logp, old, adv, m, **_seq_kw("sequence")),
                               rtol=1e-4, atol=1e-6)


@FAST
@given(seed=seeds, level=st.sampled_from(["sequence", "sequence_token"]))
def test_gspo_levels_match_reference_with_per_token_advantages(seed, level):
    """Values equal s_i on every token at both levels; gradients differ: GSPO mixes the row's
    advantages through the mean log-ratio, GSPO-token keeps -s_i·A_t per token."""
    logp, old, adv, m = _inputs(seed, per_token_adv=True, spread=0.3)
    loss, _, grad = _np(*_ppo(*map(jnp.asarray, (logp, old, adv, m)), **_seq_kw(level)))
    exp_loss, _ = ref.clipped_surrogate(logp, old, adv, m, **_seq_kw(level))
    np.testing.assert_allclose(loss, exp_loss, rtol=1e-4, atol=1e-5)
    r = ref.ratio(logp, old, m, "sequence")
    far = (np.abs(r - 0.8) > 1e-3) & (np.abs(r - 1.28) > 1e-3)
    rows = np.all(far, axis=1)
    exp_grad = ref.surrogate_grad(logp, old, adv, m, **_seq_kw(level))
    np.testing.assert_allclose(grad[rows], exp_grad[rows], rtol=1e-4, atol=1e-6)


def test_gspo_token_gradient_is_per_token():
    # one row, s = exp(mean(0.1, -0.1)) = 1, A = (2, -1): GSPO-token -> (-2, 1); GSPO -> -(1/2)(1) each
    logp = jnp.array([[0.1, -0.1]])
    args = (logp, jnp.zeros_like(logp), jnp.array([[2.0, -1.0]]), jnp.ones_like(logp))
    _, _, g = _ppo(*args, **_seq_kw("sequence_token"))
    np.testing.assert_allclose(np.asarray(g), [[-2.0, 1.0]], rtol=1e-5)
    _, _, g = _ppo(*args, **_seq_kw("sequence"))
    np.testing.assert_allclose(np.asarray(g), [[-0.5, -0.5]], rtol=1e-5)


@pytest.mark.parametrize("fn,kw", [
    (cispo_surrogate, dict(eps_low=1.0, eps_high=4.0)),
    (sapo_surrogate, dict(tau_pos=1.0, tau_neg=1.05)),
    (clipped_surrogate, dict(ratio_level="sequence_token")),
])
def test_under_vmap(fn, kw):
    xs = [_inputs(s) for s in range(3)]
    logp, old, adv, m = (jnp.asarray(np.stack(a)) for a in zip(*xs))
    f = functools.partial(fn, **kw)
    loss, _ = jax.jit(jax.vmap(f))(logp, old, adv, m)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(loss[i]), np.asarray(f(logp[i], old[i], adv[i], m[i])[0]),
                                   rtol=1e-6)


@FAST
@given(seed=seeds, gap=st.floats(20.5, 80.0), sign=st.sampled_from([1.0, -1.0]), per_token_adv=st.booleans())
def test_gspo_levels_agree_beyond_the_log_ratio_clamp(seed, gap, sign, per_token_adv):
    """Rows whose mean log-ratio is past ±20: both levels clamp it, and both give those rows zero
    gradient (GSPO-token too, which would otherwise push -s_i·A_t = e^20·|A| on A < 0 tokens);
    the other rows keep their usual gradient, equal at both levels for row-constant A."""
    logp, old, adv, m = _inputs(seed, per_token_adv=per_token_adv, spread=0.3)
    m[:, 0] = 1.0  # every row counted
    far = np.arange(B) % 2 == 0
    logp[far] = old[far] + sign * gap
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))
    l_seq, _, g_seq = _np(*_ppo(*args, **_seq_kw("sequence")))
    l_tok, _, g_tok = _np(*_ppo(*args, **_seq_kw("sequence_token")))
    assert_finite(l_seq, l_tok, g_seq, g_tok)
    np.testing.assert_allclose(l_tok, l_seq, rtol=1e-6)
    np.testing.assert_array_equal(g_seq[far], 0.0)
    np.testing.assert_array_equal(g_tok[far], 0.0)
    for level, g in (("sequence", g_seq), ("sequence_token", g_tok)):
        exp_grad = ref.surrogate_grad(logp, old, adv, m, **_seq_kw(level))
        r = ref.ratio(logp, old, m, "sequence")
        away = ~far & np.all((np.abs(r - 0.8) > 1e-3) & (np.abs(r - 1.28) > 1e-3), axis=1)
        np.testing.assert_allclose(g[away], exp_grad[away], rtol=1e-4, atol=1e-6)
    if not per_token_adv:
        np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-7)


def test_gspo_token_gradient_past_the_clamp_hand_values():
    # one row, log-ratio 25 on both tokens, A = -1: value -A·e^20 per token at both levels;
    # gradient 0 at both (before, GSPO-token gave -A·e^20 = 4.85e8 per token)
    logp = jnp.array([[25.0, 25.0], [0.1, -0.1]])
    args = (logp, jnp.zeros_like(logp), jnp.array([-1.0, 2.0]), jnp.ones_like(logp))
    for level in ("sequence", "sequence_token"):
        loss, _, g = _np(*_ppo(*args, **_seq_kw(level)))
        np.testing.assert_allclose(loss[0], [np.exp(20.0)] * 2, rtol=1e-6)
        np.testing.assert_array_equal(g[0], [0.0, 0.0])
        # s = 1 in row 1: -A·s per token at both levels
        np.testing.assert_allclose(g[1], [-2.0, -2.0], rtol=1e-5, err_msg=level)
