"""LoRA: adapters start at the base model, only they are optimised, the sampler and the HF export
run the adapted model (export logits equal ours in transformers)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from jaxrl4llm.core import LITE_PPO
from jaxrl4llm.models import (LoraSettings, add_lora, forward, load_pretrained, merge_lora, save_pretrained,
                              score_tokens, split_trainable)
from jaxrl4llm.sampling import generate, response_token_lists
from jaxrl4llm.train.step import TrainBatch, UpdateSettings, init_train_state, make_update_fn
from tests.models.hf_oracle import tiny_hf_model

# every kind of linear: q (heads out), o (two contracted dims), MLP in and out, the untied head
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "lm_head")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    tiny_hf_model("qwen2").save_pretrained(folder)  # untied head, q/k/v biases
    model = load_pretrained(folder, dtype="float32", param_dtype="float32")
    return model.config, nnx.split(model)


def _inputs(seed=0, b=4, t=8, vocab=300):
    tokens = jax.random.randint(jax.random.key(seed), (b, t), 1, vocab)
    return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)


def _one_update(config, graphdef, adapters, frozen):
    tokens, positions, mask = _inputs()
    logprob_fn = lambda p, x, y, pos, m: score_tokens(graphdef, p, x, y, positions=pos, attention_mask=m)
    old, _ = logprob_fn((adapters, frozen), tokens[:, :-1], tokens[:, 1:], positions[:, :-1], mask[:, :-1])
    b, l = old.shape
    batch = TrainBatch(input_tokens=tokens[:, :-1], targets=tokens[:, 1:], positions=positions[:, :-1],
                       attention_mask=mask[:, :-1], loss_mask=jnp.ones((b, l)), old_logp=old, ref_logp=old,
                       sampler_logp=old, advantages=jnp.asarray([1.0, -1.0, 1.0, -1.0]), row_weights=jnp.ones(b),
                       denominator_weights=jnp.ones(b))
    optimizer = optax.adam(3e-2)
    update = make_update_fn(logprob_fn=logprob_fn, recipe=LITE_PPO, optimizer=optimizer,
                            schedule=optax.constant_schedule(3e-2), settings=UpdateSettings())
    state = init_train_state(adapters, optimizer, frozen=frozen)
    return state, jax.jit(update)(state, batch)[0]


def test_adapters_start_at_the_base_and_only_they_are_optimised(base):
    config, (graphdef, frozen) = base
    lora_def, adapters = add_lora(config, LoraSettings(rank=4, alpha=8.0, targets=TARGETS), jax.random.key(1))
    tokens, positions, mask = _inputs()
    np.testing.assert_array_equal(forward(lora_def, (adapters, frozen), tokens, positions=positions, attention_mask=mask),
                                  forward(graphdef, frozen, tokens, positions=positions, attention_mask=mask))

    paths = lambda tree: ["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
                          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    adapter_paths = paths(adapters)
    assert len(adapter_paths) == 2 * (len(TARGETS) - 1) + 2 and all("lora_" in p for p in adapter_paths)
    assert any(p.startswith("layers/attn/o_proj") for p in adapter_paths) and any("lm_head" in p for p in adapter_paths)
    state, new = _one_update(config, lora_def, adapters, frozen)
    opt_paths = [p for p in paths(state.opt_state) if p.split("/")[-1] not in ("count",)]
    assert opt_paths and all("lora_" in p for p in opt_paths), [p for p in opt_paths if "lora_" not in p]
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) <= 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 1
    for a, b in zip(jax.tree.leaves(new.frozen), jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(a, b)  # the base is never updated
    assert any(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(adapters)))


def test_merged_export_equals_the_adapted_model_in_transformers(base, tmp_path):
    config, (graphdef, frozen) = base
    lora_def, adapters = add_lora(config, LoraSettings(rank=4, alpha=8.0, targets=TARGETS), jax.random.key(1))
    _, trained = _one_update(config, lora_def, adapters, frozen)
    state = (trained.params, frozen)
    tokens, positions, mask = _inputs(seed=3)
    ours = forward(lora_def, state, tokens, positions=positions, attention_mask=mask)
    assert float(jnp.max(jnp.abs(ours - forward(graphdef, frozen, tokens, positions=positions,
                                                   attention_mask=mask)))) > 1e-3, "the update did not change logits"

    save_pretrained((lora_def, state), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(np.array(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)
    assert not any("lora" in k for k in hf.state_dict())

    # the sampler runs the adapted model: greedy tokens are the adapted model's argmax chain
    prompts = [[5, 6, 7], [9]]
    rollout = generate(lora_def, state, prompts, num_samples=1, max_new_tokens=6, greedy=True, eos_token_ids=[],
                       pad_token_id=0, rng=jax.random.key(0))
    plain_def, plain = merge_lora(lora_def, state)
    adapters, base_again = split_trainable(nnx.state(nnx.merge(lora_def, *state)))
    assert jax.tree.structure(adapters) == jax.tree.structure(trained.params)
    assert jax.tree.structure(base_again) == jax.tree.structure(frozen)
    for prompt, row in zip(prompts, response_token_lists(rollout)):
        ids = jnp.asarray([prompt + row])
        z = forward(plain_def, plain, ids, positions=jnp.arange(ids.shape[1])[None], attention_mask=jnp.ones_like(ids))
        assert row == np.asarray(jnp.argmax(z[0, len(prompt) - 1:-1], -1)).tolist()


def test_lora_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="unknown.*valid"):
        LoraSettings(targets=("qproj",))
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.0)


def test_lora_dropout_only_under_a_key_and_keyed(base):
    config, (graphdef, frozen) = base
    lora_def, adapters = add_lora(config, LoraSettings(rank=4, alpha=8.0, targets=TARGETS, dropout=0.5),
                                  jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # B != 0: the adapters change logits
    tokens, positions, mask = _inputs()
    score = lambda rng: score_tokens(lora_def, (adapters, frozen), tokens[:, :-1], tokens[:, 1:],
                                     positions=positions[:, :-1], attention_mask=mask[:, :-1], dropout_rng=rng)[0]
    plain = score(None)
    np.testing.assert_allclose(plain, score(None))  # no key: deterministic, no dropout
    a, b = score(jax.random.key(0)), score(jax.random.key(1))
    np.testing.assert_allclose(a, score(jax.random.key(0)))  # same key, same masks
    assert float(jnp.max(jnp.abs(a - plain))) > 1e-4 and float(jnp.max(jnp.abs(a - b))) > 1e-4
    # the base path has no dropout: with the adapters zeroed, a key changes nothing
    zero = jax.tree.map(jnp.zeros_like, adapters)
    np.testing.assert_allclose(
        score_tokens(lora_def, (zero, frozen), tokens, tokens, positions=positions, attention_mask=mask,
                     dropout_rng=jax.random.key(0))[0],
        score_tokens(graphdef, frozen, tokens, tokens, positions=positions, attention_mask=mask)[0], atol=1e-6)


def test_lora_on_the_experts_of_an_moe_model_is_refused():
    from jaxrl4llm.models import ModelConfig, abstract_model

    moe = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=0, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8)
    with pytest.raises(ValueError, match="LoRA on the experts .* not supported; adapt q_proj"):
        abstract_model(moe, lora=LoraSettings(targets=("q_proj", "up_proj")))
    _, state = abstract_model(moe, lora=LoraSettings(targets=("q_proj", "lm_head")))  # attention and head: fine
    assert "lora" in state["layers"]["attn"]["q_proj"]
