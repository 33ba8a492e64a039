"""Tests of router replay's metrics: route_disagreement, expert_load, load_imbalance (core/routing.py),
against a loop over (row, position, layer) in numpy."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given

from jaxrl4llm.core import expert_load, load_imbalance, route_disagreement
from tests.core._helpers import FAST, rng, seeds

B, T, L, K, E = 3, 5, 2, 2, 4


def routes(r):
    """[B, T, L, K] distinct expert ids per (token, layer), as a router's top k gives."""
    return np.stack([np.stack([np.stack([r.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])
                     for _ in range(B)]).astype(np.uint8)


@FAST
@given(seed=seeds)
def test_disagreement_counts_the_pairs_whose_sets_differ(seed):
    r = rng(seed)
    a = routes(r)
    b = np.where(r.random((B, T, L, 1)) < 0.5, routes(r), a[..., ::-1])  # half re-drawn, half the same set reordered
    mask = (r.random((B, T)) < 0.7).astype(np.float32)
    differ = [set(a[i, t, l]) != set(b[i, t, l]) for i in range(B) for t in range(T) for l in range(L) if mask[i, t]]
    want = np.mean(differ) if differ else 0.0
    np.testing.assert_allclose(float(route_disagreement(jnp.asarray(a), jnp.asarray(b), jnp.asarray(mask))), want,
                               atol=1e-6)


def test_disagreement_of_a_route_with_itself_is_zero_and_of_disjoint_sets_one():
    a = routes(rng(0))
    mask = jnp.ones((B, T))
    assert float(route_disagreement(jnp.asarray(a), jnp.asarray(a[..., ::-1]), mask)) == 0.0
    disjoint = np.zeros((B, T, L, K), np.uint8), np.full((B, T, L, K), 3, np.uint8)
    assert float(route_disagreement(*map(jnp.asarray, disjoint), mask)) == 1.0
    assert float(route_disagreement(*map(jnp.asarray, disjoint), jnp.zeros((B, T)))) == 0.0  # nothing counted


@FAST
@given(seed=seeds)
def test_expert_load_is_each_layer_s_share_of_the_counted_choices(seed):
    r = rng(seed)
    a = routes(r)
    mask = (r.random((B, T)) < 0.7).astype(np.float32)
    load = np.asarray(expert_load(jnp.asarray(a), jnp.asarray(mask), E))
    want = np.zeros((L, E))
    for i, t, l, j in np.ndindex(B, T, L, K):
        want[l, a[i, t, l, j]] += mask[i, t] > 0
    want = want / np.maximum(want.sum(-1, keepdims=True), 1)
    np.testing.assert_allclose(load, want, atol=1e-6)


def test_load_imbalance_is_one_when_balanced_and_e_when_one_expert_takes_all():
    assert float(load_imbalance(jnp.full((L, E), 1 / E))) == 1.0
    assert float(load_imbalance(jnp.asarray(np.eye(E)[:L]))) == E
