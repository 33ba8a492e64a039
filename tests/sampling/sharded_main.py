"""Run in a subprocess with 8 simulated CPU devices: sharded generate() == single-device generate(),
for the static and the continuous engine (data-parallel shards with their own slots and pages,
tensor-parallel weights and KV heads), and partial rollouts through one engine."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.models import ModelConfig, init_model, make_mesh, param_shardings  # noqa: E402
from jaxrl4llm.sampling import decode_mesh, generate  # noqa: E402


def main():
    assert len(jax.devices()) == 8, jax.devices()
    config = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", max_position_embeddings=128)
    graphdef, state = init_model(config, jax.random.key(0), std=0.3)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded_state = jax.device_put(state, param_shardings(state, mesh))  # the train step's (FSDP) layout
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded_state)), "nothing got sharded"
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    for options in (dict(temperature=0.9, top_k=10, top_p=0.9),):
        kwargs = dict(num_samples=2, max_new_tokens=12, eos_token_ids=[1], pad_token_id=0, rng=jax.random.key(3),
                      engine="static", **options)
        single = generate(graphdef, state, prompts, **kwargs)
        sharded = generate(graphdef, sharded_state, prompts, mesh=mesh, **kwargs)
        np.testing.assert_array_equal(np.asarray(sharded.response_tokens), np.asarray(single.response_tokens))
        np.testing.assert_array_equal(np.asarray(sharded.lengths), np.asarray(single.lengths))
        np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(single.logprobs), atol=1e-5)
        assert sharded.response_tokens.shape == (6, 12)
        # the sampler's own mesh: 2-way tensor parallel (4 x 1 x 2), in chunks of 2 prompts; and 2 x 1 x 4
        # (each chip one of 2 kv heads is impossible: tp must divide the kv heads, so 4 fails clearly)
        for tp, chunk in ((2, 2), (1, None)):
            regrouped = decode_mesh(mesh, tp, num_kv_heads=config.num_kv_heads)
            assert dict(regrouped.shape) == {"data": 8 // tp, "fsdp": 1, "tensor": tp}
            got = generate(graphdef, sharded_state, prompts, mesh=regrouped, prompts_per_chunk=chunk, **kwargs)
            np.testing.assert_array_equal(np.asarray(got.response_tokens), np.asarray(single.response_tokens))
            np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(single.logprobs), atol=1e-5)
        try:
            decode_mesh(mesh, 4, num_kv_heads=config.num_kv_heads)
            raise AssertionError("tensor_parallel=4 over 2 kv heads was accepted")
        except ValueError as e:
            assert "KV heads" in str(e), e
    continuous_rows(graphdef, state, sharded_state, mesh, config)
    print("OK")


def continuous_rows(graphdef, state, sharded_state, mesh, config):
    """The continuous engine on the sampler's 4 x 1 x 2 mesh (`decode_mesh`, 2-way tensor parallel):
    4 data-parallel shards of 2 prompts x 2 samples on 2 slots each (so every shard refills), pages of
    4 tokens, per-row budgets and EOS: the single-device static engine's rows."""
    from jaxrl4llm.sampling import decode_mesh

    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13] * 6, [2, 3], [9, 8, 7, 6], [4], [5, 5, 5]]
    g, r = 2, 14
    budgets = np.random.default_rng(1).integers(1, r + 1, len(prompts) * g)
    kwargs = dict(num_samples=g, max_new_tokens=r, eos_token_ids=[1, 2], pad_token_id=0, rng=jax.random.key(4),
                  temperature=0.9, top_k=10, top_p=0.9, row_max_new_tokens=budgets)
    single = generate(graphdef, state, prompts, engine="static", **kwargs)
    assert len(set(np.asarray(single.lengths).tolist())) > 4, np.asarray(single.lengths)
    for m in (decode_mesh(mesh, 2, num_kv_heads=config.num_kv_heads),):
        got = generate(graphdef, sharded_state, prompts, mesh=m, engine="continuous", slots=8, kv_page_size=4,
                       decode_burst=3, **kwargs)
        for name in ("response_tokens", "lengths", "truncated", "response_mask"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(single, name)), name)
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(single.logprobs), atol=1e-5)
    partial_rows(graphdef, state, sharded_state, decode_mesh(mesh, 2, num_kv_heads=config.num_kv_heads), prompts,
                 budgets, {k: v for k, v in kwargs.items() if k not in ("rng", "row_max_new_tokens")})


def partial_rows(graphdef, state, sharded_state, mesh, prompts, budgets, sampling):
    """Partial rollouts (`sampling.partial`) on the 4 x 1 x 2 mesh: two rollouts of 4 prompts through
    one engine (1 slot a shard: the second rollout's rows start in the slots the first's free), the
    same weights: each rollout is the single-device static engine's rows of its prompts."""
    from jaxrl4llm.sampling.partial import PartialRollouts

    g = sampling["num_samples"]
    parts, keys = [prompts[:4], prompts[4:]], [jax.random.key(5), jax.random.key(6)]
    rows = [budgets[:4 * g], budgets[4 * g:]]
    stream = PartialRollouts(graphdef, sharded_state, num_prompts=4, prompt_len=8, mesh=mesh, slots=4,
                             kv_page_size=4, decode_burst=3, **sampling)
    for t in range(2):
        stream.enqueue(parts[t], keys[t], rows[t])
    for t in range(2):
        got, _ = stream.segment(graphdef, sharded_state, version=0)
        want = generate(graphdef, state, parts[t], engine="static", rng=keys[t], row_max_new_tokens=rows[t],
                        prompt_buckets=(8,), **sampling)
        for name in ("response_tokens", "lengths", "truncated", "prompt_tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), name)
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


if __name__ == "__main__":
    main()
