"""Tests of aggregate_loss -> LossTerms(numerator, denominator) and exact micro-batching."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import AGGREGATION_MODES, LossTerms, aggregate_loss, clipped_surrogate, prompt_weights
from tests.core import reference as ref
from tests.core._helpers import B, FAST, FEW, T, assert_finite, logps, mask, rng, seeds

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
NORM = 16.0


def _kw(mode):
    return dict(norm_length=NORM) if mode == "seq-mean-token-sum-norm" else {}


@functools.partial(jax.jit, static_argnames=("mode", "norm_length"))
def _agg(loss, m, row_weights, mode, norm_length=None):
    return aggregate_loss(loss, m, mode, norm_length=norm_length, row_weights=row_weights)


def _terms(loss, m, mode, row_weights=None, norm_length="default"):
    nl = NORM if norm_length == "default" and mode == "seq-mean-token-sum-norm" else (
        None if norm_length == "default" else norm_length)
    if row_weights is None:
        terms = aggregate_loss(jnp.asarray(loss), jnp.asarray(m), mode, norm_length=nl)
    else:
        terms = _agg(jnp.asarray(loss), jnp.asarray(m), jnp.asarray(row_weights), mode, nl)
    return terms


def test_modes_are_listed():
    assert set(MODES) <= set(AGGREGATION_MODES)


# ----------------------------------------------------------------------------- hand values


def test_hand_values_differ_as_documented():
    # row 0: 1 token of loss 1 ; row 1: 3 tokens of loss 0 ; row 2: empty
    loss = jnp.array([[1.0, 9.0, 9.0], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    m = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    expected = {
        "token-mean": (1.0, 4.0, 0.25),             # long rows weigh more
        "seq-mean-token-mean": (1.0, 2.0, 0.5),     # every non-empty row weighs 1
        "seq-mean-token-sum": (1.0, 2.0, 0.5),
        "seq-mean-token-sum-norm": (0.25, 2.0, 0.125),  # sum / norm_length 4, 2 rows
    }
    for mode, (num, den, value) in expected.items():
        terms = aggregate_loss(loss, m, mode, norm_length=4.0 if "norm" in mode else None)
        assert isinstance(terms, LossTerms)
        np.testing.assert_allclose(float(terms.numerator), num, rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(float(terms.value), value, rtol=1e-6, err_msg=mode)


def test_row_weights_only_touch_denominators():
    loss = jnp.array([[1.0, 1.0], [3.0, 0.0]])
    m = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    w = jnp.array([1.0, 0.0])
    # token-mean: num 2 + 3 = 5, den 2 (row 1 left out of the denominator)
    terms = aggregate_loss(loss, m, "token-mean", row_weights=w)
    np.testing.assert_allclose([float(terms.numerator), float(terms.denominator)], [5.0, 2.0])
    # seq-mean-token-mean: num 1 + 3 = 4, den 1
    terms = aggregate_loss(loss, m, "seq-mean-token-mean", row_weights=w)
    np.testing.assert_allclose([float(terms.numerator), float(terms.denominator)], [4.0, 1.0])


# ----------------------------------------------------------------------------- vs reference


@FAST
@given(seed=seeds, mode=st.sampled_from(MODES), weighted=st.booleans())
def test_matches_reference(seed, mode, weighted):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    w = (g.random(B) < 0.7).astype(np.float32) if weighted else None
    terms = _terms(loss, m, mode, w)
    num, den = ref.aggregate_loss(loss, m, mode, row_weights=w, **_kw(mode))
    np.testing.assert_allclose(float(terms.numerator), num, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-6)
    np.testing.assert_allclose(float(terms.value), ref.loss_value(num, den), rtol=1e-5,
                               atol=1e-5)


@FAST
@given(seed=seeds, length=st.integers(1, T))
def test_modes_coincide_when_all_lengths_are_equal(seed, length):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = np.zeros((B, T), np.float32)
    m[:, :length] = 1.0
    v = {mode: float(_terms(loss, m, mode).value) for mode in MODES[:3]}
    np.testing.assert_allclose(v["token-mean"], v["seq-mean-token-mean"], rtol=1e-5, atol=1e-6)
    norm1 = float(_terms(loss, m, "seq-mean-token-sum-norm", norm_length=1.0).value)
    np.testing.assert_allclose(v["seq-mean-token-sum"], norm1, rtol=1e-5, atol=1e-6)
    # and Dr. GRPO with norm_length = L equals token-mean
    norm_l = float(_terms(loss, m, "seq-mean-token-sum-norm", norm_length=float(length)).value)
    np.testing.assert_allclose(norm_l, v["token-mean"], rtol=1e-5, atol=1e-6)


@FAST
@given(seed=seeds, mode=st.sampled_from(MODES), extra=st.sampled_from([1, 3]))
def test_masked_padding_columns_change_nothing(seed, mode, extra):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    garbage = g.uniform(-1e6, 1e6, size=(B, extra)).astype(np.float32)
    padded_loss = np.concatenate([loss, garbage], axis=1)
    padded_m = np.concatenate([m, np.zeros((B, extra), np.float32)], axis=1)
    a, b = _terms(loss, m, mode), _terms(padded_loss, padded_m, mode)
    np.testing.assert_allclose(float(b.numerator), float(a.numerator), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(b.denominator), float(a.denominator), rtol=1e-6)


# ----------------------------------------------------------------------------- micro-batches


def _chunks(x, k):
    return np.split(x, k, axis=0)


@FAST
@given(seed=seeds, mode=st.sampled_from(MODES), k=st.sampled_from([2, 4, 8]),
       weighted=st.booleans())
def test_micro_batch_sums_equal_the_full_batch(seed, mode, k, weighted):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    w = (g.random(B) < 0.7).astype(np.float32) if weighted else np.ones(B, np.float32)
    full = _terms(loss, m, mode, w)
    parts = [_terms(l, mm, mode, ww)
             for l, mm, ww in zip(_chunks(loss, k), _chunks(m, k), _chunks(w, k))]
    num = sum(float(p.numerator) for p in parts)
    den = sum(float(p.denominator) for p in parts)
    np.testing.assert_allclose(num, float(full.numerator), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(den, float(full.denominator), rtol=1e-6)
    np.testing.assert_allclose(num / max(den, 1e-30) if den else 0.0, float(full.value),
                               rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("mode", "k"))
def _full_and_split_grads(logp, old, adv, m, mode, k):
    nl = NORM if mode == "seq-mean-token-sum-norm" else None

    def per_token(lp, o, a, mm):
        return clipped_surrogate(lp, o, a, mm, eps_low=0.2, eps_high=0.28)[0]

    def full(lp):
        return aggregate_loss(per_token(lp, old, adv, m), m, mode, norm_length=nl).value

    def split(lp):
        terms = [aggregate_loss(per_token(*xs), xs[3], mode, norm_length=nl)
                 for xs in zip(*(jnp.split(x, k, axis=0) for x in (lp, old, adv, m)))]
        return sum(t.numerator for t in terms) / sum(t.denominator for t in terms)

    return jax.grad(full)(logp), jax.grad(split)(logp), full(logp), split(logp)


@FEW
@given(seed=seeds, mode=st.sampled_from(MODES))
def test_micro_batch_gradients_equal_the_full_batch(seed, mode):
    g = rng(seed)
    logp, old = logps(g, spread=0.3)
    adv = g.normal(size=B).astype(np.float32)
    m = mask(g, allow_empty=False)
    gf, gs, vf, vs = _full_and_split_grads(*map(jnp.asarray, (logp, old, adv, m)), mode, 2)
    np.testing.assert_allclose(float(vs), float(vf), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gf), rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(gf) != 0)


# ----------------------------------------------------------------------------- degenerate input


@pytest.mark.parametrize("mode", MODES)
def test_nothing_counts_gives_zero(mode):
    loss = jnp.full((B, T), 3.0)
    terms = aggregate_loss(loss, jnp.zeros((B, T)), mode, **_kw(mode))
    assert float(terms.value) == 0.0 and float(terms.denominator) == 0.0
    grad = jax.grad(lambda l: aggregate_loss(l, jnp.zeros((B, T)), mode, **_kw(mode)).value)(loss)
    assert_finite(grad)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_zero_length_rows_are_finite(mode):
    g = rng(4)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    m[::2] = 0.0
    terms = _terms(loss, m, mode)
    assert_finite(terms.numerator, terms.denominator, terms.value)


def test_missing_norm_length_raises():
    with pytest.raises(ValueError):
        aggregate_loss(jnp.ones((B, T)), jnp.ones((B, T)), "seq-mean-token-sum-norm")


def test_unknown_mode_raises():
    with pytest.raises(ValueError):
        aggregate_loss(jnp.ones((B, T)), jnp.ones((B, T)), "token-sum")


# ----------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("mode", MODES)
def test_under_vmap(mode):
    g = rng(8)
    loss = jnp.asarray(g.normal(size=(3, B, T)).astype(np.float32))
    m = jnp.asarray(np.stack([mask(g) for _ in range(3)]))
    fn = functools.partial(aggregate_loss, mode=mode, **_kw(mode))
    terms = jax.vmap(fn)(loss, m)
    for i in range(3):
        ti = fn(loss[i], m[i])
        np.testing.assert_allclose(float(terms.numerator[i]), float(ti.numerator), rtol=1e-6)
        np.testing.assert_allclose(float(terms.denominator[i]), float(ti.denominator))


# ----------------------------------------------------------------------------- prompt level (ScaleRL)

PROMPT = "prompt-mean-token-mean"
G_PROMPT = 4  # B = 8 rows = 2 prompts x 4


def test_prompt_mode_hand_values():
    # prompt 0: rows (1 token of loss 1), (3 tokens of loss 0) -> token-mean 1/4
    # prompt 1: rows (2 tokens of loss 3), (empty)             -> token-mean 3
    # mean over prompts: (0.25 + 3) / 2 = 1.625 (token-mean would give 7/6, seq-mean 1.167)
    loss = jnp.array([[1.0, 9.0, 9.0], [0.0, 0.0, 0.0], [3.0, 3.0, 9.0], [5.0, 5.0, 5.0]])
    m = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    terms = aggregate_loss(loss, m, PROMPT, group_size=2)
    np.testing.assert_allclose([float(terms.numerator), float(terms.denominator), float(terms.value)],
                               [3.25, 2.0, 1.625], rtol=1e-6)
    w = prompt_weights(jnp.sum(m, axis=1), 2)
    np.testing.assert_allclose(np.asarray(w), [0.25, 0.25, 0.5, 0.5])
    terms = aggregate_loss(loss, m, PROMPT, row_weights=w)
    np.testing.assert_allclose(float(terms.value), 1.625, rtol=1e-6)


def _prompt_inputs(seed, weighted):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    # row weights drop whole groups (dynamic sampling) or single rows (overlong filter)
    w = (g.random(B) < 0.7).astype(np.float32) if weighted else np.ones(B, np.float32)
    return loss, m * w[:, None], w


@FAST
@given(seed=seeds, weighted=st.booleans())
def test_prompt_mode_matches_reference(seed, weighted):
    loss, m, w = _prompt_inputs(seed, weighted)
    pw = prompt_weights(jnp.asarray(m.sum(axis=1)), G_PROMPT, jnp.asarray(w))
    terms = aggregate_loss(jnp.asarray(loss), jnp.asarray(m), PROMPT, row_weights=pw)
    num, den = ref.aggregate_loss(loss, m, PROMPT, row_weights=w, group_size=G_PROMPT)
    np.testing.assert_allclose(float(terms.numerator), num, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(terms.denominator), den, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(terms.value), ref.loss_value(num, den), rtol=1e-5, atol=1e-5)
    if not weighted:  # in-call weights from group_size: the same when the call holds whole groups
        t2 = aggregate_loss(jnp.asarray(loss), jnp.asarray(m), PROMPT, group_size=G_PROMPT)
        np.testing.assert_allclose(float(t2.value), float(terms.value), rtol=1e-6)


def _strided(x, k):
    """The train step's micro-batch split: slice i = rows i, i+k, ... (groups cut apart)."""
    return [x[i::k] for i in range(k)]


