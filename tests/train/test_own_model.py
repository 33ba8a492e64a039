"""Bring your own NNX model: a causal LM defined here (not by jaxrl4llm) trains with our recipes.

The model follows the protocol of docs/models.md: `__call__(tokens, positions, attention_mask)
-> logits [B, T, V]` and a `vocab_size` attribute. The loop samples it with the generic
(no KV cache) sampler, scores it with `score_tokens`, and updates it.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl4llm.models import forward, score_tokens
from jaxrl4llm.sampling import generate, response_token_lists
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train

from tests.train.conftest import tiny_overrides


class TinyCausalConv(nnx.Module):
    """logits_t = W_out tanh(E[x_t] + U E[x_{t-1}]): a two-token causal 'LM', nothing like a transformer."""

    def __init__(self, vocab_size: int, *, rngs: nnx.Rngs, dim: int = 16):
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.mix = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, tokens, positions, attention_mask):
        e = self.embed(tokens) * attention_mask[..., None]
        previous = jnp.pad(e, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        return self.out(jnp.tanh(e + self.mix(previous)))


def make_model(vocab_size: int, rngs: nnx.Rngs) -> nnx.Module:
    """The `model.module` factory: jaxrl4llm calls it with the tokenizer's vocabulary size."""
    return TinyCausalConv(vocab_size, rngs=rngs)


def odd_length_reward(response: str, gold: str) -> float:
    """1 for an odd-length response: varies inside a group from the first step, so updates move."""
    return float(len(response) % 2)


def test_own_model_scores_and_samples_like_its_forward():
    graphdef, state = nnx.split(make_model(11, nnx.Rngs(0)))
    tokens = jnp.asarray([[0, 3, 4, 5], [6, 7, 8, 9]], jnp.int32)
    mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits = forward(graphdef, state, tokens, positions=positions, attention_mask=mask)
    logp, entropy = score_tokens(graphdef, state, tokens, jnp.roll(tokens, -1, axis=1), positions=positions,
                                 attention_mask=mask, chunk_size=2)
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.roll(tokens, -1, axis=1)[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, expected, atol=1e-5)
    assert np.all(np.asarray(entropy) >= 0)

    # greedy rows are the argmax chain of the model's own forward
    rollout = generate(graphdef, state, [[3, 4, 5], [6]], num_samples=2, max_new_tokens=5, greedy=True,
                       eos_token_ids=[], pad_token_id=0, rng=jax.random.key(0))
    for prompt, row in zip([[3, 4, 5], [3, 4, 5], [6], [6]], response_token_lists(rollout)):
        seq = list(prompt)
        for _ in range(5):
            ids = jnp.asarray([seq], jnp.int32)
            z = forward(graphdef, state, ids, positions=jnp.arange(len(seq))[None], attention_mask=jnp.ones_like(ids))
            seq.append(int(jnp.argmax(z[0, -1])))
        assert row == seq[len(prompt):]


def test_own_model_trains_two_updates_with_a_recipe(demo_assets, tmp_path):
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{
        "model.module": "tests.train.test_own_model:make_model", "algorithm.preset": "lite_ppo",
        "reward.fn": "tests.train.test_own_model:odd_length_reward", "rollout.max_new_tokens": 8}))
    summary = train(cfg, log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    before = nnx.state(make_model(summary["state"].params["embed"]["embedding"].shape[0],
                                  nnx.Rngs(params=jax.random.PRNGKey(cfg.trainer.seed))))
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(summary["state"].params))]
    assert max(moved) > 0, "two updates left the user's model unchanged"
