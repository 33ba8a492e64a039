"""The sampler's log-probs against the trainer's re-score of the same tokens, on a tiny bf16 model
(issue #39; benchmarks/mismatch.py measures the same on real checkpoints)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.core import LITE_PPO, agreement_stats, compute_advantages, route_disagreement
from jaxrl4llm.models import ModelConfig, init_model
from jaxrl4llm.sampling import generate
from jaxrl4llm.train.batching import rollout_to_batch
from jaxrl4llm.train.packing import pack, pack_layout, pack_plan, to_padded
from jaxrl4llm.train.policy import make_logprob_fn, make_routing_fn
from jaxrl4llm.train.step import make_logprob_pass

R = 16


@pytest.fixture(scope="module")
def bf16_rollout():
    config = ModelConfig(architecture="qwen3", vocab_size=256, hidden_size=64, intermediate_size=192, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                         tie_word_embeddings=True, dtype="bfloat16", param_dtype="float32")
    graphdef, state = init_model(config, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 256, size=n).tolist() for n in (5, 9, 3)]
    rollout = generate(graphdef, state, prompts, num_samples=2, max_new_tokens=R, temperature=1.0, eos_token_ids=[1],
                       pad_token_id=0, rng=jax.random.PRNGKey(1), engine="continuous", cpu_kernels=False)
    batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(6, jnp.float32), 2, LITE_PPO))
    return graphdef, state, rollout, batch, make_logprob_fn(graphdef, 1.0, 128)


def test_padded_trainer_rows_agree_with_the_sampler(bf16_rollout):
    graphdef, state, rollout, batch, logprob_fn = bf16_rollout
    logp, _ = jax.jit(make_logprob_pass(logprob_fn, 1, R))(state, batch)
    stats = agreement_stats(logp, batch.sampler_logp, batch.loss_mask)
    assert int(stats["tokens"]) > 30
    # bf16 on both sides, the same math: ~1e-6 nats on this model (measured 7e-7); a trainer or
    # sampler that rounds differently (a bf16 log-softmax, another matmul precision) is >= 1e-3
    assert float(stats["out_1"]) == 0.0 and float(stats["max_abs"]) < 1e-4, stats


def test_packed_trainer_rows_score_as_the_padded_ones(bf16_rollout):
    graphdef, state, rollout, batch, logprob_fn = bf16_rollout
    width = rollout.prompt_tokens.shape[1]
    layout = pack_layout(rows=6, mini_batches=1, shards=1, prompt_width=width, response_width=R,
                         tokens_per_micro_batch=None)
    packed = pack(batch, pack_plan(np.asarray(rollout.prompt_mask).sum(1), np.asarray(rollout.lengths), layout,
                                   width))
    logp, _ = jax.jit(make_logprob_pass(logprob_fn, 1))(state, packed)
    flat = lambda x: x.reshape(-1, x.shape[-1])
    stats = agreement_stats(flat(logp), flat(packed.sampler_logp), flat(packed.loss_mask))
    assert int(stats["tokens"]) == int(np.asarray(batch.loss_mask).sum())
    assert float(stats["out_1"]) == 0.0 and float(stats["max_abs"]) < 1e-4, stats


def test_the_log_prob_pass_replays_the_samplers_routes():
    """trainer.router_replay=rollout: a batch built from a rollout with recorded routes scores as
    score_tokens(routes=) with the forward's routes of the sampled sequences (what the sampler ran),
    under changed weights too, where native routing would pick other experts; packed, the same batch
    (its routes gathered with its tokens) scores as the padded one, and so do shared-prompt rows."""
    from jaxrl4llm.models import forward, score_tokens

    config = ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=0, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, dtype="float32")
    graphdef, state = init_model(config, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 128, size=n).tolist() for n in (5, 3)]
    rollout = generate(graphdef, state, prompts, num_samples=2, max_new_tokens=8, temperature=1.0, eos_token_ids=[1],
                       pad_token_id=0, rng=jax.random.PRNGKey(1), record_routes=True)
    batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(4, jnp.float32), 2, LITE_PPO))
    tokens = jnp.concatenate([rollout.prompt_tokens, rollout.response_tokens], axis=1)
    mask = jnp.concatenate([rollout.prompt_mask, rollout.response_mask], axis=1).astype(jnp.int32)
    _, ran = forward(graphdef, state, tokens, positions=jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0),
                     attention_mask=mask, return_routes=True)
    _, updated = init_model(config, jax.random.PRNGKey(2), std=0.3)  # other weights (the same compiled init)
    logp, _ = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, 128), 1))(updated, batch)
    score = lambda routes: score_tokens(graphdef, updated, batch.input_tokens, batch.targets,
                                        positions=batch.positions, attention_mask=batch.attention_mask,
                                        routes=routes)[0]
    counted = np.asarray(batch.loss_mask) > 0
    assert counted.sum() > 10
    np.testing.assert_allclose(np.asarray(logp)[counted], np.asarray(score(ran[:, :-1]))[counted], rtol=1e-5,
                               atol=1e-5)
    native = np.asarray(score(None))[counted]
    assert np.abs(native - np.asarray(logp)[counted]).max() > 1e-3  # replay is not native routing here
    width = rollout.prompt_tokens.shape[1]
    layout = pack_layout(rows=4, mini_batches=1, shards=1, prompt_width=width, response_width=8,
                         tokens_per_micro_batch=2 * width)  # two sequences or more to a packed row
    plan = pack_plan(np.asarray(rollout.prompt_mask).sum(1), np.asarray(rollout.lengths), layout, width)
    packed = pack(batch, plan)
    assert packed.routes.shape == packed.input_tokens.shape + batch.routes.shape[2:]
    assert (np.asarray(packed.segment_ids) > 1).any()  # sequences share rows: routes must not mix
    packed_logp, _ = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, 128), 1))(updated, packed)
    np.testing.assert_allclose(to_padded(np.asarray(packed_logp), plan, 4, batch.input_tokens.shape[1])[counted],
                               np.asarray(logp)[counted], rtol=1e-5, atol=1e-5)
    # shared-prompt rows (each prompt run once for its 2 rows, with its recorded prompt routes): the same scores
    shared_logp, _ = jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, 128), 1, 8, 2))(updated, batch)
    np.testing.assert_allclose(np.asarray(shared_logp)[counted], np.asarray(logp)[counted], rtol=1e-5, atol=1e-5)


def test_in_bfloat16_replaying_the_samplers_routes_narrows_the_log_prob_gap():
    """A tiny bf16 Qwen3-MoE over seeds: the sampler (the continuous engine's decode layout) and the
    trainer (the training forward) round differently, so some (token, layer) pairs pick another top-k
    set; scoring with the sampler's routes replayed never widens the mean |trainer - sampler| log-prob
    gap, and narrows it on the seeds where a differing route reaches a scored token (a flip in the last
    layer at an unscored position changes nothing scored), so its mean over the seeds is below native
    routing's (R3, arXiv 2510.11370)."""
    config = ModelConfig(architecture="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=0, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=32, dtype="bfloat16", param_dtype="float32")
    logprob_pass = None
    gaps, differed = [], []
    for seed in range(3):
        graphdef, state = init_model(config, jax.random.PRNGKey(seed), std=0.3)
        logprob_pass = logprob_pass or jax.jit(make_logprob_pass(make_logprob_fn(graphdef, 1.0, 128), 1))
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(2, 256, size=n).tolist() for n in (7, 4, 9, 5)]
        rollout = generate(graphdef, state, prompts, num_samples=2, max_new_tokens=R, temperature=1.0,
                           eos_token_ids=[1], pad_token_id=0, rng=jax.random.PRNGKey(seed), engine="continuous",
                           cpu_kernels=False, record_routes=True)
        batch = rollout_to_batch(rollout, compute_advantages(jnp.zeros(8, jnp.float32), 2, LITE_PPO))
        gap = lambda b: float(agreement_stats(logprob_pass(state, b)[0], batch.sampler_logp, batch.loss_mask)["mean_abs"])
        gaps.append((gap(batch), gap(batch._replace(routes=None))))
        _, native_routes, _ = make_routing_fn(graphdef, 1.0, 128)(state, batch.input_tokens, batch.targets,
                                                               batch.positions, batch.attention_mask)
        differed.append(float(route_disagreement(native_routes, batch.routes, batch.attention_mask)))
    assert any(d > 0 for d in differed), differed  # bf16 rounding flips some top-k sets at this size
    for (replayed, native), d in zip(gaps, differed):  # the same sets: equal up to the order of a k-term sum
        assert replayed <= native + 1e-6 and (d > 0 or replayed == pytest.approx(native, abs=1e-6)), (gaps, differed)
    replayed, native = np.mean(gaps, axis=0)
    assert replayed < native, (gaps, differed)
