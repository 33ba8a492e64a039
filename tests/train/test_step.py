"""Train step: micro-batch accumulation equals the full batch, for every aggregation mode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.core import AGGREGATION_MODES, DAPO, LITE_PPO
from jaxrl4llm.train.step import (UpdateSettings, batch_loss_terms, init_train_state, join_params, make_optimizer,
                                  make_update_fn)

from tests.train.toy_model import toy_batch, toy_logprob_fn, toy_params


def _run(recipe, settings, batch, lr=1e-2, params=None, frozen=None, logprob_fn=toy_logprob_fn):
    opt, sched = make_optimizer(lr=lr, max_grad_norm=None)
    update = jax.jit(make_update_fn(logprob_fn=logprob_fn, recipe=recipe, optimizer=opt, schedule=sched, settings=settings))
    state = init_train_state(toy_params() if params is None else params, opt, frozen)
    return update(state, batch)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_equal_full_batch(mode):
    recipe = dataclasses.replace(LITE_PPO, loss_agg_mode=mode, norm_length=7.0, kl_coef=0.1, tis_cap=2.0)
    batch = toy_batch(recipe=recipe)
    full, m_full, _ = _run(recipe, UpdateSettings(micro_batches=1), batch)
    split, m_split, _ = _run(recipe, UpdateSettings(micro_batches=4), batch)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(split.params)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(m_full["loss"], m_split["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m_full["grad_norm"], m_split["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(m_full["clip_frac"], m_split["clip_frac"], rtol=1e-5, atol=1e-7)


def test_update_gradient_is_gradient_of_core_loss():
    """One SGD-like step: the accumulated gradient equals grad of policy_loss(...).value on the whole batch."""
    recipe = DAPO
    batch = toy_batch(recipe=recipe)
    params = toy_params()
    direct = jax.grad(lambda p: batch_loss_terms(p, batch, logprob_fn=toy_logprob_fn, recipe=recipe)[0].value)(params)
    import optax

    sgd = optax.sgd(1.0)  # new = params - grads, so the applied gradient is params - new
    update = make_update_fn(logprob_fn=toy_logprob_fn, recipe=recipe, optimizer=sgd, schedule=lambda s: 0.0,
                            settings=UpdateSettings(micro_batches=2))
    new_state, _, _ = update(init_train_state(params, sgd), batch)
    applied = jax.tree.map(lambda a, b: a - b, params, new_state.params)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(applied)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_mini_batches_and_epochs_step_the_optimizer():
    batch = toy_batch()
    state, metrics, clipped = _run(LITE_PPO, UpdateSettings(ppo_epochs=2, mini_batches=2, micro_batches=2), batch)
    assert int(state.step) == 4
    assert clipped.shape == batch.loss_mask.shape
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_bfloat16_parameters_keep_their_dtype_and_adams_through_mini_batches():
    """model.param_dtype=bfloat16: float32 gradients used to promote Adam's bf16 moments, and the
    mini-batch scan refused a carry that changed type. Parameters and moments stay bf16 and move."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), toy_params())
    state, metrics, _ = _run(LITE_PPO, UpdateSettings(mini_batches=2, micro_batches=2), toy_batch(), params=params)
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim]
    assert moments and {leaf.dtype for leaf in moments} == {jnp.dtype(jnp.bfloat16)}
    assert any(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) > 0
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))


def test_indivisible_batch_is_a_clear_error():
    batch = toy_batch(B=12, G=4)
    with pytest.raises(ValueError, match="not divisible by mini_batches"):
        _run(LITE_PPO, UpdateSettings(mini_batches=1, micro_batches=8), batch)


