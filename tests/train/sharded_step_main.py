"""Run in a subprocess with 8 simulated CPU devices: the train step on a (data=2, fsdp=2,
tensor=2) mesh gives the same loss, gradient norm and updated parameters as on one device (a dense
model: padded, shared-prompt and packed rows; a mixture of experts replaying routes)."""

import os
import sys

from tests.subprocess_xla_flags import xla_flags  # imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.core import DAPO, compute_advantages  # noqa: E402
from jaxrl4llm.models import ModelConfig, batch_sharding, init_model, make_mesh, param_shardings, score_tokens  # noqa: E402
from jaxrl4llm.train.step import (TrainBatch, UpdateSettings, batch_shardings, init_train_state,  # noqa: E402
                                  make_optimizer, make_update_fn, train_state_shardings)


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    cfg = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, dtype="float32")
    graphdef, params = init_model(cfg, jax.random.PRNGKey(0))
    logprob_fn = lambda p, x, y, pos, m: score_tokens(graphdef, p, x, y, positions=pos, attention_mask=m, chunk_size=8)
    B, L, G = 16, 12, 4
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (B, L + 1)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    attn[:4, :3] = 0  # some left padding
    pos = np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32)
    loss_mask = (np.arange(L)[None] >= 5).astype(np.float32) * (rng.random((B, L)) > 0.2)
    old, _ = logprob_fn(params, tokens[:, :-1], tokens[:, 1:], pos, attn)
    old = np.asarray(old) + 0.05 * rng.standard_normal((B, L)).astype(np.float32)
    rewards = rng.integers(0, 2, B).astype(np.float32)
    adv = compute_advantages(jnp.asarray(rewards), G, DAPO, lengths=jnp.asarray(loss_mask.sum(1)))
    batch = TrainBatch(jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(pos), jnp.asarray(attn),
                       jnp.asarray(loss_mask), jnp.asarray(old), jnp.asarray(old), jnp.asarray(old),
                       adv.advantages, adv.row_weights, adv.denominator_weights)
    opt, sched = make_optimizer(lr=1e-2, max_grad_norm=1.0)
    make = functools.partial(make_update_fn, logprob_fn=logprob_fn, recipe=DAPO, optimizer=opt, schedule=sched,
                             settings=UpdateSettings(mini_batches=2, micro_batches=2))

    single = jax.jit(make())(init_train_state(params, opt), batch)

    mesh = make_mesh(2, 2, 2)
    sharded_params = jax.device_put(params, param_shardings(params, mesh))
    state = jax.jit(lambda p: init_train_state(p, opt))(sharded_params)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    sharded_batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape)), batch)
    multi = jax.jit(make(), out_shardings=(state_sh, None, None))(state, sharded_batch)

    n_sharded = sum(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(multi[0].params))
    assert n_sharded > 0, "no parameter ended up sharded"
    for k in ("loss", "grad_norm", "clip_frac", "entropy"):
        np.testing.assert_allclose(single[1][k], multi[1][k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(single[0].params), jax.tree.leaves(multi[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)  # lr 1e-2: 0.2% of a step
    np.testing.assert_array_equal(np.asarray(single[2]), np.asarray(multi[2]))

    # as the loop runs it: optimizer state pinned to the parameter shardings, the batch placed by
    # in_shardings, the model's activation constraints active under the mesh context
    pinned = train_state_shardings(param_shardings(params, mesh), opt, params, mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: init_train_state(p, opt), out_shardings=pinned)(sharded_params)
        looped = jax.jit(make(), in_shardings=(pinned, batch_shardings(mesh)), out_shardings=(pinned, None, None))(
            state, batch)
    for k in ("loss", "grad_norm", "clip_frac", "entropy"):
        np.testing.assert_allclose(single[1][k], looped[1][k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(single[0].params), jax.tree.leaves(looped[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)
    # Adam's moments sit where their parameters do (pinned), not where propagation left them
    param_specs = {(x.shape, x.sharding.spec) for x in jax.tree.leaves(looped[0].params)}
    moments = [x for x in jax.tree.leaves(looped[0].opt_state) if x.ndim >= 1]
    assert moments and all((x.shape, x.sharding.spec) in param_specs for x in moments)
    assert any(not x.sharding.is_fully_replicated for x in moments), "optimizer state fully replicated"

    # each prompt's forward once for its rows (UpdateSettings.prompt_group), sharded as the loop
    # runs it: micro-batches of 4 rows hold 2 prompts, fewer than the 4 data x fsdp devices
    from jaxrl4llm.train.policy import make_logprob_fn

    P, pair = 5, 2
    grouped = np.asarray(tokens).copy()
    grouped[:, :P] = grouped[::pair, :P].repeat(pair, 0)
    g_attn = attn.copy()
    g_attn[:, :P] = g_attn[::pair, :P].repeat(pair, 0)
    g_pos = np.maximum(np.cumsum(g_attn, 1) - 1, 0).astype(np.int32)
    g_batch = batch._replace(input_tokens=jnp.asarray(grouped[:, :-1]), targets=jnp.asarray(grouped[:, 1:]),
                             positions=jnp.asarray(g_pos), attention_mask=jnp.asarray(g_attn))
    scored = L - P + 1
    make_grouped = lambda group: make_update_fn(
        logprob_fn=make_logprob_fn(graphdef, 1.0, 8), recipe=DAPO, optimizer=opt, schedule=sched,
        settings=UpdateSettings(mini_batches=2, micro_batches=2, scored_tokens=scored, prompt_group=group))
    whole = jax.jit(make_grouped(None))(init_train_state(params, opt), g_batch)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: init_train_state(p, opt), out_shardings=pinned)(sharded_params)
        shared = jax.jit(make_grouped(pair), in_shardings=(pinned, batch_shardings(mesh)),
                         out_shardings=(pinned, None, None))(state, g_batch)
    for k in ("loss", "grad_norm", "clip_frac", "entropy"):
        np.testing.assert_allclose(whole[1][k], shared[1][k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(whole[0].params), jax.tree.leaves(shared[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(whole[2]), np.asarray(shared[2]))
    check_packed(graphdef, params, opt, sched, mesh, pinned, sharded_params)
    check_moe(batch, opt, sched, mesh)
    check_moe_bfloat16(mesh)
    print(f"OK sharded params: {n_sharded}, loss {float(single[1]['loss']):.6f} vs {float(multi[1]['loss']):.6f}")
    return 0


def check_moe(batch, opt, sched, mesh):
    """A mixture of experts replaying routes, with the load-balancing loss, as the loop runs it on the
    (2, 2, 2) mesh (each batch shard routes its own rows and sums its router stats with the others':
    `layers.moe.moe_ffn`'s shard_map), equals one device."""
    from jaxrl4llm.models import forward
    from jaxrl4llm.train.policy import make_logprob_fn

    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, dtype="float32",
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    graphdef, params = init_model(cfg, jax.random.PRNGKey(1))
    _, routes = forward(graphdef, params, batch.input_tokens, positions=batch.positions,
                        attention_mask=batch.attention_mask, return_routes=True)
    batch = batch._replace(routes=routes.astype(jnp.uint8))
    make = lambda: make_update_fn(logprob_fn=make_logprob_fn(graphdef, 1.0, 8), recipe=DAPO, optimizer=opt,
                                  schedule=sched, settings=UpdateSettings(mini_batches=2, micro_batches=2,
                                                                           router_aux_loss_coef=0.1))
    single = jax.jit(make())(init_train_state(params, opt), batch)
    pinned = train_state_shardings(param_shardings(params, mesh), opt, params, mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda p: init_train_state(p, opt), out_shardings=pinned)(
            jax.device_put(params, param_shardings(params, mesh)))
        update = jax.jit(make(), in_shardings=(pinned, batch_shardings(mesh)), out_shardings=(pinned, None, None))
        text = update.lower(state, batch).as_text()
        looped = update(state, batch)
    assert "shard_map" in text or "sdy.manual_computation" in text, "the experts did not run per batch shard"
    # the ragged form with TPU's weight gradient (megablox's tgmm, in Pallas' interpreter here) in the
    # per-batch-shard shard_map, which then runs unchecked: the same update as one device's dense_capacity
    from jaxrl4llm.kernels.choice import ExpertWeightGrad, KernelChoice
    from jaxrl4llm.models.layers import moe

    moe.expert_weight_grad_for = lambda platform: KernelChoice(ExpertWeightGrad.TGMM, "as on TPU")
    graphdef, _ = init_model(cfg.replace(expert_form="ragged_dot"), jax.random.PRNGKey(1))  # `make` reads it
    with jax.set_mesh(mesh):
        ragged = jax.jit(make(), in_shardings=(pinned, batch_shardings(mesh)), out_shardings=(pinned, None, None))(
            state, batch)
    for run in (looped, ragged):
        for k in ("loss", "grad_norm", "clip_frac", "entropy", "router_aux_loss"):
            np.testing.assert_allclose(single[1][k], run[1][k], rtol=2e-5, atol=1e-6, err_msg=k)
        for a, b in zip(jax.tree.leaves(single[0].params), jax.tree.leaves(run[0].params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)


def check_moe_bfloat16(mesh):
    """The dense_capacity form in bfloat16 (`linear.einsum`'s custom backward) inside `moe_ffn`'s
    per-batch-shard shard_map: the weights' gradients (per shard, summed over the shards) equal one
    device's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxrl4llm.models.layers.moe import Experts, moe_ffn

    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    h = jax.random.normal(keys[0], (8, 4, 32))
    router = jax.random.normal(keys[1], (32, 4))
    shapes = [(4, 32, 16), (4, 32, 16), (4, 16, 32)]
    experts = Experts(*(0.3 * jax.random.normal(k, s) for k, s in zip(keys[2:], shapes)))
    loss = lambda h, router, experts: jnp.sum(moe_ffn(h, router, experts, k=2, norm_topk_prob=True,
                                                      form="dense_capacity", dtype=jnp.bfloat16)[0] ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2))
    single = jax.jit(grads)(h, router, experts)
    with jax.set_mesh(mesh):
        rows = jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"), None, None)))
        sharded = jax.jit(grads)(rows, router, experts)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)


def check_packed(graphdef, params, opt, sched, mesh, pinned, sharded_params):
    """Packed rows (train/packing.py) on the 4 data x fsdp devices, as the loop runs them, equal
    the padded update on one device: loss, metrics, parameters and clip flags."""
    from jaxrl4llm.sampling import Rollout
    from jaxrl4llm.train.batching import rollout_to_batch
    from jaxrl4llm.train.packing import pack, pack_layout, pack_plan, packed_shardings, to_padded
    from jaxrl4llm.train.policy import make_logprob_fn

    rng = np.random.default_rng(3)
    B, P, R, G = 16, 5, 8, 4
    plen = np.repeat(rng.integers(1, P + 1, B // G), G)
    prompt_mask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.float32)
    lengths = rng.integers(0, R + 1, B)
    response_mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    logp = -np.abs(rng.standard_normal((B, R))).astype(np.float32) * response_mask
    rollout = Rollout(jnp.asarray(rng.integers(1, 64, (B, P)), jnp.int32) * prompt_mask.astype(np.int32),
                      jnp.asarray(prompt_mask), jnp.asarray(rng.integers(1, 64, (B, R)), jnp.int32),
                      jnp.asarray(response_mask), jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(lengths, jnp.int32),
                      jnp.asarray(lengths == R))
    adv = compute_advantages(jnp.asarray(rng.integers(0, 2, B), jnp.float32), G, DAPO, truncated=rollout.truncated,
                             lengths=rollout.lengths)
    batch = rollout_to_batch(rollout, adv)
    batch = batch._replace(old_logp=batch.old_logp + 0.05 * batch.loss_mask)
    layout = pack_layout(rows=B, mini_batches=2, shards=4, prompt_width=P, response_width=R, tokens_per_micro_batch=12)
    plan = pack_plan(plen, lengths, layout, P)
    logprob_fn = make_logprob_fn(graphdef, 1.0, 8)
    make = lambda settings: make_update_fn(logprob_fn=logprob_fn, recipe=DAPO, optimizer=opt, schedule=sched,
                                           settings=settings)
    padded = jax.jit(make(UpdateSettings(mini_batches=2, micro_batches=2)))(init_train_state(params, opt), batch)
    with jax.set_mesh(mesh):
        packed = jax.jit(pack, out_shardings=packed_shardings(mesh))(batch, plan)
        state = jax.jit(lambda p: init_train_state(p, opt), out_shardings=pinned)(sharded_params)
        run = jax.jit(make(UpdateSettings(mini_batches=2, packing=layout)),
                      in_shardings=(pinned, packed_shardings(mesh)), out_shardings=(pinned, None, None))(state, packed)
    assert packed.input_tokens.sharding.spec[2] is not None, packed.input_tokens.sharding  # rows split over devices
    for k in padded[1]:
        np.testing.assert_allclose(padded[1][k], run[1][k], rtol=1e-4, atol=1e-6, err_msg=f"packed {k}")
    # Two Adam steps (lr 1e-2) normalise each gradient element: where an element's two mini-batch
    # gradients nearly cancel, a float32 summation-order difference (the sharded packed sum against
    # the padded one) moves it by a few 1e-5 (AMD EPYC, 2026-11-27: 1 of 2048 elements off by 3.1e-5,
    # at main a6d1015 too). A wrong update would be off by ~lr = 1e-2.
    for a, b in zip(jax.tree.leaves(padded[0].params), jax.tree.leaves(run[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(to_padded(np.asarray(run[2]), plan, *batch.loss_mask.shape), np.asarray(padded[2]))


if __name__ == "__main__":
    sys.exit(main())
