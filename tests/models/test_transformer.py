"""forward / hidden_states / score_tokens agree with each other (the NNX model's functional API)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.models import (
    ModelConfig,
    abstract_model,
    forward,
    hidden_states,
    init_model,
    positions_from_mask,
    score_tokens,
)

TINY = ModelConfig(
    architecture="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, dtype="float32",
)
LENGTHS = (8, 5, 1)
T = 8


def _left_padded_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(LENGTHS), T), np.int32)
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, T - n:] = rng.integers(1, TINY.vocab_size, n)
        mask[b, T - n:] = 1
    return jnp.asarray(tokens), jnp.asarray(mask)


def _graphdef(config):
    """The graphdef of the same module tree under another config (compute dtype, remat, query
    chunk are part of the module, not of its state: the float32 state is reused as it is)."""
    return abstract_model(config)[0]


@pytest.fixture(scope="module")
def model():
    # std 0.1 so logits are far from uniform and mistakes show.
    return init_model(TINY, jax.random.key(0), std=0.1)


def test_left_padded_rows_equal_rows_alone(model):
    graphdef, state = model
    tokens, mask = _left_padded_batch()
    tokens = jnp.where(mask > 0, tokens, -1)  # an out-of-range pad id must not poison real rows
    logits = forward(graphdef, state, tokens, positions=positions_from_mask(mask), attention_mask=mask)
    assert logits.shape == (3, T, TINY.vocab_size) and logits.dtype == jnp.float32
    for b, n in enumerate(LENGTHS[1:], start=1):
        # Same row alone, right-aligned in a full-length unpadded batch of one: compare last n.
        alone = tokens[b:b + 1, T - n:]
        ones = jnp.ones_like(alone)
        ref = forward(graphdef, state, jnp.pad(alone, ((0, 0), (0, T - n))), positions=jnp.arange(T)[None],
                      attention_mask=jnp.pad(ones, ((0, 0), (0, T - n))))
        np.testing.assert_allclose(logits[b, T - n:], ref[0, :n], atol=1e-5)
    assert np.isfinite(np.asarray(logits)).all()
    chunked = forward(_graphdef(TINY.replace(attention_query_chunk=3)), state, tokens,
                      positions=positions_from_mask(mask), attention_mask=mask)
    np.testing.assert_allclose(chunked, logits, atol=1e-5)


def test_score_tokens_equals_log_softmax_of_forward(model):
    graphdef, state = model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)
    logits = forward(graphdef, state, tokens, positions=positions, attention_mask=mask) / 0.7
    ref_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    ref_ent = -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1)
    # chunk 3 does not divide T = 8: exercises the padding of the last chunk.
    logp, ent = score_tokens(graphdef, state, tokens, targets, positions=positions, attention_mask=mask,
                             temperature=0.7, chunk_size=3)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
    # hidden_states is what score_tokens puts under the LM head: logits = h W_head (untied head).
    h = hidden_states(graphdef, state, tokens, positions=positions, attention_mask=mask)
    assert h.shape == (3, T, TINY.hidden_size) and h.dtype == jnp.float32
    np.testing.assert_allclose(h @ state["lm_head"]["kernel"].get_value() / 0.7, logits, atol=1e-4)


def test_scoring_the_last_positions_only_equals_the_full_scoring_there(model):
    """first_scored = k: positions < k come back 0 and the LM head skips them; the rest, and the
    gradient of a loss over them, equal the full scoring."""
    graphdef, state = model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)
    k = 3
    tail = jnp.zeros_like(mask).at[:, k:].set(mask[:, k:]).astype(jnp.float32)

    def score(s, first):
        return score_tokens(graphdef, s, tokens, targets, positions=positions, attention_mask=mask, chunk_size=2,
                            first_scored=first)

    (full_lp, full_ent), (lp, ent) = score(state, 0), score(state, k)
    np.testing.assert_allclose(lp[:, k:], full_lp[:, k:], atol=1e-6)
    np.testing.assert_allclose(ent[:, k:], full_ent[:, k:], atol=1e-6)
    assert not np.asarray(lp[:, :k]).any() and not np.asarray(ent[:, :k]).any()
    grads = [jax.grad(lambda s: jnp.sum(score(s, first)[0] * tail))(state) for first in (0, k)]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_score_tokens_gradients(model):
    """Chunked + remat gradients equal the unchunked ones (f32); bf16 compute gives f32 grads close to them."""
    graphdef, state = model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)

    def chunked(s, gdef):
        logp, _ = score_tokens(gdef, s, tokens, targets, positions=positions, attention_mask=mask, chunk_size=4)
        return jnp.sum(logp * mask)

    def full(s):
        logits = forward(graphdef, s, tokens, positions=positions, attention_mask=mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(logp * mask)

    grad = jax.jit(jax.grad(chunked), static_argnums=1)
    # Chunked LM head, chunked attention (3 queries per block, padded) and remat together.
    g_chunked = grad(state, _graphdef(TINY.replace(remat=True, attention_query_chunk=3)))
    g_full = jax.jit(jax.grad(full))(state)
    g_bf16 = grad(state, _graphdef(TINY.replace(dtype="bfloat16", remat=True)))
    leaves = [jax.tree.leaves(g) for g in (g_chunked, g_full, g_bf16)]
    assert len(leaves[0]) == len(jax.tree.leaves(state)) == len(leaves[1]) == len(leaves[2])
    for a, b, c in zip(*leaves):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
        assert c.dtype == jnp.float32
        assert np.abs(c - b).max() <= 0.05 * np.abs(b).max() + 1e-6


def test_bfloat16_compute_stays_close_to_float32(model):
    graphdef, state = model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    f32 = forward(graphdef, state, tokens, positions=positions, attention_mask=mask)
    bf16 = forward(_graphdef(TINY.replace(dtype="bfloat16")), state, tokens, positions=positions,
                   attention_mask=mask)
    real = np.asarray(mask)[..., None] > 0
    assert bf16.dtype == jnp.float32
    assert np.abs(np.where(real, bf16 - f32, 0)).max() < 0.05 * np.abs(f32).max()


def _grouped_rows(seed=0, prompts=(5, 2, 4), group=3, prompt_width=6, response=5):
    """Rows of `group` responses per left-padded prompt (row n*group + j answers prompt n), with
    right padding after an early end in some responses; the teacher-forcing layout of the trainer."""
    rng = np.random.default_rng(seed)
    rows = len(prompts) * group
    tokens = np.zeros((rows, prompt_width + response), np.int32)
    mask = np.zeros_like(tokens)
    for n, length in enumerate(prompts):
        prompt = rng.integers(1, TINY.vocab_size, length)
        for j in range(group):
            r = n * group + j
            tokens[r, prompt_width - length:prompt_width] = prompt
            mask[r, prompt_width - length:prompt_width] = 1
            kept = response - (r % 3)  # 0, 1 or 2 padded response tokens
            tokens[r, prompt_width:prompt_width + kept] = rng.integers(1, TINY.vocab_size, kept)
            mask[r, prompt_width:prompt_width + kept] = 1
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    return tokens[:, :-1], tokens[:, 1:], positions_from_mask(mask)[:, :-1], mask[:, :-1], prompt_width


@pytest.mark.parametrize("config", [TINY.replace(remat=True), TINY.replace(attention_query_chunk=2)],
                         ids=["remat", "query_chunks"])
def test_shared_prompt_scoring_equals_scoring_every_row(model, config):
    """prompt_group = G (each prompt's forward run once for its G rows, Prefix Grouper): the
    scored log-probs, entropies and the gradient of a loss over them equal scoring each row whole."""
    _, state = model
    graphdef = _graphdef(config)
    inputs, targets, positions, mask, p = _grouped_rows()
    counted = jnp.zeros(mask.shape).at[:, p - 1:].set(jnp.roll(mask, -1, axis=1)[:, p - 1:])

    def score(s, group):
        return score_tokens(graphdef, s, inputs, targets, positions=positions, attention_mask=mask, chunk_size=3,
                            first_scored=p - 1, prompt_group=group, temperature=0.8)

    (lp, ent), (lp_shared, ent_shared) = score(state, 1), score(state, 3)
    real = np.asarray(mask) > 0  # a padding input's score is meaningless (whole rows: it sees only padding)
    np.testing.assert_allclose(np.asarray(lp_shared)[real], np.asarray(lp)[real], atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent_shared)[real], np.asarray(ent)[real], atol=2e-5)
    assert not np.asarray(lp_shared[:, :p - 1]).any()
    loss = lambda s, group: jnp.sum(score(s, group)[0] * counted) + 0.1 * jnp.sum(score(s, group)[1] * counted)
    grads = [jax.jit(jax.grad(loss), static_argnums=1)(state, group) for group in (1, 3)]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4)


def test_shared_prompt_needs_whole_groups_and_a_prompt(model):
    graphdef, state = model
    inputs, targets, positions, mask, p = _grouped_rows()
    kwargs = dict(positions=positions, attention_mask=mask)
    with pytest.raises(ValueError, match="whole groups"):
        score_tokens(graphdef, state, inputs, targets, first_scored=p - 1, prompt_group=4, **kwargs)
    with pytest.raises(ValueError, match="first_scored > 0"):
        score_tokens(graphdef, state, inputs, targets, prompt_group=3, **kwargs)


# ---------------------------------------------------------------------------- mixture of experts: routes
TINY_MOE = TINY.replace(architecture="qwen3_moe", intermediate_size=0, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_model():
    return init_model(TINY_MOE, jax.random.key(1), std=0.1)


def _router_grads(graphdef, state, tokens, mask, routes):
    """d sum(logp * mask) / d state, with the experts forced to `routes` (None: the router's own)."""
    positions = positions_from_mask(mask)

    def loss(s):
        logp, _ = score_tokens(graphdef, s, tokens, jnp.roll(tokens, -1, axis=1), positions=positions,
                               attention_mask=mask, chunk_size=4, routes=routes)
        return jnp.sum(logp * mask)

    return jax.jit(jax.grad(loss))(state)


@pytest.mark.xla_default_opt  # bit-equality of two programs (tests/conftest.py)
def test_replaying_the_native_routes_gives_the_native_forward_and_gradients(moe_model):
    graphdef, state = moe_model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    logits, routes = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, return_routes=True)
    assert routes.shape == (3, T, TINY_MOE.num_layers, 2) and routes.dtype == jnp.int32
    assert np.all(np.sort(np.asarray(routes), -1)[..., 0] < np.sort(np.asarray(routes), -1)[..., 1])  # distinct
    replayed, again = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, routes=routes,
                              return_routes=True)
    np.testing.assert_array_equal(replayed, logits)
    np.testing.assert_array_equal(again, routes)
    for a, b in zip(jax.tree.leaves(_router_grads(graphdef, state, tokens, mask, routes)),
                    jax.tree.leaves(_router_grads(graphdef, state, tokens, mask, None))):
        np.testing.assert_array_equal(a, b)