def test_frozen_part_is_read_but_never_trained():
    """LoRA's split: TrainState.frozen reaches logprob_fn through join_params, gets no optimizer
    state and no update; the trainable part moves exactly as it does when everything trains
    (one AdamW step, no clipping: each coordinate's update depends on its own gradient only)."""
    batch = toy_batch()
    params = toy_params()
    seen = []

    def joined_logprob_fn(p, *args):
        trainable, frozen = p  # join_params(trainable, frozen)
        seen.append(sorted(frozen))
        return toy_logprob_fn({**trainable, **frozen}, *args)

    assert join_params(params, None) is params
    settings = UpdateSettings(micro_batches=2)
    full, m_full, _ = _run(LITE_PPO, settings, batch)
    state, metrics, _ = _run(LITE_PPO, settings, batch, params={"unembed": params["unembed"]},
                             frozen={"embed": params["embed"]}, logprob_fn=joined_logprob_fn)
    assert seen and all(keys == ["embed"] for keys in seen)
    assert int(state.step) == 1 and list(state.params) == ["unembed"]
    np.testing.assert_array_equal(state.frozen["embed"], params["embed"])
    assert not np.allclose(full.params["embed"], params["embed"])  # (it would have moved if trained)
    expected_opt = make_optimizer(lr=1e-2, max_grad_norm=None)[0].init({"unembed": params["unembed"]})
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(expected_opt), \
        "the optimizer state covers more than the trainable part"
    np.testing.assert_allclose(state.params["unembed"], full.params["unembed"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["loss"], m_full["loss"], rtol=1e-6)


@pytest.mark.parametrize("knobs", [
    dict(),  # PPO, token ratio
    dict(ratio_level="sequence", eps_low=0.05, eps_high=0.05),  # GSPO: the row's sequence ratio on every token
    dict(dual_clip=1.05),  # dual clip: negative-advantage tokens with r > c
    dict(surrogate="cispo", eps_low=0.05, eps_high=0.05),  # CISPO: the weight hit a bound, any sign
    dict(surrogate="sapo"),  # a soft gate clips nothing
], ids=["ppo", "gspo", "dual-clip", "cispo", "sapo"])
def test_clip_flags_are_the_tokens_the_surrogate_clipped(knobs):
    """The per-token flags the step returns (the most-clipped-tokens report) mark exactly the tokens
    counted in the surrogate's clip_frac + dual_clip_frac; they used PPO's token ratio for every
    recipe (GSPO's sequence ratio and the dual clip were ignored)."""
    recipe = dataclasses.replace(LITE_PPO, **knobs)
    batch = toy_batch(recipe=recipe)
    batch = batch._replace(old_logp=batch.old_logp + 0.3 * jax.random.normal(jax.random.key(1), batch.old_logp.shape),
                           row_weights=jnp.ones_like(batch.row_weights))
    terms, metrics, flags = batch_loss_terms(toy_params(), batch, logprob_fn=toy_logprob_fn, recipe=recipe)
    counted = float(jnp.sum(batch.loss_mask))
    expected = float(metrics["clip_frac"] + metrics["dual_clip_frac"]) * counted
    assert float(jnp.sum(flags)) == pytest.approx(expected, abs=0.5)
    assert not bool(jnp.any(flags & (batch.loss_mask == 0)))
    if knobs.get("surrogate") != "sapo":
        assert float(jnp.sum(flags)) > 0, "the test batch clips nothing: it proves nothing"


def test_clip_cov_update_is_deterministic_in_the_loss_seed():
    """Clip-Cov's random pick of tokens comes from key = fold(loss_seed, step, micro-batch): the
    same seed gives the same update, another seed another pick."""
    recipe = dataclasses.replace(LITE_PPO, cov_control="clip_cov", cov_ratio=0.5, clip_cov_low=-1e9, clip_cov_high=1e9)
    batch = toy_batch(recipe=recipe)
    batch = batch._replace(row_weights=jnp.ones_like(batch.row_weights))
    opt, sched = make_optimizer(lr=1e-2, max_grad_norm=None)

    def run(seed):
        update = jax.jit(make_update_fn(logprob_fn=toy_logprob_fn, recipe=recipe, optimizer=opt, schedule=sched,
                                        settings=UpdateSettings(micro_batches=2), loss_seed=seed))
        return update(init_train_state(toy_params(), opt), batch)

    (a, ma, _), (b, _, _), (c, _, _) = run(0), run(0), run(1)
    assert 0 < float(ma["cov_selected_frac"]) <= 0.5
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(jax.tree.leaves(a.params), jax.tree.leaves(c.params)))


@pytest.mark.parametrize("micro", [1, 2])
def test_single_step_update_scoring_pi_old_itself_equals_the_recomputed_old_logp(micro):
    """UpdateSettings.old_logp_from_update: one optimizer step from the scored policy gives the
    update of a batch whose old_logp was recomputed in a separate pass, without that pass."""
    recipe = dataclasses.replace(LITE_PPO, is_correction="tis_token", is_cap=2.0)
    batch = toy_batch(recipe=recipe)
    params = toy_params()
    recomputed, _ = toy_logprob_fn(params, batch.input_tokens, batch.targets, None, None)
    separate = batch._replace(old_logp=recomputed * batch.loss_mask)
    stale = batch._replace(old_logp=batch.old_logp + 1.0)  # ignored: the update scores pi_old itself
    a, ma, _ = _run(recipe, UpdateSettings(micro_batches=micro), separate, params=params)
    b, mb, _ = _run(recipe, UpdateSettings(micro_batches=micro, old_logp_from_update=True), stale, params=params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6, atol=1e-8)
    counted = separate.loss_mask * separate.row_weights[:, None]
    gap = jnp.sum(jnp.abs(separate.old_logp - separate.sampler_logp) * counted) / jnp.sum(counted)
    np.testing.assert_allclose(mb["sampler_trainer_logp_gap"], gap, rtol=1e-5)


