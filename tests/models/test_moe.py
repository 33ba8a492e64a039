"""models/layers/moe.py: the router (top-k and replay) and the three expert forms, equal in values
and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.kernels.choice import (
    EXPERT_FORMS,
    ExpertForm,
    ExpertWeightGrad,
    expert_form_for,
    expert_weight_grad_for,
    experts_model_dim_minor,
    prefill_expert_copy_width,
)
from jaxrl4llm.models.layers import moe
from jaxrl4llm.models.layers.moe import (
    Experts,
    expert_ffn,
    grouped_matmul,
    replay_route,
    router_probs,
    top_k_route,
)

N, D, I, E, K = 6, 8, 4, 8, 2  # one shape for every drawn case: one compile per form


def _weights(seed: int):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (N, D))
    router = 0.5 * jax.random.normal(keys[1], (D, E))
    experts = Experts(*(0.5 * jax.random.normal(k, s) for k, s in zip(keys[2:], [(E, D, I), (E, D, I), (E, I, D)])))
    return x, router, experts


@functools.partial(jax.jit, static_argnames=("form", "norm"))
def _value_and_grads(x, router, experts, ids, cotangent, *, form, norm):
    """y = expert_ffn(x, ids, replayed gate weights) and d<y, cotangent>/d(x, router, experts)."""
    def loss(x, router, experts):
        w = replay_route(router_probs(x, router), ids, norm)
        y = expert_ffn(x, ids, w, experts, form)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, router, experts)
    return y, grads


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), used=st.integers(K, E), norm=st.booleans())
def test_expert_forms_agree_in_values_and_gradients(seed, used, norm):
    """ragged_dot = dense_capacity = reference, with the ids drawn from `used` of the E experts
    (E - used experts empty, and uneven groups)."""
    rng = np.random.default_rng(seed)
    allowed = rng.permutation(E)[:used]
    ids = jnp.asarray(np.stack([rng.choice(allowed, K, replace=False) for _ in range(N)]), jnp.int32)
    x, router, experts = _weights(seed)
    cotangent = jax.random.normal(jax.random.key(seed + 1), (N, D))
    y_ref, g_ref = _value_and_grads(x, router, experts, ids, cotangent, form="reference", norm=norm)
    assert float(jnp.abs(g_ref[1]).max()) > 0  # the router gets gradient through the replayed weights
    for form in (ExpertForm.RAGGED_DOT, ExpertForm.DENSE_CAPACITY):
        y, grads = _value_and_grads(x, router, experts, ids, cotangent, form=form.value, norm=norm)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6, err_msg=form)
        for name, a, b in zip(("x", "router", "experts"), grads, g_ref):
            for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(leaf_a, leaf_b, rtol=1e-5, atol=1e-5, err_msg=f"{form}: d/d{name}")


@functools.partial(jax.jit, static_argnames=("weight_grad", "dtype"))
def _grouped_value_and_grads(a, w, group_sizes, cotangent, *, weight_grad, dtype):
    loss = lambda a, w: jnp.sum(grouped_matmul(a, w, group_sizes, dtype, weight_grad) * cotangent)
    return grouped_matmul(a, w, group_sizes, dtype, weight_grad), jax.grad(loss, argnums=(0, 1))(a, w)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), empty=st.integers(0, 4))
def test_grouped_matmul_tgmm_backward_equals_ragged_dots(seed, empty):
    """The custom backward (input gradient a ragged_dot, weight gradient megablox's tgmm, here in
    Pallas' interpreter) = JAX's autodiff of ragged_dot, in values and gradients: uneven and empty
    groups, 37 rows (tgmm's 128-row tiles padded)."""
    rows, k, n, groups = 37, 8, 4, 6
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(rows, rng.dirichlet(np.ones(groups)))
    sizes[rng.permutation(groups)[:empty]] = 0
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    a, w, cot = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((rows, k), (groups, k, n), (rows, n)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y_ref, (da_ref, dw_ref) = _grouped_value_and_grads(a, w, group_sizes, cot, weight_grad="ragged_dot",
                                                       dtype=jnp.float32)
    y, (da, dw) = _grouped_value_and_grads(a, w, group_sizes, cot, weight_grad="tgmm", dtype=jnp.float32)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(da, da_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(dw)[sizes == 0], 0.0)  # an empty group gets no gradient
    ends = np.cumsum(sizes)
    for g in range(groups):  # dW[g] = a_g^T cot_g
        np.testing.assert_allclose(dw[g], np.asarray(a)[ends[g] - sizes[g]:ends[g]].T @ np.asarray(cot)[
            ends[g] - sizes[g]:ends[g]], rtol=1e-4, atol=1e-4)
    _, (da16, dw16) = _grouped_value_and_grads(a, w, group_sizes, cot, weight_grad="tgmm", dtype=jnp.bfloat16)
    assert da16.dtype == dw16.dtype == jnp.float32  # gradients in the inputs' dtypes
    np.testing.assert_allclose(dw16, dw_ref, rtol=0.05, atol=0.1)


def test_dense_capacity_over_the_experts_rows_equals_the_reference(monkeypatch):
    """dense_capacity as three matmuls over the experts' (expert, unit) rows (`moe.expert_rows`, what
    it runs where XLA lays the experts out model dim minor: TPU, widths not a multiple of 128 lanes) =
    the reference form, in values and gradients."""
    rng = np.random.default_rng(3)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    x, router, experts = _weights(3)
    cotangent = jax.random.normal(jax.random.key(4), (N, D))

    def run(form):  # traced afresh (no jit cache): the layout rule is read while tracing
        def loss(x, router, experts):
            y = expert_ffn(x, ids, replay_route(router_probs(x, router), ids, True), experts, form)
            return jnp.sum(y * cotangent), y
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, router, experts)

    (_, y_ref), g_ref = run("reference")
    monkeypatch.setattr(moe, "experts_model_dim_minor", lambda platform, width: True)
    (_, y), grads = run("dense_capacity")
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    gate, up, down = moe.expert_rows(experts)  # row e I + i: expert e's unit i
    np.testing.assert_array_equal(gate[2 * I + 1], experts.gate[2, :, 1])
    np.testing.assert_array_equal(down[2 * I + 1], experts.down[2, 1])


def test_which_expert_layout_and_prefill_copies_each_platform_gets():
    """XLA:TPU lays a device's experts [E, D, I] model dim minor where I does not fill whole 128-lane
    rows (Qwen3-30B-A3B at tensor parallel 4: I = 192), and its ragged_dot prefill then holds gate and
    up copied I minor, padded to 256; I-minor widths and other platforms hold no copy."""
    assert experts_model_dim_minor("tpu", 192) and experts_model_dim_minor("tpu", 96)
    assert not experts_model_dim_minor("tpu", 256) and not experts_model_dim_minor("cpu", 192)
    assert prefill_expert_copy_width("tpu", 192) == 256 and prefill_expert_copy_width("tpu", 96) == 128
    assert prefill_expert_copy_width("tpu", 384) == 0
    assert prefill_expert_copy_width("gpu", 192) == prefill_expert_copy_width("cpu", 192) == 0


def test_unused_experts_get_zero_gradient():
    x, router, experts = _weights(0)
    ids = jnp.tile(jnp.array([[1, 5]], jnp.int32), (N, 1))  # experts other than 1 and 5 receive no token
    _, (_, _, g) = _value_and_grads(x, router, experts, ids, jnp.ones((N, D)), form="ragged_dot", norm=True)
    for leaf in g:
        assert float(jnp.abs(leaf[1]).max()) > 0 and float(jnp.abs(leaf[5]).max()) > 0
        np.testing.assert_array_equal(np.delete(np.asarray(leaf), [1, 5], axis=0), 0.0)


def test_top_k_route_by_hand():
    probs = jnp.array([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.1, 0.4]])
    w, ids = top_k_route(probs, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 3]])  # the tie goes to the lower id
    np.testing.assert_allclose(w, [[0.5, 0.3], [0.4, 0.4]])
    w, _ = top_k_route(probs, 2, norm_topk_prob=True)
    np.testing.assert_allclose(w, [[0.625, 0.375], [0.5, 0.5]])
    assert ids.dtype == jnp.int32


