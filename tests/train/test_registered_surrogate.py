"""A surrogate written and registered here, outside the library (as a notebook would), trains a
step: the update applies the gradient of its own formula and reports its own clip flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl4llm.core import LITE_PPO, SurrogateOutput, broadcast_advantages, register_surrogate, surrogate_stats
from jaxrl4llm.train.step import UpdateSettings, init_train_state, make_update_fn

from tests.train.toy_model import toy_batch, toy_logprob_fn, toy_params


def truncated_ratio_pg(recipe, logp, old_logp, advantages, mask):
    """L = -min(r, 1 + eps_high)·A: REINFORCE with an importance ratio truncated above (either sign of A)."""
    m = mask.astype(jnp.float32)
    log_ratio = jnp.where(m > 0, logp - jax.lax.stop_gradient(old_logp), 0.0)
    ratio = jnp.exp(log_ratio)
    loss = jnp.where(m > 0, -jnp.minimum(ratio, 1.0 + recipe.eps_high) * broadcast_advantages(advantages, logp), 0.0)
    r = jax.lax.stop_gradient(ratio)
    high = r > 1.0 + recipe.eps_high
    stats = surrogate_stats(r, m, log_ratio, jnp.zeros(logp.shape, bool), high)
    return SurrogateOutput(loss, stats, (m > 0) & high)


register_surrogate("truncated_ratio_pg", truncated_ratio_pg,
                   check=lambda recipe: [] if recipe.eps_high > 0 else ["eps_high must be > 0"], replace=True)


def test_a_registered_surrogate_trains_one_step():
    recipe = dataclasses.replace(LITE_PPO, name="truncated_ratio_pg", surrogate="truncated_ratio_pg", eps_high=0.05)
    batch = toy_batch(recipe=recipe)
    params = toy_params()
    sgd = optax.sgd(1.0)  # new = params - grads: the applied gradient is params - new
    update = jax.jit(make_update_fn(logprob_fn=toy_logprob_fn, recipe=recipe, optimizer=sgd, schedule=lambda s: 0.0,
                                    settings=UpdateSettings(micro_batches=2)))
    state, metrics, clipped = update(init_train_state(params, sgd), batch)

    counted = batch.loss_mask * batch.row_weights[:, None]

    def token_mean_loss(p):  # the formula by hand, token-mean over the counted tokens (LITE_PPO)
        logp, _ = toy_logprob_fn(p, batch.input_tokens, batch.targets, None, None)
        ratio = jnp.exp(logp - batch.old_logp)
        per_token = -jnp.minimum(ratio, 1.05) * batch.advantages[:, None]
        return jnp.sum(per_token * counted) / jnp.sum(counted)

    expected = jax.grad(token_mean_loss)(params)
    applied = jax.tree.map(lambda a, b: a - b, params, state.params)
    assert int(state.step) == 1
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(applied)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], token_mean_loss(params), rtol=1e-5)

    logp, _ = toy_logprob_fn(params, batch.input_tokens, batch.targets, None, None)
    truncated = (jnp.exp(logp - batch.old_logp) > 1.05) & (counted > 0)
    assert int(jnp.sum(truncated)) > 0, "nothing truncated: the flags prove nothing"
    np.testing.assert_array_equal(clipped, truncated)
    np.testing.assert_allclose(metrics["clip_frac_high"], jnp.sum(truncated) / jnp.sum(counted), rtol=1e-6)
