"""Tests of the row filters: overlong_filter_mask, overlong_soft_penalty, dynamic_sampling_mask (DAPO), void_turn_filter_mask (SimpleTIR)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl4llm.core import dynamic_sampling_mask, overlong_filter_mask, overlong_soft_penalty, void_turn_filter_mask
from tests.core import reference as ref
from tests.core._helpers import B, FAST, G, rewards, rng, seeds


def test_overlong_filter_hand_values():
    out = overlong_filter_mask(jnp.array([True, False, True, False]))
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_array_equal(np.asarray(out), [0.0, 1.0, 0.0, 1.0])
    out = overlong_filter_mask(jnp.array([1, 0, 0, 1]))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 1.0, 1.0, 0.0])


def test_soft_penalty_hand_values():
    # max 20, buffer 4: free up to 16; linear -1/4 per token in (16, 20]; -penalty beyond 20
    lengths = jnp.array([0, 10, 16, 17, 18, 20, 21, 1000])
    out = overlong_soft_penalty(lengths, max_length=20, buffer_length=4)
    np.testing.assert_allclose(np.asarray(out), [0, 0, 0, -0.25, -0.5, -1.0, -1.0, -1.0],
                               atol=1e-6)
    out = overlong_soft_penalty(lengths, max_length=20, buffer_length=4, penalty=0.5)
    np.testing.assert_allclose(np.asarray(out), [0, 0, 0, -0.125, -0.25, -0.5, -0.5, -0.5],
                               atol=1e-6)


@FAST
@given(seed=seeds, max_length=st.sampled_from([64, 100]), buffer_length=st.sampled_from([8, 30]),
       penalty=st.sampled_from([1.0, 0.3]))
def test_soft_penalty_matches_reference(seed, max_length, buffer_length, penalty):
    lengths = rng(seed).integers(0, 130, size=B).astype(np.int32)
    kw = dict(max_length=max_length, buffer_length=buffer_length, penalty=penalty)
    out = overlong_soft_penalty(jnp.asarray(lengths), **kw)
    assert out.shape == (B,)
    np.testing.assert_allclose(np.asarray(out), ref.overlong_soft_penalty(lengths, **kw),
                               atol=1e-6)
    assert np.all(np.asarray(out) <= 0) and np.all(np.asarray(out) >= -penalty - 1e-6)


def test_soft_penalty_is_monotone_and_continuous():
    lengths = jnp.arange(0, 40)
    out = np.asarray(overlong_soft_penalty(lengths, max_length=30, buffer_length=10))
    assert np.all(np.diff(out) <= 0)
    assert np.all(np.abs(np.diff(out)) <= 0.1 + 1e-6)  # steps of 1/buffer at most


def test_dynamic_sampling_hand_values():
    # groups: [1,1,1,1] constant, [0,1,0,0] mixed, [0,0,0,0] constant
    r = jnp.array([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0])
    out = dynamic_sampling_mask(r, 4)
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_array_equal(np.asarray(out), [0] * 4 + [1] * 4 + [0] * 4)


@FAST
@given(seed=seeds, group_size=st.sampled_from([1, 2, 4, 8]))
def test_dynamic_sampling_matches_reference(seed, group_size):
    r = rewards(rng(seed))
    out = dynamic_sampling_mask(jnp.asarray(r), group_size)
    np.testing.assert_array_equal(np.asarray(out), ref.dynamic_sampling_mask(r, group_size))


def test_dynamic_sampling_sees_tiny_differences():
    r = jnp.array([0.1, 0.1, 0.1, 0.1 + 1e-6, 0.1, 0.1, 0.1, 0.1], jnp.float32)
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_mask(r, 4)), [1] * 4 + [0] * 4)


def test_filters_under_jit_and_vmap():
    g = rng(2)
    r = jnp.asarray(np.stack([rewards(g, kind=0) for _ in range(3)]))
    lengths = jnp.asarray(g.integers(0, 40, size=(3, B)))
    truncated = jnp.asarray(g.random((3, B)) < 0.3)
    fns = [
        (functools.partial(dynamic_sampling_mask, group_size=G), r),
        (functools.partial(overlong_soft_penalty, max_length=30, buffer_length=10), lengths),
        (overlong_filter_mask, truncated),
    ]
    for fn, x in fns:
        out = jax.jit(jax.vmap(fn))(x)
        for i in range(3):
            np.testing.assert_allclose(np.asarray(out[i]), np.asarray(fn(x[i])), atol=1e-7)


@FAST
@given(st.lists(st.booleans(), min_size=1, max_size=16))
def test_void_turn_filter_keeps_exactly_the_rows_that_are_not_void(flags):
    out = np.asarray(void_turn_filter_mask(jnp.array(flags)))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, 1.0 - np.array(flags, np.float32))


def test_void_turn_filter_drops_rows_from_the_loss_not_from_the_advantage_statistics():
    import dataclasses

    from jaxrl4llm.core import LITE_PPO, compute_advantages

    rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
    void = jnp.array([False, True, False, False])
    recipe = dataclasses.replace(LITE_PPO, void_turn_filter=True)
    filtered = compute_advantages(rewards, 2, recipe, void=void)
    plain = compute_advantages(rewards, 2, LITE_PPO)
    np.testing.assert_array_equal(np.asarray(filtered.row_weights), [1.0, 0.0, 1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(filtered.advantages), np.asarray(plain.advantages))
    with pytest.raises(ValueError, match="void=\\[B\\]"):
        compute_advantages(rewards, 2, recipe)