def test_other_routes_change_the_output_and_train_the_router(moe_model):
    graphdef, state = moe_model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    native, routes = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, return_routes=True)
    other = (routes + 1) % TINY_MOE.num_experts  # still k distinct experts per token, mostly outside the top k
    forced, _ = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, routes=other,
                        return_routes=True)
    real = np.asarray(mask) > 0
    assert np.abs(np.asarray(forced - native))[real].max() > 1e-3
    grad = lambda r: _router_grads(graphdef, state, tokens, mask, r)["layers"]["mlp"]["router"].get_value()
    forced_grad, native_grad = grad(other), grad(routes)  # [L, D, E]
    for layer in range(TINY_MOE.num_layers):  # every router is trained through the replayed experts' weights
        assert float(jnp.abs(forced_grad[layer]).max()) > 0
        assert float(jnp.abs(forced_grad[layer] - native_grad[layer]).max()) > 1e-6


def test_routes_of_the_wrong_shape_are_refused_naming_the_expected_one(moe_model):
    graphdef, state = moe_model
    tokens, mask = _left_padded_batch()
    positions = positions_from_mask(mask)
    _, routes = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, return_routes=True)
    c = TINY_MOE
    want = f"= {tuple(tokens.shape) + (c.num_layers, c.num_experts_per_tok)}"
    for bad in (routes[:, :-1], routes[:, :, :1], routes[..., :1]):  # a position short, a layer short, k short
        with pytest.raises(ValueError, match=re.escape(want)):
            forward(graphdef, state, tokens, positions=positions, attention_mask=mask, routes=bad)


def test_dense_models_never_run_the_moe_code(model, moe_model):
    tokens, mask = _left_padded_batch()
    lowered = lambda m: forward.lower(*m, tokens, positions=positions_from_mask(mask), attention_mask=mask).as_text()
    dense, moe = lowered(model), lowered(moe_model)
    assert "top_k" in moe  # the router's
    assert "top_k" not in dense and "scatter" not in dense and "ragged" not in dense
    graphdef, state = model
    with pytest.raises(ValueError, match="only mixture-of-experts models take them"):
        forward(graphdef, state, tokens, positions=positions_from_mask(mask), attention_mask=mask,
                routes=jnp.zeros((3, T, 2, 2), jnp.int32))
    assert forward(graphdef, state, tokens, positions=positions_from_mask(mask), attention_mask=mask,
                   return_routes=True)[1] is None
