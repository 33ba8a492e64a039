"""Remat policies (models/remat.py): the gradient is the policy's to keep or recompute, never to
change; each policy keeps what it names, and `saved_floats_per_token` counts it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from jaxrl4llm.models import ConfigError, ModelConfig, abstract_model, forward, init_model
from jaxrl4llm.models.remat import REMAT_POLICIES, saved_floats_per_token

TINY = dict(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, dtype="float32")
B, T = 2, 8


def _loss(config, state):
    graphdef, _ = abstract_model(config)
    tokens = jnp.arange(B * T).reshape(B, T) % TINY["vocab_size"]
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    weights = jnp.sin(jnp.arange(TINY["vocab_size"], dtype=jnp.float32))

    def loss(s):
        logits = forward(graphdef, s, tokens, positions=positions, attention_mask=jnp.ones((B, T), jnp.int32))
        return jnp.sum(jax.nn.log_softmax(logits) * weights)
    return loss


def _scan_residual_floats(loss, state) -> int:
    """float values the backward keeps from the forward, summed over residuals of rank >= 4
    (stacked over layers: [L, B, T, ...])."""
    return sum(int(np.prod(aval.shape)) for aval, _ in saved_residuals(loss, state) if aval.ndim >= 4)


def test_every_policy_gives_the_gradient_of_no_remat():
    config = ModelConfig(**TINY)
    _, state = init_model(config, jax.random.PRNGKey(0))
    reference = jax.grad(_loss(config, state))(state)
    for policy in REMAT_POLICIES:
        grads = jax.grad(_loss(config.replace(remat=True, remat_policy=policy), state))(state)
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads)):
            # the attention backward recomputes its tiles (float32 rounding of a recomputation)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-6, err_msg=policy)


def test_each_policy_keeps_what_it_names_and_the_count_matches():
    config = ModelConfig(**TINY)
    _, state = init_model(config, jax.random.PRNGKey(0))
    kept = {p: _scan_residual_floats(_loss(config.replace(remat=True, remat_policy=p), state), state)
            for p in REMAT_POLICIES}
    shape = dict(hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8)
    full = kept["full"]  # the layer inputs (and the scan's own bookkeeping)
    for policy in ("save_attention", "save_dots"):
        assert kept[policy] - full == TINY["num_layers"] * B * T * saved_floats_per_token(policy, **shape), policy
    assert full < kept["save_attention"] < kept["save_dots"]


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"remat_policy='dots'; choose one of full, save_attention, save_dots"):
        ModelConfig(**TINY, remat_policy="dots")
