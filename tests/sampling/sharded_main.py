"""Run in a subprocess with 8 simulated CPU devices: sharded generate() == single-device generate(),
for the static and the continuous engine (data-parallel shards with their own slots and pages,
tensor-parallel weights and KV heads), partial rollouts through one engine, a mixture of experts with its
recorded routes; the vocab-split top-k == lax.top_k."""

import os

from tests.subprocess_xla_flags import xla_flags  # imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))
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
            np.testing.assert_allclose(np.asarray(got.logprobs_untruncated),
                                       np.asarray(single.logprobs_untruncated), atol=1e-5)
        try:
            decode_mesh(mesh, 4, num_kv_heads=config.num_kv_heads)
            raise AssertionError("tensor_parallel=4 over 2 kv heads was accepted")
        except ValueError as e:
            assert "KV heads" in str(e), e
    # greedy over the vocab split 2 ways: top-1 per shard + one gather, the single device's argmax
    greedy = dict(num_samples=1, max_new_tokens=12, eos_token_ids=[1], pad_token_id=0, rng=jax.random.key(3),
                  engine="static", greedy=True)
    single = generate(graphdef, state, prompts, **greedy)
    got = generate(graphdef, sharded_state, prompts, mesh=decode_mesh(mesh, 2, num_kv_heads=config.num_kv_heads),
                   **greedy)
    np.testing.assert_array_equal(np.asarray(got.response_tokens), np.asarray(single.response_tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(single.logprobs), atol=1e-5)
    continuous_rows(graphdef, state, sharded_state, mesh, config)
    moe_rows(mesh)
    split_vocab_top_k_is_lax_top_k()
    tool_rows()
    print("OK")


def tool_rows():
    """Rows with tool calls (tests/sampling/test_tool_rollout.py's model, format and stand-in tool) on a
    2-way data-parallel mesh, 2 slots a shard: the single device's rows, tool masks and log-probs."""
    from jaxrl4llm.sampling import generate_with_tools
    from jaxrl4llm.tools.protocol import ToolsSpec
    from tests.sampling.test_tool_rollout import FORMAT, PROMPTS, R, CharTokenizer, StandIn, tiny_model

    graphdef, state = tiny_model()
    spec = ToolsSpec(format="llama3_chat", max_turns=2, max_tool_tokens=6, max_output_chars=4)
    kwargs = dict(tools=spec, tokenizer=CharTokenizer(), num_samples=1, max_new_tokens=R, eos_token_ids=[],
                  pad_token_id=0, rng=jax.random.key(0), greedy=True, kv_page_size=4, decode_burst=4, segment_steps=8,
                  row_max_new_tokens=[R, 13, 24, 9, R, R], fmt=FORMAT)
    single, single_stats = generate_with_tools(graphdef, state, PROMPTS, executor=StandIn(), slots=3, **kwargs)
    sharded, stats = generate_with_tools(graphdef, state, PROMPTS, executor=StandIn(), slots=4,
                                         mesh=make_mesh(data=2, devices=jax.devices()[:2]), **kwargs)
    for name in ("response_tokens", "tool_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(sharded, name)), np.asarray(getattr(single, name)), name)
    np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(single.logprobs), atol=1e-5)
    np.testing.assert_array_equal(stats.calls, single_stats.calls)
    assert np.asarray(single.tool_mask).sum() > 0


def moe_rows(mesh):
    """A mixture of experts on the sampler's 4 x 1 x 2 mesh (the experts' widths split 2 ways), the
    continuous engine recording routes: the single-device static engine's rows, and the routes a
    single-device continuous engine records."""
    moe = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", max_position_embeddings=128,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    graphdef, state = init_model(moe, jax.random.key(2), std=0.3)
    sharded_state = jax.device_put(state, param_shardings(state, mesh))
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13] * 6]
    kwargs = dict(num_samples=2, max_new_tokens=10, eos_token_ids=[1], pad_token_id=0, rng=jax.random.key(7),
                  temperature=0.9, top_k=10, top_p=0.9)
    single = generate(graphdef, state, prompts, engine="static", **kwargs)
    alone = generate(graphdef, state, prompts, engine="continuous", slots=8, kv_page_size=4, record_routes=True,
                     **kwargs)
    got = generate(graphdef, sharded_state, prompts, mesh=decode_mesh(mesh, 2, num_kv_heads=moe.num_kv_heads),
                   engine="continuous", slots=8, kv_page_size=4, record_routes=True, **kwargs)
    for name in ("response_tokens", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(single, name)), name)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(single.logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(alone.routes))
    np.testing.assert_array_equal(np.asarray(got.prompt_routes), np.asarray(alone.prompt_routes))


def split_vocab_top_k_is_lax_top_k():
    """`filters.split_vocab_top_k` over a vocabulary split 4 ways (rows 2 ways) == lax.top_k of the
    whole row (values and ids, ties to the lower id, rows of -inf, k above a shard's 64 entries;
    k = 1, 2 run `top_k_logits`' two-level path in each shard),
    and its log-normaliser == logsumexp; one all-gather and no all-to-all in the compiled program."""
    import jax.numpy as jnp
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from jaxrl4llm.sampling.filters import VocabShards, split_vocab_top_k

    shards = VocabShards(make_mesh(data=2, fsdp=1, tensor=4), "tensor", ("data", "fsdp"))
    run = jax.jit(split_vocab_top_k, static_argnums=(1, 2))

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.sampled_from([1, 2, 7, 100]), st.integers(0, 2**31 - 1), st.sampled_from([3, 30, 1000]),
           st.floats(0.0, 0.9))
    def check(k, seed, spread, inf_share):
        rng = np.random.default_rng(seed)
        z = rng.integers(-spread, spread + 1, (4, 256)).astype(np.float32) / 4  # few distinct values: ties
        z[rng.random(z.shape) < inf_share] = -np.inf
        z[0, :160] = -np.inf  # a row with whole shards of -inf
        z[1] = -1.0  # a boundary tie across blocks that rank out of index order (block 5 has the 5)
        z[1, [40, 41, 16]] = [5.0, 3.0, 3.0]  # top-2: ids 40, 16 (not 41)
        values, ids, log_norm = run(jnp.asarray(z), k, shards)
        want_values, want_ids = jax.lax.top_k(jnp.asarray(z), k)
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(log_norm), np.asarray(jax.nn.logsumexp(jnp.asarray(z), axis=-1)),
                                   rtol=1e-6)

    check()
    hlo = run.lower(jnp.zeros((4, 256), jnp.float32), 7, shards).compile().as_text()
    assert hlo.count("all-gather(") == 1 and "all-to-all" not in hlo and "all-reduce(" not in hlo, hlo


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
        np.testing.assert_allclose(np.asarray(got.logprobs_untruncated),
                                   np.asarray(single.logprobs_untruncated), atol=1e-5)
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
