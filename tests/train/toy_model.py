"""A two-matrix bigram 'language model' for train-step tests: logits = E[tokens] @ W."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import LITE_PPO, compute_advantages
from jaxrl4llm.train.step import TrainBatch

V, D = 13, 8


def toy_params(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"embed": jax.random.normal(k1, (V, D)) * 0.5, "unembed": jax.random.normal(k2, (D, V)) * 0.5}


def toy_logprob_fn(params, input_tokens, targets, positions, attention_mask):
    logits = params["embed"][input_tokens] @ params["unembed"]
    logz = jax.nn.logsumexp(logits, -1)
    logp = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0] - logz
    p = jax.nn.softmax(logits, -1)
    ent = logz - jnp.sum(p * logits, -1)
    return logp, ent


def toy_batch(B=16, L=10, G=4, seed=0, recipe=LITE_PPO, params=None):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, L + 1)).astype(np.int32)
    prompt_len = 3
    resp_len = rng.integers(0, L - prompt_len + 1, size=B)
    loss_mask = np.zeros((B, L), np.float32)
    for b in range(B):
        loss_mask[b, prompt_len - 1 : prompt_len - 1 + resp_len[b]] = 1
    rewards = rng.integers(0, 2, size=B).astype(np.float32)
    adv = compute_advantages(jnp.asarray(rewards), G, recipe, truncated=jnp.asarray(resp_len == L - prompt_len),
                             lengths=jnp.asarray(resp_len))
    params = params if params is not None else toy_params(seed + 1)
    old, _ = toy_logprob_fn(params, tokens[:, :-1], tokens[:, 1:], None, None)
    old = old + 0.1 * rng.standard_normal((B, L)).astype(np.float32)
    return TrainBatch(
        input_tokens=jnp.asarray(tokens[:, :-1]), targets=jnp.asarray(tokens[:, 1:]),
        positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)), attention_mask=jnp.ones((B, L), jnp.int32),
        loss_mask=jnp.asarray(loss_mask), old_logp=old, ref_logp=old - 0.05, sampler_logp=old + 0.01,
        advantages=adv.advantages, row_weights=adv.row_weights, denominator_weights=adv.denominator_weights,
    )