@FAST
@given(seed=seeds, k=st.sampled_from([2, 4, 8]), weighted=st.booleans(), strided=st.booleans())
def test_prompt_mode_micro_batch_sums_equal_the_full_batch(seed, k, weighted, strided):
    loss, m, w = _prompt_inputs(seed, weighted)
    pw = np.asarray(prompt_weights(jnp.asarray(m.sum(axis=1)), G_PROMPT, jnp.asarray(w)))
    split = _strided if strided else _chunks
    full = aggregate_loss(jnp.asarray(loss), jnp.asarray(m), PROMPT, row_weights=jnp.asarray(pw))
    parts = [aggregate_loss(jnp.asarray(l), jnp.asarray(mm), PROMPT, row_weights=jnp.asarray(ww))
             for l, mm, ww in zip(split(loss, k), split(m, k), split(pw, k))]
    num = sum(float(p.numerator) for p in parts)
    den = sum(float(p.denominator) for p in parts)
    np.testing.assert_allclose(num, float(full.numerator), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(den, float(full.denominator), rtol=1e-5, atol=1e-6)
    exp_num, exp_den = ref.aggregate_loss(loss, m, PROMPT, row_weights=w, group_size=G_PROMPT)
    np.testing.assert_allclose(num / den if den else 0.0, ref.loss_value(exp_num, exp_den), rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("k",))
def _prompt_full_and_split_grads(logp, old, adv, m, pw, k):
    def per_token(lp, o, a, mm):
        return clipped_surrogate(lp, o, a, mm, eps_low=0.2, eps_high=0.28)[0]

    def full(lp):
        return aggregate_loss(per_token(lp, old, adv, m), m, PROMPT, row_weights=pw).value

    def split(lp):
        parts = [jnp.stack([x[i::k] for i in range(k)]) for x in (lp, old, adv, m, pw)]
        terms = [aggregate_loss(per_token(*(p[i] for p in parts[:4])), parts[3][i], PROMPT, row_weights=parts[4][i])
                 for i in range(k)]
        return sum(t.numerator for t in terms) / sum(t.denominator for t in terms)

    return jax.grad(full)(logp), jax.grad(split)(logp), full(logp), split(logp)


@FEW
@given(seed=seeds)
def test_prompt_mode_micro_batch_gradients_equal_the_full_batch(seed):
    g = rng(seed)
    logp, old = logps(g, spread=0.3)
    adv = g.normal(size=B).astype(np.float32)
    m = mask(g, allow_empty=False)
    pw = prompt_weights(jnp.asarray(m.sum(axis=1)), G_PROMPT)
    gf, gs, vf, vs = _prompt_full_and_split_grads(*map(jnp.asarray, (logp, old, adv, m)), pw, 2)
    np.testing.assert_allclose(float(vs), float(vf), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gf), rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(gf) != 0)


