"""The second call of every public core function (same shapes, new values) compiles nothing.

Compiles are counted with jax.monitoring's '/jax/core/compile/backend_compile_duration' event.
Each function is checked twice: wrapped in our own `jax.jit` (the function must trace without
value-dependent Python), and called directly (a function that builds a fresh `jax.jit` or scan
body closure on every call recompiles every time).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import core
from tests.core._helpers import B, G, T, V, logps, mask, rewards, rng

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
D = 7


class _CompileCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def _block(tree):
    jax.tree_util.tree_map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready")
                           else x, tree)


def _args(seed):
    """Positional/keyword arrays for every public function, fixed shapes, seed-dependent values."""
    g = rng(seed)
    logp, old = logps(g)
    return dict(
        r=jnp.asarray(rewards(g, kind=2)),
        logits=jnp.asarray(g.normal(size=(B, T, V)).astype(np.float32)),
        tokens=jnp.asarray(g.integers(0, V, size=(B, T)).astype(np.int32)),
        hidden=jnp.asarray(g.normal(size=(B, T, D)).astype(np.float32)),
        unembed=jnp.asarray(g.normal(size=(D, V)).astype(np.float32)),
        logp=jnp.asarray(logp), old=jnp.asarray(old),
        adv=jnp.asarray(g.normal(size=B).astype(np.float32)),
        mask=jnp.asarray(mask(g)),
        loss=jnp.asarray(g.normal(size=(B, T)).astype(np.float32)),
        truncated=jnp.asarray(g.random(B) < 0.3),
        lengths=jnp.asarray(g.integers(0, 30, size=B).astype(np.int32)),
        weights=jnp.asarray((g.random(B) < 0.7).astype(np.float32)),
    )


SHORT_DAPO = dataclasses.replace(core.DAPO, overlong_max_length=24, overlong_buffer_length=8)


def _loss_kwargs(a):
    return dict(logp=a["logp"], old_logp=a["old"], advantages=a["adv"], mask=a["mask"],
                ref_logp=a["old"], sampler_logp=a["old"], entropy=jnp.abs(a["loss"]))


CALLS = {
    "normalize_advantages/grpo": lambda a: core.normalize_advantages(a["r"], G),
    "normalize_advantages/lite_ppo": lambda a: core.normalize_advantages(a["r"], G, mean="group",
                                                                         std="batch"),
    "rloo_advantages": lambda a: core.rloo_advantages(a["r"], G),
    "batch_whiten": lambda a: core.batch_whiten(a["loss"], a["mask"]),
    "token_logprobs": lambda a: core.token_logprobs(a["logits"], a["tokens"], 0.7),
    "token_logprobs_chunked": lambda a: core.token_logprobs_chunked(a["logits"], a["tokens"],
                                                                    chunk_size=4),
    "token_logprobs_from_hidden": lambda a: core.token_logprobs_from_hidden(
        a["hidden"], a["unembed"], a["tokens"], chunk_size=4, return_entropy=True),
    "entropy_from_logits": lambda a: core.entropy_from_logits(a["logits"]),
    "clipped_surrogate/token": lambda a: core.clipped_surrogate(
        a["logp"], a["old"], a["adv"], a["mask"], eps_high=0.28, dual_clip=3.0),
    "clipped_surrogate/sequence": lambda a: core.clipped_surrogate(
        a["logp"], a["old"], a["adv"], a["mask"], ratio_level="sequence"),
    "truncated_is_weights": lambda a: core.truncated_is_weights(a["logp"], a["old"], cap=2.0),
    "kl_penalty/k3": lambda a: core.kl_penalty(a["logp"], a["old"], "k3", clamp=10.0),
    "kl_penalty/k1": lambda a: core.kl_penalty(a["logp"], a["old"], "k1"),
    "overlong_filter_mask": lambda a: core.overlong_filter_mask(a["truncated"]),
    "overlong_soft_penalty": lambda a: core.overlong_soft_penalty(a["lengths"], max_length=24,
                                                                  buffer_length=8),
    "dynamic_sampling_mask": lambda a: core.dynamic_sampling_mask(a["r"], G),
}
for _mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
              "seq-mean-token-sum-norm", "seq-sum-token-sum-norm"]:
    CALLS[f"aggregate_loss/{_mode}"] = functools.partial(
        lambda a, mode: core.aggregate_loss(a["loss"], a["mask"], mode, norm_length=16.0,
                                            row_weights=a["weights"]), mode=_mode)
def _compute_advantages(a, recipe):
    return core.compute_advantages(a["r"], G, recipe, truncated=a["truncated"],
                                   lengths=a["lengths"])


def _policy_loss(a, recipe):
    return core.policy_loss(recipe, **_loss_kwargs(a))


def _policy_loss_from_rewards(a, recipe):
    kwargs = {k: v for k, v in _loss_kwargs(a).items() if k != "advantages"}
    return core.policy_loss_from_rewards(recipe, rewards=a["r"], group_size=G,
                                         truncated=a["truncated"], lengths=a["lengths"], **kwargs)


for _name, _recipe in [("GRPO", core.GRPO), ("DAPO", SHORT_DAPO), ("LITE_PPO", core.LITE_PPO),
                       ("DR_GRPO", core.DR_GRPO), ("PPO_BASELINE", core.PPO_BASELINE)]:
    # policy_loss_from_rewards = compute_advantages + policy_loss: every preset; the two
    # halves separately for two presets.
    CALLS[f"policy_loss_from_rewards/{_name}"] = functools.partial(_policy_loss_from_rewards,
                                                                   recipe=_recipe)
    if _name in ("GRPO", "DAPO"):
        CALLS[f"compute_advantages/{_name}"] = functools.partial(_compute_advantages,
                                                                 recipe=_recipe)
        CALLS[f"policy_loss/{_name}"] = functools.partial(_policy_loss, recipe=_recipe)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_second_jitted_call_does_not_recompile(name):
    fn = jax.jit(CALLS[name])
    _block(fn(_args(0)))
    with _CompileCounter() as counter:
        _block(fn(_args(1)))
    assert counter.count == 0
    assert fn._cache_size() == 1


# Called directly (eagerly), every primitive compiles once on the first call: keep this to one
# representative per module (the jitted test above covers every entry).
DIRECT = ["normalize_advantages/lite_ppo", "rloo_advantages", "batch_whiten", "token_logprobs",
          "token_logprobs_chunked", "token_logprobs_from_hidden",
          "entropy_from_logits",
          "clipped_surrogate/sequence", "truncated_is_weights", "kl_penalty/k3",
          "aggregate_loss/seq-mean-token-mean", "overlong_soft_penalty", "dynamic_sampling_mask",
          "policy_loss_from_rewards/DAPO"]


@pytest.mark.parametrize("name", DIRECT)
def test_second_direct_call_does_not_recompile(name):
    fn = CALLS[name]
    a0, a1 = _args(0), _args(1)
    _block(fn(a0))
    with _CompileCounter() as counter:
        _block(fn(a1))
    assert counter.count == 0, f"{name} compiled {counter.count} programs on its second call"


def test_recipe_is_a_valid_static_argument():
    """Equal recipes (e.g. rebuilt with dataclasses.replace) hit the same jit cache entry."""
    fn = jax.jit(lambda recipe, a: core.policy_loss(recipe, **_loss_kwargs(a))[0].value,
                 static_argnums=0)
    a = _args(0)
    _block(fn(core.GRPO, a))
    with _CompileCounter() as counter:
        _block(fn(dataclasses.replace(core.GRPO), _args(1)))
    assert counter.count == 0
    _block(fn(dataclasses.replace(core.GRPO, eps_high=0.28), a))
    assert fn._cache_size() == 2
