"""generate(): greedy parity with transformers, exact log-probs, EOS/truncation, seeds, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl4llm.models import forward
from jaxrl4llm.sampling import generate, response_token_lists
from jaxrl4llm.sampling.continuous import continuous_program
from jaxrl4llm.sampling.decode_loop import WEIGHTS_PROGRAMS
from tests.sampling.conftest import PAD, load_family, random_prompts, with_dtype


def hf_greedy(model, prompts, max_new_tokens, eos=None) -> list[list[int]]:
    """transformers generate(do_sample=False) on a left-padded batch; each row's new tokens, cut after EOS."""
    t = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (t - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=PAD)[:, t:].tolist()
    rows = []
    for row in out:
        cut = row.index(eos) + 1 if eos is not None and eos in row else len(row)
        rows.append(row[:cut])
    return rows


def teacher_forced_logprobs(graphdef, state, rollout, temperature=1.0):
    """log softmax(logits / T)[y_t] from one forward pass over concat(prompt, response), positions cumsum(mask)-1."""
    tokens = jnp.concatenate([rollout.prompt_tokens, rollout.response_tokens], axis=1)
    mask = jnp.concatenate([rollout.prompt_mask, rollout.response_mask], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    logits = forward(graphdef, state, tokens, positions=positions, attention_mask=mask)
    p = rollout.prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, p - 1:-1] / temperature, axis=-1)
    return jnp.take_along_axis(logp, rollout.response_tokens[..., None], axis=-1)[..., 0], logits[:, p - 1:-1]


@pytest.mark.parametrize("family,max_new_tokens,block", [("qwen2", 24, None), ("qwen3", 33, 16), ("llama", 24, None),
                                                        ("qwen3_moe", 20, None)])
