"""Tests of the surrogate table (core.surrogate_registry): a surrogate registered from outside the
library, as a notebook would, is a valid Recipe.surrogate and is what policy_loss runs."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.core import (CISPO, LITE_PPO, Recipe, SurrogateOutput, apply_surrogate, broadcast_advantages,
                            cispo_loss, policy_loss, ppo_clip_loss, register_surrogate, registered_surrogate,
                            sapo_loss, surrogate_names, surrogate_stats)
from tests.core._helpers import B, logps, mask, rng


def unclipped_ratio_pg(recipe, logp, old_logp, advantages, mask):
    """L = -r·A, r = exp(logp - old_logp): REINFORCE with an importance ratio, no clip."""
    m = mask.astype(jnp.float32)
    log_ratio = jnp.where(m > 0, logp - jax.lax.stop_gradient(old_logp), 0.0)
    ratio = jnp.exp(log_ratio)
    loss = jnp.where(m > 0, -ratio * broadcast_advantages(advantages, logp), 0.0)
    never = jnp.zeros(logp.shape, bool)
    return SurrogateOutput(loss, surrogate_stats(jax.lax.stop_gradient(ratio), m, log_ratio, never, never), never)


def needs_symmetric_clip(recipe):
    return [] if recipe.eps_low == recipe.eps_high else [
        f"eps_low={recipe.eps_low} and eps_high={recipe.eps_high} must be equal for surrogate='unclipped_ratio_pg'"]


register_surrogate("unclipped_ratio_pg", unclipped_ratio_pg, check=needs_symmetric_clip, replace=True)


def _inputs(seed=0):
    g = rng(seed)
    logp, old = logps(g, spread=0.4)
    return tuple(map(jnp.asarray, (logp, old, g.normal(size=B).astype(np.float32), mask(g))))


def test_the_built_in_rows_are_the_surrogate_functions():
    assert surrogate_names()[:3] == ("ppo", "cispo", "sapo")
    logp, old, adv, m = _inputs()
    recipe = dataclasses.replace(LITE_PPO, eps_high=0.28, dual_clip=3.0, ratio_level="sequence")
    for name, recipe, expected in [
        ("ppo", recipe, ppo_clip_loss(logp, old, adv, m, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                                      ratio_level="sequence")),
        ("cispo", CISPO, cispo_loss(logp, old, adv, m, eps_low=1.0, eps_high=4.0)),
        ("sapo", dataclasses.replace(LITE_PPO, surrogate="sapo"), sapo_loss(logp, old, adv, m)),
    ]:
        got = registered_surrogate(name).loss_fn(recipe, logp, old, adv, m)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_unknown_surrogate_lists_the_registered_ones():
    with pytest.raises(ValueError, match=re.escape("surrogate='grpo' (valid: ppo, cispo, sapo, ")) as err:
        Recipe(name="bad", surrogate="grpo")
    assert "unclipped_ratio_pg" in str(err.value)
    with pytest.raises(ValueError, match="registered: ppo, cispo, sapo.*register_surrogate"):
        registered_surrogate("grpo")


def test_registering_a_taken_name_needs_replace():
    with pytest.raises(ValueError, match="'ppo' is registered already"):
        register_surrogate("ppo", unclipped_ratio_pg)
    row = registered_surrogate("unclipped_ratio_pg")
    assert register_surrogate("unclipped_ratio_pg", row.loss_fn, check=row.check, replace=True) == row


def test_a_registered_surrogate_is_a_recipe_choice_with_its_own_checks():
    recipe = dataclasses.replace(LITE_PPO, name="reinforce_ratio", surrogate="unclipped_ratio_pg")
    assert hash(recipe) == hash(dataclasses.replace(recipe))
    with pytest.raises(ValueError, match=re.escape("eps_low=0.2 and eps_high=0.28 must be equal")):
        dataclasses.replace(recipe, eps_high=0.28)


def test_policy_loss_runs_the_registered_surrogate():
    """With a clip range no ratio reaches, PPO's clip is the unclipped ratio PG: equal loss, gradient
    and statistics through policy_loss (token-mean), the custom one looked up by name under jit."""
    logp, old, adv, m = _inputs(1)
    custom = dataclasses.replace(LITE_PPO, surrogate="unclipped_ratio_pg", eps_low=0.99, eps_high=0.99)
    wide_ppo = dataclasses.replace(LITE_PPO, eps_low=0.99, eps_high=1e6)

    @jax.jit
    def value_and_grad(logp):
        return {name: jax.value_and_grad(lambda x: policy_loss(recipe, logp=x, old_logp=old, advantages=adv,
                                                               mask=m)[0].value)(logp)
                for name, recipe in (("custom", custom), ("ppo", wide_ppo))}

    out = value_and_grad(logp)
    np.testing.assert_allclose(out["custom"][0], out["ppo"][0], rtol=1e-6)
    np.testing.assert_allclose(out["custom"][1], out["ppo"][1], rtol=1e-5, atol=1e-7)
    _, metrics = policy_loss(custom, logp=logp, old_logp=old, advantages=adv, mask=m)
    assert float(metrics["clip_frac"]) == 0.0 and float(metrics["num_tokens"]) == float(jnp.sum(m))


def test_apply_surrogate_checks_what_a_surrogate_returns():
    register_surrogate("returns_a_pair", lambda recipe, logp, old, adv, m: (logp, None), replace=True)
    recipe = dataclasses.replace(LITE_PPO, surrogate="returns_a_pair")
    with pytest.raises(TypeError, match="must return SurrogateOutput"):
        apply_surrogate(recipe, *_inputs())


def test_a_registered_surrogate_recipe_is_a_static_argument_that_compiles_once():
    """The table is read by name at trace time: equal recipes (rebuilt with dataclasses.replace) hit
    one jit cache entry."""
    recipe = dataclasses.replace(LITE_PPO, surrogate="unclipped_ratio_pg", eps_low=0.3, eps_high=0.3)
    loss = jax.jit(lambda r, logp, old, adv, m: policy_loss(r, logp=logp, old_logp=old, advantages=adv,
                                                            mask=m)[0].value, static_argnums=0)
    first = loss(recipe, *_inputs(2))
    second = loss(dataclasses.replace(recipe), *_inputs(3))
    assert np.isfinite(float(first)) and np.isfinite(float(second))
    assert loss._cache_size() == 1
