"""Tests of core/distill.py (on-policy distillation): advantages and metrics against float64 loops,
the gradient each loss kind gives in exact expectation (float64), teacher == student, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl4llm.core import (
    DISTILL_LOSS_KINDS,
    distill_advantages,
    distill_loss,
    ppo_clip_loss,
    teacher_kl_metrics,
    teacher_log_ratio,
)
from tests.core import reference as ref
from tests.core._helpers import FEW, rng, seeds

SHAPES = [(1, 1), (4, 8)]  # (B, T): few shapes, one compile each per static option
LAYOUTS = ["right", "left", "holes", "mixed"]
U1 = settings(max_examples=20, deadline=None)


def opd_mask(r, b, t, layout):
    """[B, T] float masks: right-padded, left-padded, holed (tool tokens) or a mix; empty rows too."""
    rows = []
    for _ in range(b):
        kind = layout if layout != "mixed" else ["right", "left", "holes", "empty"][r.integers(4)]
        n = 0 if kind == "empty" else int(r.integers(0, t + 1))
        if kind == "holes":
            row = (r.random(t) < 0.6).astype(np.float32)
        else:
            row = (np.arange(t) < n).astype(np.float32)
            row = row[::-1].copy() if kind == "left" else row
        rows.append(row)
    return np.stack(rows)


def opd_logps(r, m, spread=1.0):
    """(student, teacher) log-probs on the counted tokens; garbage (nan / -inf) elsewhere, which must not leak."""
    student = -r.exponential(1.0, size=m.shape)
    teacher = student + spread * r.normal(size=m.shape)
    student = np.where(m > 0, student, np.nan).astype(np.float32)
    teacher = np.where(m > 0, teacher, -np.inf).astype(np.float32)
    return student, teacher


@functools.partial(jax.jit, static_argnames="discount")
def _advantages(rows, student, teacher, m, coef, clip, *, discount):
    return distill_advantages(rows, student, teacher, m, coef=coef, discount=discount, clip=clip)


_metrics = jax.jit(teacher_kl_metrics, static_argnames="num_bins")
_log_ratio = jax.jit(teacher_log_ratio)
_loss = jax.jit(distill_loss, static_argnames="kind")


# ----------------------------------------------------------------------------- U1: float64 oracles


@U1
@given(seed=seeds, shape=st.sampled_from(SHAPES), layout=st.sampled_from(LAYOUTS),
       coef=st.floats(0.0, 3.0), discount=st.sampled_from([0.0, 0.5, 1.0]),
       clip=st.sampled_from([None, 0.05, 0.5]), with_rows=st.booleans())
def test_advantages_match_reference(seed, shape, layout, coef, discount, clip, with_rows):
    r = rng(seed)
    m = opd_mask(r, *shape, layout)
    student, teacher = opd_logps(r, m)
    rows = r.normal(size=shape[0]).astype(np.float32) if with_rows else None
    out = np.asarray(_advantages(rows, student, teacher, m, coef, clip, discount=discount))
    assert out.dtype == np.float32 and out.shape == shape
    expected = ref.distill_advantages(rows, student, teacher, m, coef=coef, discount=discount, clip=clip)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
    assert np.all(out[m == 0] == 0.0)  # exactly 0 off the counted tokens, whatever they hold


@U1
@given(seed=seeds, shape=st.sampled_from(SHAPES), layout=st.sampled_from(LAYOUTS),
       num_bins=st.sampled_from([3, 10]))
def test_metrics_match_reference(seed, shape, layout, num_bins):
    r = rng(seed)
    m = opd_mask(r, *shape, layout)
    student, teacher = opd_logps(r, m)
    out = _metrics(student, teacher, m, num_bins=num_bins)
    expected = ref.teacher_kl_metrics(student, teacher, m, num_bins=num_bins)
    for key, value in expected.items():
        got = np.asarray(out[key])
        assert got.dtype == np.float32 and got.shape == np.shape(value), key
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_array_equal(np.asarray(_log_ratio(student, teacher, m))[m == 0], 0.0)


def test_position_bins_by_hand():
    """Left-padded row with n=4: ranks 0,1 -> bin 0, ranks 2,3 -> bin 1 (floor(2j/4)); n=3: floor(2j/3) = 0,0,1."""
    m = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], np.float32)
    teacher = np.zeros((2, 6), np.float32)
    student = np.array([[9, 9, 1, 2, 3, 4], [10, 20, 30, 9, 9, 9]], np.float32)
    out = _metrics(student, teacher, m, num_bins=2)
    np.testing.assert_allclose(np.asarray(out["teacher_kl_by_position"]), [(1 + 2 + 10 + 20) / 4, (3 + 4 + 30) / 3])
    np.testing.assert_array_equal(np.asarray(out["teacher_tokens_by_position"]), [4, 3])
    np.testing.assert_allclose(float(out["teacher_kl"]), (1 + 2 + 3 + 4 + 10 + 20 + 30) / 7, rtol=1e-6)


def test_left_and_right_padding_agree():
    """The same responses right- or left-padded: the same advantages on their tokens, the same metrics."""
    r = rng(7)
    lengths = np.array([0, 3, 8, 5])
    right = (np.arange(8)[None, :] < lengths[:, None]).astype(np.float32)
    left = right[:, ::-1].copy()
    student, teacher = opd_logps(r, right)
    shift = lambda x, b: np.roll(x[b], 8 - lengths[b])  # right layout -> left layout
    student_l = np.stack([shift(student, b) for b in range(4)])
    teacher_l = np.stack([shift(teacher, b) for b in range(4)])
    rows = r.normal(size=4).astype(np.float32)
    a_right = np.asarray(_advantages(rows, student, teacher, right, 0.7, 0.4, discount=0.5))
    a_left = np.asarray(_advantages(rows, student_l, teacher_l, left, 0.7, 0.4, discount=0.5))
    np.testing.assert_allclose(np.stack([shift(a_right, b) for b in range(4)]), a_left, rtol=1e-6, atol=1e-7)
    m_right, m_left = _metrics(student, teacher, right, num_bins=10), _metrics(student_l, teacher_l, left, num_bins=10)
    for key in m_right:
        np.testing.assert_allclose(np.asarray(m_right[key]), np.asarray(m_left[key]), rtol=1e-6, err_msg=key)


# ----------------------------------------------------------------------------- U2: exact expectations


def _sample_grads(z, log_q, per_sample_loss):
    """J[y, :] = grad_z loss(y) for every token y of the vocabulary: the student's log-prob of y
    differentiated, the sampling distribution held fixed (what back-propagating a sampled token's
    loss does). Expectations are then sum_y p(y)·J[y, :]."""
    def losses(z):
        logp = jax.nn.log_softmax(z)[:, None]  # [V, 1]: one row per possible sample y
        return per_sample_loss(logp, log_q[:, None])[:, 0]
    return jax.jacrev(losses)(z)


@jax.jit
def _kind_sample_grads(z, log_q):
    """{kind: [V, V] per-sample gradients of distill_loss(kind)} (one compile per vocabulary size)."""
    return {kind: _sample_grads(z, log_q, functools.partial(distill_loss, kind=kind)) for kind in DISTILL_LOSS_KINDS}


@jax.jit
def _advantage_and_k2_sample_grads(z, log_q, coef):
    """Per-sample gradients of -A·log p(y) (A = distill_advantages, computed from the differentiated
    log p: its stop-gradient matters) and of the k2 loss."""
    ones = jnp.ones((z.shape[0], 1), z.dtype)
    advantage_loss = lambda logp, lq: -distill_advantages(None, logp, lq, ones, coef=coef) * logp
    return (_sample_grads(z, log_q, advantage_loss),
            _sample_grads(z, log_q, functools.partial(distill_loss, kind="k2")))


def _case(seed, vocab, scale):
    r = rng(seed)
    z = r.normal(size=vocab) * scale
    q = ref.softmax(r.normal(size=vocab) * scale)
    return z, q, ref.softmax(z)


def _float64(z, q):
    return jnp.asarray(z, jnp.float64), jnp.log(jnp.asarray(q, jnp.float64))


CASES = dict(seed=seeds, vocab=st.sampled_from([3, 12]), scale=st.sampled_from([0.3, 1.0, 2.0]))


@FEW
@given(**CASES)
def test_loss_kinds_expected_gradients(seed, vocab, scale):
    """sum_y p(y) grad_z loss(y): k1 -> 0, k2 -> grad KL(p||q), k3 -> grad KL(q||p) (1e-12, float64)."""
    z, q, p = _case(seed, vocab, scale)
    reverse, forward = ref.reverse_kl_logit_grad(z, q), ref.forward_kl_logit_grad(z, q)
    assert np.max(np.abs(reverse - forward)) > 1e-6  # the two directions differ: the test discriminates
    with jax.enable_x64(True):
        grads = {kind: np.asarray(g) for kind, g in _kind_sample_grads(*_float64(z, q)).items()}
    assert all(g.dtype == np.float64 for g in grads.values())
    expected = {kind: p @ g for kind, g in grads.items()}
    # k1: every sample has a gradient, their expectation is 0
    assert np.max(np.abs(grads["k1"])) > 1e-3
    np.testing.assert_allclose(expected["k1"], 0.0, atol=1e-12)
    # k2 (= mse): the reverse KL's gradient, not the forward one
    for kind in ("k2", "mse"):
        np.testing.assert_allclose(expected[kind], reverse, rtol=0, atol=1e-12, err_msg=kind)
        assert np.max(np.abs(expected[kind] - forward)) > 1e-6
    # k3 (= low_var_kl): the FORWARD KL's gradient, not the reverse one
    for kind in ("k3", "low_var_kl"):
        np.testing.assert_allclose(expected[kind], forward, rtol=0, atol=1e-12, err_msg=kind)
        assert np.max(np.abs(expected[kind] - reverse)) > 1e-6


@FEW
@given(coef=st.sampled_from([0.1, 1.0, 3.0]), **CASES)
def test_advantage_mode_equals_k2_loss_sample_by_sample(seed, vocab, scale, coef):
    """At IS ratio 1, loss -sg(A)·log p(y) with A = -coef·d has the per-sample gradient of coef·k2,
    hence (the previous test) coef·grad KL(p||q) in expectation."""
    z, q, p = _case(seed, vocab, scale)
    with jax.enable_x64(True):
        adv, k2 = (np.asarray(g) for g in _advantage_and_k2_sample_grads(*_float64(z, q), jnp.float64(coef)))
    assert adv.dtype == np.float64
    assert np.max(np.abs(k2)) > 1e-3
    np.testing.assert_allclose(adv, coef * k2, rtol=0, atol=1e-12 * max(1.0, coef))
    np.testing.assert_allclose(p @ adv, coef * ref.reverse_kl_logit_grad(z, q), rtol=0, atol=1e-12 * max(1.0, coef))


def test_x64_does_not_leak():
    assert not jax.config.jax_enable_x64
    assert jnp.zeros(1, float).dtype == jnp.float32


@jax.jit
def _surrogate_and_k2_grads(student, teacher, m):
    adv = distill_advantages(None, student, teacher, m, coef=0.8)
    ppo = jax.grad(lambda lp: jnp.sum(ppo_clip_loss(lp, jax.lax.stop_gradient(lp), adv, m).loss))(student)
    k2 = jax.grad(lambda lp: jnp.sum(jnp.where(m > 0, distill_loss(lp, teacher, "k2"), 0.0)))(student)
    return ppo, k2


def test_token_advantages_in_ppo_surrogate_give_k2_gradient():
    """[B, T] advantages into ppo_clip_loss at ratio 1 (float32): d loss / d logp = coef·d = coef·d k2 / d logp."""
    r = rng(3)
    m = opd_mask(r, 4, 8, "mixed")
    student, teacher = opd_logps(r, m)
    student, teacher = np.nan_to_num(student, nan=-1.0), np.nan_to_num(teacher, neginf=-2.0)
    ppo, k2 = _surrogate_and_k2_grads(student, teacher, m)
    assert np.max(np.abs(np.asarray(k2))) > 1e-3
    np.testing.assert_allclose(np.asarray(ppo), 0.8 * np.asarray(k2), rtol=1e-5, atol=1e-6)


@jax.jit
def _gradient_flow(s, t, m):
    """Gradients wrt (student, teacher) of the summed advantages (two settings) and of each loss kind."""
    def grads(f):
        return jax.grad(lambda s, t: jnp.sum(f(s, t)), argnums=(0, 1))(s, t)
    out = {"adv": grads(lambda s, t: distill_advantages(None, s, t, m, coef=1.0)),
           "adv_discount_clip": grads(lambda s, t: distill_advantages(jnp.sum(s, 1), s, t, m, coef=1.0,
                                                                      discount=0.5, clip=0.3))}
    out.update({kind: grads(functools.partial(distill_loss, kind=kind)) for kind in DISTILL_LOSS_KINDS})
    return out


def test_no_gradient_to_the_teacher_nor_through_advantages():
    r = rng(4)
    m = opd_mask(r, 3, 5, "right")
    student, teacher = (np.nan_to_num(x, nan=-1.0, neginf=-1.0) for x in opd_logps(r, m))
    out = _gradient_flow(student, teacher, m)
    for key in ("adv", "adv_discount_clip"):
        assert all(np.all(np.asarray(g) == 0) for g in out[key]), key
    for kind in DISTILL_LOSS_KINDS:
        gs, gt = out[kind]
        assert np.all(np.asarray(gt) == 0) and np.any(np.asarray(gs) != 0), kind


# ----------------------------------------------------------------------------- teacher == student


@pytest.mark.parametrize("discount,clip", [(0.0, None), (0.5, 0.2), (1.0, None)])
def test_teacher_equal_to_student(discount, clip):
    r = rng(5)
    m = opd_mask(r, 4, 8, "mixed")
    student, _ = opd_logps(r, m)
    rows = r.normal(size=4).astype(np.float32)
    out = np.asarray(_advantages(rows, student, student, m, 2.0, clip, discount=discount))
    np.testing.assert_array_equal(out, np.where(m > 0, rows[:, None], 0.0))
    pure = np.asarray(_advantages(None, student, student, m, 2.0, clip, discount=discount))
    np.testing.assert_array_equal(pure, 0.0)
    metrics = _metrics(student, student, m, num_bins=10)
    assert float(metrics["teacher_kl"]) == 0.0
    np.testing.assert_array_equal(np.asarray(metrics["teacher_kl_by_position"]), 0.0)
    np.testing.assert_array_equal(np.asarray(_log_ratio(student, student, m)), 0.0)
    finite = np.nan_to_num(student, nan=-1.0)
    for kind in DISTILL_LOSS_KINDS:
        np.testing.assert_array_equal(np.asarray(_loss(finite, finite, kind=kind)), 0.0)


# ----------------------------------------------------------------------------- dtypes, jit, errors


def test_bf16_inputs_give_float32_outputs():
    r = rng(6)
    m = opd_mask(r, 3, 5, "right")
    s, t = (jnp.asarray(np.nan_to_num(x, nan=-1.0, neginf=-1.0), jnp.bfloat16) for x in opd_logps(r, m))
    assert _log_ratio(s, t, m).dtype == jnp.float32
    assert _advantages(jnp.ones(3, jnp.bfloat16), s, t, m, 1.0, None, discount=0.5).dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in _metrics(s, t, m, num_bins=10).values())
    for kind in DISTILL_LOSS_KINDS:
        out = _loss(s, t, kind=kind)
        assert out.dtype == jnp.float32
        ref_kind = {"low_var_kl": "k3"}.get(kind, kind)
        expected = ref.kl_penalty(np.asarray(s, np.float32), np.asarray(t, np.float32), ref_kind)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


def test_errors():
    s = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="valid kinds: k1, k2, k3, mse, low_var_kl"):
        distill_loss(s, s, "abs")
    with pytest.raises(ValueError, match="valid kinds"):
        distill_loss(s, s, "k4")
    bad = np.zeros((2, 4), np.float32)
    for fn in (teacher_log_ratio, lambda a, b, c: distill_advantages(None, a, b, c, coef=1.0), teacher_kl_metrics):
        with pytest.raises(ValueError, match=r"\[B, T\] of one shape"):
            fn(s, bad, s)
        with pytest.raises(ValueError, match=r"\[B, T\] of one shape"):
            fn(s, s, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"\[B, T\] of one shape"):
        distill_loss(s, bad, "k2")
    for rows in (np.zeros(3), np.zeros((2, 3))):
        with pytest.raises(ValueError, match="row_advantages must be"):
            distill_advantages(rows, s, s, s, coef=1.0)
    for discount in (-0.1, 1.5):
        with pytest.raises(ValueError, match="discount"):
            distill_advantages(None, s, s, s, coef=1.0, discount=discount)
    for clip in (0.0, -1.0):
        with pytest.raises(ValueError, match="clip"):
            distill_advantages(None, s, s, s, coef=1.0, clip=clip)
    with pytest.raises(ValueError, match="num_bins"):
        teacher_kl_metrics(s, s, s, num_bins=0)


def test_under_vmap_over_batches():
    r = rng(8)
    masks = np.stack([opd_mask(r, 3, 5, "mixed") for _ in range(2)])
    pairs = [opd_logps(r, m) for m in masks]
    s, t = (np.stack([np.nan_to_num(p[i], nan=-1.0, neginf=-1.0) for p in pairs]) for i in (0, 1))
    rows = r.normal(size=(2, 3)).astype(np.float32)
    fn = functools.partial(distill_advantages, coef=0.5, discount=0.5, clip=1.0)
    out = jax.jit(jax.vmap(fn))(rows, s, t, masks)
    np.testing.assert_allclose(np.asarray(out[1]), ref.distill_advantages(rows[1], s[1], t[1], masks[1], coef=0.5,
                                                                        discount=0.5, clip=1.0), rtol=1e-5, atol=1e-6)
    metrics = jax.jit(jax.vmap(teacher_kl_metrics))(s, t, masks)
    np.testing.assert_allclose(np.asarray(metrics["teacher_kl_by_position"][0]),
                               ref.teacher_kl_metrics(s[0], t[0], masks[0])["teacher_kl_by_position"],
                               rtol=1e-5, atol=1e-6)