def test_prompt_mode_needs_weights_or_group_size():
    with pytest.raises(ValueError, match="prompt_weights"):
        aggregate_loss(jnp.ones((B, T)), jnp.ones((B, T)), PROMPT)
    with pytest.raises(ValueError, match="group_size"):
        prompt_weights(jnp.ones((B,)), 3)


def test_prompt_mode_nothing_counts_gives_zero():
    terms = aggregate_loss(jnp.full((B, T), 3.0), jnp.zeros((B, T)), PROMPT, group_size=G_PROMPT)
    assert float(terms.value) == 0.0 and float(terms.denominator) == 0.0


# ----------------------------------------------------------------------------- peers' sum over rows

ROW_SUM = "seq-sum-token-sum-norm"


def test_norm_modes_hand_values_paper_vs_peers():
    """Dr. GRPO's paper means over rows (ours, the default); verl's and ROLL's agg_loss sum them."""
    loss = jnp.array([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    paper = aggregate_loss(loss, m, "seq-mean-token-sum-norm", norm_length=3.0)
    # (1 + 2) / 3 = 1 and 3 / 3 = 1, mean over the 2 rows
    np.testing.assert_allclose([float(paper.numerator), float(paper.denominator), float(paper.value)],
                               [2.0, 2.0, 1.0], rtol=1e-6)
    peers = aggregate_loss(loss, m, ROW_SUM, norm_length=3.0)
    # (1 + 2 + 3) / 3 = 2, what verl and ROLL return on these inputs
    np.testing.assert_allclose([float(peers.numerator), float(peers.denominator), float(peers.value)],
                               [2.0, 1.0, 2.0], rtol=1e-6)
    # as one of 4 micro-batches of an 8-row step: 2 of 8 rows, denominator 1/4
    part = aggregate_loss(loss, m, ROW_SUM, norm_length=3.0, total_rows=8)
    np.testing.assert_allclose([float(part.numerator), float(part.denominator)], [2.0, 0.25], rtol=1e-6)


@FAST
@given(seed=seeds, weighted=st.booleans())
def test_row_sum_mode_is_counted_rows_times_the_paper_mode(seed, weighted):
    """sum_b / T = (rows with a counted token) x mean_b / T: the batch-size factor between the two."""
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    w = (g.random(B) < 0.7).astype(np.float32) if weighted else None
    peers = _agg(jnp.asarray(loss), jnp.asarray(m), None if w is None else jnp.asarray(w), ROW_SUM, NORM)
    paper = _terms(loss, m, "seq-mean-token-sum-norm", w)
    num, den = ref.aggregate_loss(loss, m, ROW_SUM, norm_length=NORM, row_weights=w)
    np.testing.assert_allclose(float(peers.numerator), num, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(peers.denominator), den, rtol=1e-7)
    np.testing.assert_allclose(float(peers.value), float(np.sum(loss * m)) / NORM, rtol=1e-5, atol=1e-5)
    # row weights leave the sum mode's constant denominator alone
    np.testing.assert_allclose(float(peers.denominator), 1.0)
    np.testing.assert_allclose(float(peers.numerator), float(paper.numerator), rtol=1e-5, atol=1e-5)
    if not weighted:
        counted_rows = float(np.sum(m.sum(axis=1) > 0))
        np.testing.assert_allclose(float(peers.value), counted_rows * float(paper.value), rtol=1e-5, atol=1e-5)


@FAST
@given(seed=seeds, k=st.sampled_from([2, 4, 8]), strided=st.booleans())
def test_row_sum_mode_micro_batch_sums_equal_the_full_batch(seed, k, strided):
    g = rng(seed)
    loss = g.normal(size=(B, T)).astype(np.float32)
    m = mask(g)
    split = _strided if strided else _chunks
    full = aggregate_loss(jnp.asarray(loss), jnp.asarray(m), ROW_SUM, norm_length=NORM)
    parts = [aggregate_loss(jnp.asarray(l), jnp.asarray(mm), ROW_SUM, norm_length=NORM, total_rows=B)
             for l, mm in zip(split(loss, k), split(m, k))]
    num = sum(float(p.numerator) for p in parts)
    den = sum(float(p.denominator) for p in parts)
    np.testing.assert_allclose(den, 1.0, rtol=1e-6)
    np.testing.assert_allclose(num, float(full.numerator), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(num / den, float(full.value), rtol=1e-5, atol=1e-5)
    # without total_rows every part claims the whole step: k times too small, verl's
    # per-micro-batch sum averaged over gradient-accumulation steps
    naive = sum(float(aggregate_loss(jnp.asarray(l), jnp.asarray(mm), ROW_SUM, norm_length=NORM).denominator)
                for l, mm in zip(split(loss, k), split(m, k)))
    assert naive == k


@FEW
@given(seed=seeds)
def test_row_sum_mode_micro_batch_gradients_equal_the_full_batch(seed):
    g = rng(seed)
    logp, old = logps(g, spread=0.3)
    adv = g.normal(size=B).astype(np.float32)
    m = mask(g, allow_empty=False)
    args = tuple(map(jnp.asarray, (logp, old, adv, m)))

    def per_token(lp, o, a, mm):
        return clipped_surrogate(lp, o, a, mm, eps_low=0.2, eps_high=0.28)[0]

    def full(lp):
        return aggregate_loss(per_token(lp, *args[1:]), args[3], ROW_SUM, norm_length=NORM).value

    def split(lp):
        terms = [aggregate_loss(per_token(*xs), xs[3], ROW_SUM, norm_length=NORM, total_rows=B)
                 for xs in zip(*(jnp.split(x, 2, axis=0) for x in (lp, *args[1:])))]
        return sum(t.numerator for t in terms) / sum(t.denominator for t in terms)

    gf, gs = jax.jit(jax.grad(full))(args[0]), jax.jit(jax.grad(split))(args[0])
    np.testing.assert_allclose(np.asarray(gs), np.asarray(gf), rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(gf) != 0)


def test_row_sum_mode_degenerate_inputs():
    # nothing counts: loss 0 with a finite, zero gradient (the denominator stays the share 1)
    loss = jnp.full((B, T), 3.0)
    terms = aggregate_loss(loss, jnp.zeros((B, T)), ROW_SUM, norm_length=NORM)
    assert float(terms.value) == 0.0 and float(terms.denominator) == 1.0
    grad = jax.grad(lambda l: aggregate_loss(l, jnp.zeros((B, T)), ROW_SUM, norm_length=NORM).value)(loss)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(loss, jnp.ones((B, T)), ROW_SUM)
    with pytest.raises(ValueError, match="total_rows"):
        aggregate_loss(loss, jnp.ones((B, T)), ROW_SUM, norm_length=NORM, total_rows=B - 1)


def test_row_sum_mode_under_vmap():
    g = rng(9)
    loss = jnp.asarray(g.normal(size=(3, B, T)).astype(np.float32))
    m = jnp.asarray(np.stack([mask(g) for _ in range(3)]))
    fn = functools.partial(aggregate_loss, mode=ROW_SUM, norm_length=NORM, total_rows=2 * B)
    terms = jax.vmap(fn)(loss, m)
    for i in range(3):
        np.testing.assert_allclose(float(terms.numerator[i]), float(fn(loss[i], m[i]).numerator), rtol=1e-6)
        np.testing.assert_allclose(float(jnp.broadcast_to(terms.denominator, (3,))[i]), 0.5)
