"""`model.numerics: exact` (kernels/exact.py, issue #39 item 4): batch-invariant kernels, and the
sampler's log-probs equal to the trainer's recompute bit for bit (zero differing tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.core import LITE_PPO, compute_advantages
from jaxrl4llm.kernels import exact
from jaxrl4llm.models import LoraSettings, ModelConfig, init_model
from jaxrl4llm.models.causal_lm import score_tokens
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.packing import PackPlan, pack, to_padded
from jaxrl4llm.train.policy import make_logprob_fn
from jaxrl4llm.train.step import make_logprob_pass

# the sampler's log-probs equal the trainer's bit for bit: at XLA's default LLVM optimisation level (tests/conftest.py)
pytestmark = pytest.mark.xla_default_opt

RNG = np.random.default_rng(0)
X = RNG.standard_normal((37, 96)).astype(np.float32)
W = RNG.standard_normal((96, 70)).astype(np.float32)


@given(rows=st.integers(1, 12), first=st.integers(0, 25))
@settings(max_examples=10, deadline=None)
def test_matmul_row_ignores_the_other_rows(rows, first):
    """y[m] of any slice of rows is bitwise y[m] of the whole batch, and close to x W."""
    full = np.asarray(exact.matmul(X, W))
    np.testing.assert_array_equal(np.asarray(exact.matmul(X[first:first + rows], W)), full[first:first + rows])
    np.testing.assert_allclose(full, X @ W, rtol=0, atol=2e-5)


def test_einsum_specs_match_jnp():
    for spec, x, w in [("btd,dhk->bthk", X.reshape(1, 37, 96), W[:, :64].reshape(96, 4, 16)),
                       ("bthk,hkd->btd", X[:, :64].reshape(1, 37, 4, 16), W[:64].reshape(4, 16, 70)),
                       ("mk,gnk->gmn", X, W.T.reshape(2, 35, 96)), ("btd,vd->btv", X[None], W.T)]:
        np.testing.assert_allclose(exact.einsum(spec, x, w, jnp.float32), np.einsum(spec, x, w), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="batch indices"):
        exact.einsum("bij,bjk->bik", np.ones((2, 3, 4)), np.ones((2, 4, 5)), jnp.float32)


def test_attention_matches_the_masked_softmax_and_one_query_alone():
    b, t, h, kvh, dh = 2, 12, 4, 2, 16
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((b, t, h, dh), (b, t, kvh, dh), (b, t, kvh, dh)))
    ids = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [0] * 3 + [1] * 9])
    ranges = exact.segment_ranges(ids)
    out = np.asarray(exact.attention(q, k, v, ranges, dtype=jnp.float32))
    np.testing.assert_allclose(out, exact._reference(q, k, v, ranges), rtol=0, atol=2e-6)
    # query 7 of row 0 (segment 2 starts at 5) alone, as a decode step sees it: its 3 keys in a row of their own
    alone = exact.attention(q[:1, 7:8], k[:1, 5:8], v[:1, 5:8], jnp.asarray([[[0, 3, 0, 0]]]), dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(alone)[0, 0], out[0, 7])
    grad = jax.grad(lambda q: exact.attention(q, k, v, ranges, dtype=jnp.float32).sum())(q)
    np.testing.assert_allclose(grad, jax.grad(lambda q: exact._reference(q, k, v, ranges).sum())(q), atol=1e-5)


def test_token_logprobs_and_rms_norm_match_their_formulas():
    z = RNG.standard_normal((5, 300)).astype(np.float32) * 4
    tokens = jnp.asarray([1, 2, 3, 299, 0])
    np.testing.assert_allclose(exact.token_logprobs(z, tokens), jax.nn.log_softmax(z)[np.arange(5), tokens],
                               rtol=0, atol=2e-6)
    grad = jax.grad(lambda z: exact.token_logprobs(z, tokens).sum())(z)
    np.testing.assert_allclose(grad, jax.grad(lambda z: jax.nn.log_softmax(z)[np.arange(5), tokens].sum())(z),
                               atol=1e-6)
    y = exact.rms_norm(X, np.ones(96, np.float32), 1e-6)
    np.testing.assert_allclose(y, X / np.sqrt((X * X).mean(-1, keepdims=True) + 1e-6), rtol=2e-6)


def tiny(dtype: str, **fields) -> ModelConfig:
    return ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=64, intermediate_size=192, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                       tie_word_embeddings=True, dtype=dtype, param_dtype="float32", numerics="exact", **fields)


def packed_rows(plen, rlen, p, width, row_width=128):
    """A PackPlan of one micro-batch: the sequences side by side in rows of `row_width`, in order,
    a sequence (its plen + rlen - 1 positions) starting a new row when it does not fit."""
    need = plen + rlen - 1
    rows, used = [[]], 0
    for b, n in enumerate(need):
        if used + n > row_width:
            rows, used = rows + [[]], 0
        rows[-1].append(b)
        used += n
    source = np.full((1, 1, len(rows), row_width), -1, np.int32)
    segments = np.zeros_like(source)
    slot_sequence = np.full((1, 1, len(rows), 8), -1, np.int32)
    slot_first = np.zeros_like(slot_sequence)
    for r, row in enumerate(rows):
        offset = 0
        for k, b in enumerate(row):
            source[0, 0, r, offset:offset + need[b]] = b * width + p - plen[b] + np.arange(need[b])
            segments[0, 0, r, offset:offset + need[b]] = k + 1
            slot_sequence[0, 0, r, k], slot_first[0, 0, r, k] = b, offset + plen[b] - 1
            offset += need[b]
    return PackPlan(source, segments, slot_sequence, slot_first, np.ones(1, np.int32))


@pytest.fixture
def exact_kernels(request, monkeypatch):
    """The kernels of exact numerics: "cpp" (the C++ CPU kernels) or "pallas" (the Pallas kernels of
    GPUs and TPUs, in Pallas' interpreter: $JAXRL4LLM_EXACT_KERNELS, read when a program traces, so
    the other route's compiled programs are dropped before and after)."""
    if request.param == "pallas":
        monkeypatch.setenv(exact.KERNELS_ENV, "pallas")
        jax.clear_caches()
    yield request.param
    if request.param == "pallas":
        jax.clear_caches()


@pytest.mark.parametrize("dtype, temperature, exact_kernels", [("bfloat16", 0.7, "cpp"), ("float32", 1.0, "pallas")],
                         indirect=["exact_kernels"])
def test_sampler_logprobs_equal_the_trainers_bit_for_bit(dtype, temperature, exact_kernels):
    """Continuous batching (6 slots for 16 rows: rows enter slots as others finish), prompts of 3
    to 12 tokens; the trainer's recompute over left-padded rows, shared-prompt rows and packed rows
    gives every sampled token the sampler's log-prob, bit for bit, with the C++ kernels and with the
    Pallas kernels a GPU or TPU runs (here in Pallas' interpreter). Default numerics on the same
    model differ (the test can fail)."""
    assert exact.use_pallas() == (exact_kernels == "pallas")
    graphdef, state = init_model(tiny(dtype), jax.random.PRNGKey(0), std=0.1)
    prompts = [list(RNG.integers(2, 256, n)) for n in (3, 7, 12, 5)]
    r = 16
    rollout = generate(graphdef, state, prompts, num_samples=4, max_new_tokens=r, eos_token_ids=[1], pad_token_id=0,
                       rng=jax.random.PRNGKey(1), slots=6, temperature=temperature)
    sampled, mask = np.asarray(rollout.logprobs_untruncated), np.asarray(rollout.response_mask) > 0
    batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(16, jnp.float32), 4, LITE_PPO))
    logprob_fn = make_logprob_fn(graphdef, temperature, 128)
    padded, _ = jax.jit(make_logprob_pass(logprob_fn, 1, r))(state, batch)
    np.testing.assert_array_equal(np.asarray(padded)[:, -r:][mask], sampled[mask])

    p = rollout.prompt_tokens.shape[1]
    tokens = jnp.asarray(np.concatenate([rollout.prompt_tokens, rollout.response_tokens], 1))
    attention = jnp.asarray(np.concatenate([rollout.prompt_mask, np.ones((16, r))], 1), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention, 1) - 1, 0)
    shared, _ = score_tokens(graphdef, state, tokens[:, :-1], tokens[:, 1:], positions=positions[:, :-1],
                             attention_mask=attention[:, :-1], first_scored=p - 1, prompt_group=4,
                             temperature=temperature)
    np.testing.assert_array_equal(np.asarray(shared)[:, p - 1:][mask], sampled[mask])

    plan = packed_rows(np.asarray(rollout.prompt_mask).sum(1).astype(int), np.asarray(rollout.lengths), p,
                       batch.targets.shape[1])
    packed, _ = jax.jit(make_logprob_pass(logprob_fn, 1))(state, pack(batch, plan))
    np.testing.assert_array_equal(to_padded(np.asarray(packed), plan, 16, batch.targets.shape[1])[:, -r:][mask],
                                  sampled[mask])

    default = ModelConfig(**{**tiny(dtype).__dict__, "numerics": "default"})
    graphdef_default, _ = init_model(default, jax.random.PRNGKey(0), std=0.1)
    again, _ = jax.jit(make_logprob_pass(make_logprob_fn(graphdef_default, temperature, 128), 1, r))(state, batch)
    assert np.any(np.asarray(again)[:, -r:][mask] != sampled[mask])


def test_exact_numerics_refuses_what_it_cannot_keep_exact():
    with pytest.raises(ValueError, match="LoRA"):
        init_model(tiny("float32"), jax.random.PRNGKey(0), lora=LoraSettings(rank=2))
    graphdef, state = init_model(tiny("float32"), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="rollout.engine=continuous"):
        generate(graphdef, state, [[3, 4]], num_samples=1, max_new_tokens=2, eos_token_ids=[1], pad_token_id=0,
                 rng=jax.random.PRNGKey(0), engine="static")