def test_split_keeps_whole_groups_and_unsplit_inverts_it():
    """_split(x, n, group): slice i holds the groups i, i+n, ... whole; _unsplit undoes it."""
    from jaxrl4llm.train.step import _split, _unsplit

    x = jnp.arange(24)  # 8 groups of 3 rows
    parts = _split(x, 4, 3)
    assert parts.shape == (4, 6)
    np.testing.assert_array_equal(parts[1], [3, 4, 5, 15, 16, 17])  # groups 1 and 5
    for p in np.asarray(parts):
        assert all(len(set(g // 3)) == 1 for g in p.reshape(-1, 3))
    np.testing.assert_array_equal(_unsplit(parts, 3), x)
    np.testing.assert_array_equal(_split(x, 4), _split(x, 4, 1))  # group 1: the row-strided split


def _grouped_model_batch(prompts=4, group=4, prompt_width=6, response=5, seed=0, moe=False):
    """A tiny float32 Qwen3's logprob_fn and a trainer batch of `group` sampled rows per prompt
    (left-padded prompts of different lengths, responses ending early); moe: a Qwen3-MoE of 4
    experts, 2 a token."""
    from jaxrl4llm.models import ModelConfig, init_model
    from jaxrl4llm.sampling import Rollout
    from jaxrl4llm.train.batching import rollout_to_batch
    from jaxrl4llm.train.policy import make_logprob_fn

    config = ModelConfig(architecture="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", remat=True)
    if moe:
        config = config.replace(architecture="qwen3_moe", intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, norm_topk_prob=True)
    graphdef, params = init_model(config, jax.random.key(1), std=0.1)
    rng = np.random.default_rng(seed)
    rows = prompts * group
    prompt_tokens = np.zeros((rows, prompt_width), np.int32)
    prompt_mask = np.zeros((rows, prompt_width), np.float32)
    for n in range(prompts):
        length = int(rng.integers(2, prompt_width + 1))
        prompt_tokens[n * group:(n + 1) * group, prompt_width - length:] = rng.integers(1, 97, length)
        prompt_mask[n * group:(n + 1) * group, prompt_width - length:] = 1
    lengths = rng.integers(2, response + 1, rows)
    response_mask = (np.arange(response)[None] < lengths[:, None]).astype(np.float32)
    logp = -np.abs(rng.standard_normal((rows, response))).astype(np.float32) * response_mask
    rollout = Rollout(jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask),
                      jnp.asarray(rng.integers(1, 97, (rows, response)), jnp.int32), jnp.asarray(response_mask),
                      jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(lengths, jnp.int32),
                      jnp.asarray(lengths == response))
    from jaxrl4llm.core import compute_advantages

    rewards = jnp.asarray(rng.integers(0, 2, rows), jnp.float32)
    batch = rollout_to_batch(rollout, compute_advantages(rewards, group, LITE_PPO))
    return make_logprob_fn(graphdef, 0.9, 4), params, batch


@pytest.mark.parametrize("micro", [1, 2])
def test_shared_prompt_update_equals_the_update_of_whole_rows(micro):
    """UpdateSettings.prompt_group = G (each prompt's forward once for its G rows): the same
    parameters, loss, metrics and clip flags as the update that runs every row whole, with and
    without micro-batches (which then take whole groups), and the same log-prob pass."""
    from jaxrl4llm.train.step import make_logprob_pass

    logprob_fn, params, batch = _grouped_model_batch()
    recipe = dataclasses.replace(LITE_PPO, kl_coef=0.05)
    batch = batch._replace(ref_logp=batch.old_logp - 0.1 * batch.loss_mask)
    runs = [_run(recipe, UpdateSettings(micro_batches=micro, old_logp_from_update=True, scored_tokens=5,
                                        prompt_group=group), batch, lr=1e-3, params=params, logprob_fn=logprob_fn)
            for group in (None, 4)]
    (whole, m_whole, clip_whole), (shared, m_shared, clip_shared) = runs
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(shared.params)):
        # Adam moves every parameter by ~lr = 1e-3 whatever its gradient's size: 1% of a step
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    for k in m_whole:
        np.testing.assert_allclose(m_shared[k], m_whole[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_array_equal(clip_shared, clip_whole)
    passes = [jax.jit(make_logprob_pass(logprob_fn, micro, 5, group))(params, batch) for group in (None, 4)]
    real = np.asarray(batch.attention_mask) > 0  # a padding input's score is meaningless
    np.testing.assert_allclose(np.asarray(passes[1][0])[real], np.asarray(passes[0][0])[real], atol=2e-5)
    with pytest.raises(ValueError, match="prompt_group"):  # 16 rows are not 4 micro-batches of whole groups of 4
        _run(recipe, UpdateSettings(micro_batches=8, scored_tokens=5, prompt_group=4), batch, params=params,
             logprob_fn=logprob_fn)


def test_row_sum_mode_loss_is_the_mini_batch_sum_over_norm_length():
    """seq-sum-token-sum-norm through the accumulation path: each optimizer step's loss is
    sum_{b,t} l·m / norm_length over its own mini-batch (verl's / ROLL's convention), and its
    gradient is that of the core loss on the whole mini-batch, for any micro-batch split."""
    recipe = dataclasses.replace(LITE_PPO, loss_agg_mode="seq-sum-token-sum-norm", norm_length=7.0, kl_coef=0.1)
    batch = toy_batch(recipe=recipe)
    params = toy_params()
    halves = [jax.tree.map(lambda x, j=j: x[j * 8:(j + 1) * 8], batch) for j in range(2)]
    per_half = [batch_loss_terms(params, h, logprob_fn=toy_logprob_fn, recipe=recipe)[0] for h in halves]
    assert all(float(t.denominator) == 1.0 for t in per_half)
    # lr 0: both optimizer steps see the same params; the logged loss is the mean over the two
    _, metrics, _ = _run(recipe, UpdateSettings(mini_batches=2, micro_batches=4), batch, lr=0.0, params=params)
    np.testing.assert_allclose(float(metrics["loss"]), np.mean([float(t.value) for t in per_half]), rtol=1e-5)
    # the paper's mean over rows is smaller by the count of rows in the step
    paper = dataclasses.replace(recipe, loss_agg_mode="seq-mean-token-sum-norm")
    mean_terms = batch_loss_terms(params, halves[0], logprob_fn=toy_logprob_fn, recipe=paper)[0]
    np.testing.assert_allclose(float(per_half[0].value), float(mean_terms.value) * float(mean_terms.denominator),
                               rtol=1e-5)
    # the accumulated gradient (SGD with lr 1) equals the gradient of the whole-batch core loss
    import optax

    direct = jax.grad(lambda p: batch_loss_terms(p, batch, logprob_fn=toy_logprob_fn, recipe=recipe)[0].value)(params)
    sgd = optax.sgd(1.0)
    update = make_update_fn(logprob_fn=toy_logprob_fn, recipe=recipe, optimizer=sgd, schedule=lambda s: 0.0,
                            settings=UpdateSettings(micro_batches=4))
    new_state, _, _ = update(init_train_state(params, sgd), batch)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(jax.tree.map(lambda x, y: x - y, params, new_state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_router_aux_loss_trains_the_router_and_is_off_at_zero():
    """trainer.router_aux_loss_coef = c > 0: the loss is policy + c * the load-balancing loss (one
    micro-batch), the routers' gradients change, a shared-prompt batch gives the whole rows' loss
    (each prompt's router stats counted for its G rows); c = 0 never asks the model for router stats
    (a logprob_fn that refuses them lowers the same update)."""
    logprob_fn, params, batch = _grouped_model_batch(moe=True)
    recipe = LITE_PPO

    def terms(p, coef, group=None):
        t, metrics, _ = batch_loss_terms(p, batch, logprob_fn=logprob_fn, recipe=recipe, scored_tokens=5,
                                         prompt_group=group, router_aux_loss_coef=coef)
        return t.value, metrics

    value_and_grad = jax.jit(jax.value_and_grad(terms, has_aux=True), static_argnums=(1, 2))
    router = lambda g: np.asarray(g["layers"]["mlp"]["router"].get_value())  # [L, D, E]
    ((plain, _), plain_grad), ((balanced, metrics), balanced_grad) = (value_and_grad(params, c) for c in (0.0, 0.5))
    aux = float(metrics["router_aux_loss"])
    assert 2.0 <= aux < 4.0  # k = 2 for a uniform router, up to E = 4 when one expert takes every choice
    np.testing.assert_allclose(float(balanced), float(plain) + 0.5 * aux, rtol=1e-5)
    shared, shared_metrics = jax.jit(terms, static_argnums=(1, 2))(params, 0.5, 4)
    np.testing.assert_allclose(float(shared_metrics["router_aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(shared), float(balanced), rtol=1e-5)
    differ = np.abs(router(balanced_grad) - router(plain_grad))
    assert all(differ[layer].max() > 1e-4 for layer in range(2)), differ.max(axis=(1, 2))

    def refuses_stats(*args, router_stats=False, **kwargs):
        assert not router_stats, "router stats asked for at router_aux_loss_coef=0"
        return logprob_fn(*args, **kwargs)

    opt, sched = make_optimizer(lr=1e-3, max_grad_norm=None)
    state = init_train_state(params, opt)
    lowered = [jax.jit(make_update_fn(logprob_fn=fn, recipe=recipe, optimizer=opt, schedule=sched,
                                      settings=UpdateSettings(scored_tokens=5))).lower(state, batch).as_text()
               for fn in (logprob_fn, refuses_stats)]
    assert lowered[0] == lowered[1]


def test_a_zero_teacher_signal_leaves_the_update_bit_for_bit():
    """A teacher whose log-probs are pi_old's (d_t = 0): Lite PPO + distillation updates the
    parameters exactly as Lite PPO does, two mini-batches, jitted."""
    from jaxrl4llm.core import LITE_PPO_OPD

    optimizer, schedule = make_optimizer(lr=1e-2)
    batch, params = toy_batch(), toy_params(1)
    settings = UpdateSettings(mini_batches=2)
    out = []
    for recipe, b in ((LITE_PPO, batch), (LITE_PPO_OPD, batch._replace(teacher_logp=batch.old_logp))):
        update = jax.jit(make_update_fn(logprob_fn=toy_logprob_fn, recipe=recipe, optimizer=optimizer,
                                        schedule=schedule, settings=settings))
        state, metrics, _ = update(init_train_state(params, optimizer), b)
        out.append((state.params, metrics))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), out[0][0], out[1][0]))
    assert float(out[1][1]["teacher_kl"]) == 0.0
    assert float(out[0][1]["loss"]) == float(out[1][1]["loss"])


def test_distill_batch_feeds_the_core_advantage_and_token_sums():
    """`distill_batch`: the advantages are core.distill_advantages of (A_task or None, pi_old, teacher);
    the sums over the counted tokens divided by their count give core.teacher_kl_metrics."""
    from jaxrl4llm.core import LITE_PPO_OPD, OPD, distill_advantages, teacher_kl_metrics
    from jaxrl4llm.train.step import TEACHER_KL_BINS, distill_batch

    batch = toy_batch()
    teacher = batch.old_logp - 0.3 * jnp.abs(jnp.sin(jnp.arange(batch.old_logp.size))).reshape(batch.old_logp.shape)
    batch = batch._replace(teacher_logp=teacher)
    for recipe, row in ((OPD, None), (LITE_PPO_OPD.replace(distill_coef=0.5, distill_clip=0.1), batch.advantages)):
        got, sums = distill_batch(batch, recipe)
        want = distill_advantages(row, batch.old_logp, teacher, batch.loss_mask, coef=recipe.distill_coef,
                                  clip=recipe.distill_clip)
        np.testing.assert_array_equal(np.asarray(got.advantages), np.asarray(want))
    counted = batch.loss_mask * batch.row_weights[:, None]
    kl = teacher_kl_metrics(batch.old_logp, teacher, counted, num_bins=TEACHER_KL_BINS)
    n = float(jnp.sum(counted))
    assert float(sums["teacher_kl"]) / n == pytest.approx(float(kl["teacher_kl"]), rel=1e-6)
    for k in range(TEACHER_KL_BINS):
        assert float(sums[f"teacher_tokens_by_position/{k}"]) == float(kl["teacher_tokens_by_position"][k])
    unchanged, none = distill_batch(batch._replace(teacher_logp=None), OPD)
    assert none == {} and unchanged.advantages is batch.advantages