def test_replay_gathers_from_the_full_softmax():
    """Replayed ids outside the router's top k still get their own probability and a gradient."""
    x, router, _ = _weights(3)
    probs = router_probs(x, router)
    np.testing.assert_allclose(probs, jax.nn.softmax(x @ router, axis=-1), rtol=1e-6)
    _, native = top_k_route(probs, K, norm_topk_prob=True)
    bottom = jnp.argsort(probs, axis=-1)[:, :K].astype(jnp.int32)  # the least probable experts
    assert not np.any(np.asarray(native)[:, :, None] == np.asarray(bottom)[:, None, :])
    np.testing.assert_allclose(replay_route(probs, bottom, False), jnp.take_along_axis(probs, bottom, -1))
    grad = jax.grad(lambda r: jnp.sum(replay_route(router_probs(x, r), bottom, True)[:, 0]))(router)
    assert float(jnp.abs(grad[:, np.asarray(bottom)[:, 0]]).max()) > 0


def test_expert_form_for_each_platform_and_phase():
    assert expert_form_for("cpu", "train").kernel == ExpertForm.DENSE_CAPACITY
    assert "dense expansion" in expert_form_for("cpu", "prefill").reason
    assert expert_form_for("tpu", "train").kernel == ExpertForm.RAGGED_DOT
    assert expert_form_for("gpu", "train").kernel == expert_form_for("cuda", "prefill").kernel == \
        ExpertForm.DENSE_CAPACITY
    assert all(expert_form_for(p, "decode").kernel == ExpertForm.DENSE_CAPACITY for p in ("cpu", "tpu", "gpu"))
    assert set(EXPERT_FORMS) == {"ragged_dot", "dense_capacity", "reference"}
    with pytest.raises(ValueError, match="phase='score'"):
        expert_form_for("cpu", "score")
    assert expert_weight_grad_for("tpu").kernel == ExpertWeightGrad.TGMM
    assert all(expert_weight_grad_for(p).kernel == ExpertWeightGrad.RAGGED_DOT for p in ("cpu", "gpu", "cuda"))


def test_bfloat16_forms_stay_close():
    """bf16 matmul inputs: values and float32 gradients (x, experts) within 2% of float32's."""
    x, router, experts = _weights(1)
    w, ids = top_k_route(router_probs(x, router), K, True)
    run = lambda form, dtype: jax.value_and_grad(
        lambda x, ex: jnp.sum(expert_ffn(x, ids, w, ex, form, dtype=dtype) ** 2), argnums=(0, 1))(x, experts)
    ref = run("reference", jnp.float32)
    for form in EXPERT_FORMS:
        out = run(form, jnp.bfloat16)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            assert a.dtype == jnp.float32
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(jnp.abs(b).max()), err_msg=form)