def test_greedy_matches_transformers_token_for_token(family, max_new_tokens, block, tmp_path_factory, key):
    model, _, graphdef, state = load_family(family, tmp_path_factory)
    prompts = random_prompts(1)
    run = lambda eos: generate(graphdef, state, prompts, num_samples=2, max_new_tokens=max_new_tokens, greedy=True,
                               eos_token_ids=[] if eos is None else [eos], pad_token_id=PAD, rng=key,
                               kv_block_size=block)
    expected = hf_greedy(model, prompts, max_new_tokens)
    ours = run(None)
    got = response_token_lists(ours)
    for n, row in enumerate(got):
        assert row == expected[n // 2], f"row {n} (prompt {n // 2}) differs from transformers"
    assert np.all(np.asarray(ours.truncated))

    # EOS parity: a token that row 0 emits at step 5 ends that row there; others stop at their own first one.
    eos = expected[0][5]
    expected = hf_greedy(model, prompts, max_new_tokens, eos=eos)
    ours = run(eos)
    got = response_token_lists(ours)
    assert got[0] == expected[0] and len(got[0]) <= 6
    for n, row in enumerate(got):
        assert row == expected[n // 2], f"row {n} (prompt {n // 2}) differs from transformers with eos={eos}"
    tokens, mask = np.asarray(ours.response_tokens), np.asarray(ours.response_mask)
    lengths = np.asarray(ours.lengths)
    np.testing.assert_array_equal(lengths, [len(r) for r in got])
    np.testing.assert_array_equal(np.asarray(ours.truncated), [r[-1] != eos for r in got])
    np.testing.assert_array_equal(mask, np.arange(max_new_tokens)[None] < lengths[:, None])
    assert np.all(tokens[mask == 0] == PAD)
    assert np.all(np.asarray(ours.logprobs)[mask == 0] == 0)


def test_logprobs_equal_teacher_forced_forward(qwen3, key):
    _, _, graphdef, state = qwen3
    temperature = 0.7
    rollout = generate(graphdef, state, random_prompts(2), num_samples=3, max_new_tokens=33, temperature=temperature,
                       eos_token_ids=[5], pad_token_id=PAD, rng=key, kv_block_size=16)
    expected, _ = teacher_forced_logprobs(graphdef, state, rollout, temperature)
    mask = np.asarray(rollout.response_mask)
    assert mask.sum() > 100
    np.testing.assert_allclose(np.asarray(rollout.logprobs_untruncated) * mask, np.asarray(expected) * mask, atol=1e-4)
    # no top-k / top-p: the sampling distribution is the tempered softmax itself
    np.testing.assert_array_equal(np.asarray(rollout.logprobs), np.asarray(rollout.logprobs_untruncated))


def test_top_k_top_p_stay_in_their_set_and_renormalise(qwen3, key):
    _, _, graphdef, state = qwen3
    top_k, top_p, temperature = 7, 0.6, 1.3
    rollout = generate(graphdef, state, random_prompts(3), num_samples=4, max_new_tokens=24, temperature=temperature,
                       top_k=top_k, top_p=top_p, eos_token_ids=[], pad_token_id=PAD, rng=key)
    _, logits = teacher_forced_logprobs(graphdef, state, rollout, temperature)
    z = np.asarray(logits, np.float64) / temperature  # [N, R, V]
    tokens = np.asarray(rollout.response_tokens)
    order = np.argsort(-z, axis=-1)
    sorted_z = np.take_along_axis(z, order, axis=-1)[..., :top_k]
    probs = np.exp(sorted_z - sorted_z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = (np.cumsum(probs, -1) - probs) < top_p
    rank = np.argmax(order == tokens[..., None], axis=-1)
    assert np.all(rank < top_k), "top-k emitted a token outside the k most likely"
    assert np.all(np.take_along_axis(keep, rank[..., None], -1)), "top-p emitted a token outside the nucleus"
    kept = np.where(keep, sorted_z, -np.inf)
    expected = np.take_along_axis(kept, rank[..., None], -1)[..., 0] - np.log(np.exp(kept).sum(-1))
    np.testing.assert_allclose(np.asarray(rollout.logprobs), expected, atol=1e-4)
    assert np.all(np.asarray(rollout.logprobs) >= np.asarray(rollout.logprobs_untruncated) - 1e-6)


def test_same_seed_same_rollout_and_known_bucket_does_not_recompile(qwen3):
    _, _, graphdef, state = qwen3
    kwargs = dict(num_samples=3, max_new_tokens=33, temperature=0.7, eos_token_ids=[5], pad_token_id=PAD,
                  kv_block_size=16)
    first = generate(graphdef, state, random_prompts(2), rng=jax.random.key(7), **kwargs)
    compiled = continuous_program._cache_size(), sum(f._cache_size() for f in WEIGHTS_PROGRAMS.values())
    again = generate(graphdef, state, random_prompts(2), rng=jax.random.key(7), **kwargs)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other_seed = generate(graphdef, state, random_prompts(2), rng=jax.random.key(8), **kwargs)
    assert not np.array_equal(np.asarray(first.response_tokens), np.asarray(other_seed.response_tokens))
    # new prompts: 3 prompts of other lengths land in the same (16-token, 4-prompt) bucket
    new = generate(graphdef, state, random_prompts(9, lengths=(12, 2, 16)), rng=jax.random.key(7), **kwargs)
    assert new.response_tokens.shape == (9, 33)
    assert (continuous_program._cache_size(), sum(f._cache_size() for f in WEIGHTS_PROGRAMS.values())) == compiled, \
        "a known bucket recompiled the sampler"


def test_first_token_frequencies_match_the_tempered_softmax(qwen3, key):
    _, config, graphdef, state = qwen3
    from tests.sampling.test_filters import chi_square_pvalue

    prompt = random_prompts(4, lengths=(7,))
    temperature = 0.8
    rollout = generate(graphdef, state, prompt, num_samples=4000, max_new_tokens=1, temperature=temperature,
                       eos_token_ids=[], pad_token_id=PAD, rng=key)
    _, logits = teacher_forced_logprobs(graphdef, state, jax.tree.map(lambda a: a[:1], rollout), temperature)
    probs = np.asarray(jax.nn.softmax(logits[0, 0] / temperature))
    counts = np.bincount(np.asarray(rollout.response_tokens[:, 0]), minlength=config.vocab_size)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_bf16_rollout_matches_a_bf16_teacher_forced_forward(qwen3, key):
    """The bf16 decode path (fused output-major weights, bf16 KV blocks written through their bit
    pattern) computes what the bf16 training forward computes over the same tokens."""
    _, config, _, state = qwen3
    graphdef = with_dtype(config, "bfloat16")
    rollout = generate(graphdef, state, random_prompts(3), num_samples=2, max_new_tokens=40, temperature=1.0,
                       eos_token_ids=[], pad_token_id=PAD, rng=key, kv_block_size=16)
    expected, logits = teacher_forced_logprobs(graphdef, state, rollout)
    got = np.asarray(rollout.logprobs_untruncated)
    assert got.shape == (8, 40) and float(np.asarray(rollout.response_mask).min()) == 1.0
    # bf16 matmul inputs: both sides round the same activations, so they agree far inside bf16's 2^-8
    # bf16: the teacher-forced forward's flash attention rounds in tiles, the sampler's in one pass
    np.testing.assert_allclose(got, np.asarray(expected), atol=0.05)
    assert np.mean(np.abs(got - np.asarray(expected))) < 0.01


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernels_and_xla_ops_give_the_same_rollout(qwen3, key, dtype):
    """The sampler with its C++ CPU kernels (decode attention, top-k) against its XLA ops alone:
    the same tokens for the same seed, log-probs equal to round-off (float32) or bf16 rounding."""
    _, config, _, state = qwen3
    graphdef = with_dtype(config, dtype)
    run = lambda kernels: generate(graphdef, state, random_prompts(5), num_samples=3, max_new_tokens=40,
                                   temperature=0.9, top_k=9, top_p=0.95, eos_token_ids=[], pad_token_id=PAD,
                                   rng=key, kv_block_size=16, cpu_kernels=kernels)
    with_kernels, xla_only = run(True), run(False)
    tokens = np.asarray(with_kernels.response_tokens)
    same = tokens == np.asarray(xla_only.response_tokens)
    if dtype == "float32":
        assert same.all()
        np.testing.assert_allclose(np.asarray(with_kernels.logprobs), np.asarray(xla_only.logprobs), atol=1e-5)
    else:  # a bf16 rounding may flip a near-tie, after which a row's continuation differs
        first_diff = np.where(same.all(axis=1), tokens.shape[1], np.argmin(same, axis=1))
        assert np.mean(first_diff == tokens.shape[1]) >= 0.7, first_diff
        agree = np.arange(tokens.shape[1])[None, :] < first_diff[:, None]
        gap = np.abs(np.asarray(with_kernels.logprobs) - np.asarray(xla_only.logprobs))[agree]
        assert gap.max() < 0.05 and gap.mean() < 0.005


def test_cpu_kernels_required_but_switched_off(qwen3, key, monkeypatch):
    _, _, graphdef, state = qwen3
    from jaxrl4llm.kernels import KernelBuildError

    monkeypatch.setenv("JAXRL4LLM_CPU_KERNELS", "0")
    with pytest.raises(KernelBuildError, match="JAXRL4LLM_CPU_KERNELS=0"):
        generate(graphdef, state, random_prompts(1), num_samples=1, max_new_tokens=2, eos_token_ids=[],
                 pad_token_id=PAD, rng=key, cpu_kernels=True)


def test_chunked_rollout_equals_one_call(qwen3):
    """prompts_per_chunk: the same rows (tokens, log-probs) as one call over all prompts; row n's
    uniforms depend on its global index only. Bad chunk sizes are refused."""
    _, _, graphdef, state = qwen3
    prompts = random_prompts(5, lengths=(7, 3, 12, 5, 9))
    kwargs = dict(num_samples=2, max_new_tokens=10, temperature=0.9, top_k=20, eos_token_ids=[5], pad_token_id=PAD,
                  rng=jax.random.key(11), kv_block_size=16, engine="static")
    whole = generate(graphdef, state, prompts, **kwargs)
    for chunk in (2, 4):  # 3 chunks of 2 (the last one padded) and 4 + 1
        parts = generate(graphdef, state, prompts, prompts_per_chunk=chunk, **kwargs)
        assert parts.response_tokens.shape == whole.response_tokens.shape == (10, 10)
        np.testing.assert_array_equal(np.asarray(parts.response_tokens), np.asarray(whole.response_tokens))
        np.testing.assert_array_equal(np.asarray(parts.prompt_tokens), np.asarray(whole.prompt_tokens))
        np.testing.assert_allclose(np.asarray(parts.logprobs), np.asarray(whole.logprobs), atol=1e-5)
    with pytest.raises(ValueError, match="prompts_per_chunk"):
        generate(graphdef, state, prompts, prompts_per_chunk=0, **kwargs)
