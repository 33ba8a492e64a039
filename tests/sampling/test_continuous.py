"""The continuous engine (slots over a paged KV cache) gives the static engine's rows, row for row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.models import forward
from jaxrl4llm.models.decode import prefill_kv
from jaxrl4llm.sampling import generate
from jaxrl4llm.sampling.buckets import left_pad_prompts
from jaxrl4llm.sampling.continuous import (Admission, Engine, EngineSpec, Queue, Sampling, admission,
                                           continuous_program, decode_burst, decode_step, empty_state, engine_slots,
                                           insert, prefill, refill, retire, rows_of_half)
from jaxrl4llm.sampling.decode_loop import decode_backend, weights_program
from jaxrl4llm.sampling.gpu_paged_attention import gpu_paged_attention
from jaxrl4llm.sampling.paged_cache import (empty_free_pages, kernel_paged_attention, paged_attention, pop_pages,
                                            push_pages, write_tokens)
from tests.gpu_kernels import assert_close_bf16, bf16_normal, paged_attention_reference, pallas_interpret
from tests.sampling.conftest import PAD, random_prompts


def assert_same_rows(got, expected):
    for name in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(expected, name)), err_msg=name)
    for name in ("logprobs", "logprobs_untruncated"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(expected, name)), atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("mode", ["sampled_eos_budgets", "greedy"])
def test_continuous_engine_gives_the_static_rows(qwen3, mode):
    """5 prompts x 3 samples on 4 slots (greedy) or 6 (sampled: slots are refilled, a prompt's rows
    start at different times), pages of 4 tokens, bursts of 3 steps:
    the same tokens, lengths, truncation and log-probs as the static engine. Sampled: top-k, top-p,
    an EOS and per-row budgets (rows stopping at different lengths); greedy: no EOS, every row runs R."""
    _, _, graphdef, state = qwen3
    prompts = random_prompts(6, lengths=(7, 3, 12, 5, 9))
    r, g = 21, 3
    kwargs = dict(num_samples=g, max_new_tokens=r, pad_token_id=PAD, rng=jax.random.key(5))
    if mode == "greedy":
        kwargs.update(greedy=True, eos_token_ids=[])
    else:
        budgets = np.random.default_rng(0).integers(1, r + 1, len(prompts) * g)
        kwargs.update(temperature=0.9, top_k=20, top_p=0.95, eos_token_ids=list(range(5, 96, 9)), row_max_new_tokens=budgets)
    static = generate(graphdef, state, prompts, engine="static", **kwargs)
    # sampled: 6 slots = 2 prompts' rows, so admissions prefill 2 prompts at once or 1 (`prefill_prompts`)
    continuous = generate(graphdef, state, prompts, engine="continuous", slots=4 if mode == "greedy" else 6,
                          kv_page_size=4, decode_burst=3, **kwargs)
    assert_same_rows(continuous, static)
    lengths = np.asarray(static.lengths)
    if mode == "greedy":
        assert np.all(lengths == r) and np.all(np.asarray(static.truncated))
    else:  # rows end at an EOS, at their budget, and at different lengths
        assert np.all(lengths <= budgets) and len(set(lengths.tolist())) > 5
        assert (~np.asarray(static.truncated)).any() and (lengths == budgets).any()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=12))
def test_free_pages_never_hand_out_a_page_twice(ops):
    """Pops and pushes on the free stack: live pages stay distinct, never the trash page, and
    every page comes back."""
    free = empty_free_pages(1, 10)
    held = []
    for n, give_back in ops:
        n = min(n, int(free.top[0]))
        free, ids = pop_pages(free, jnp.arange(4)[None] < n)
        got = np.asarray(ids[0, :n]).tolist()
        assert 0 not in got and not set(got) & set(held)
        held += got
        if give_back and held:
            back, held = held[: len(held) // 2 + 1], held[len(held) // 2 + 1:]
            free = push_pages(free, jnp.asarray(back, jnp.int32)[None], jnp.ones((1, len(back)), bool))
    free = push_pages(free, jnp.asarray(held or [0], jnp.int32)[None], jnp.asarray([bool(held)])[None].repeat(
        max(len(held), 1), axis=1))
    assert int(free.top[0]) == 9 and sorted(np.asarray(free.stack[0, :9]).tolist()) == list(range(1, 10))


def test_paged_attention_equals_softmax_and_the_ragged_kernel_reference():
    """Slots whose tokens lie contiguously over scattered pages (different lengths, one chunk more
    than the longest needs): the chunked attention equals a dense softmax over the same keys, and
    `ref_ragged_paged_attention` (the TPU kernel's shipped reference) on the same pool and tables."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(0)
    d, s, kvh, hg, dh, page, pages = 2, 3, 2, 2, 8, 4, 20
    pool = jnp.asarray(rng.normal(size=(d, pages, page, 2 * kvh, dh)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(d, s, kvh, hg, dh)), jnp.float32)
    lengths = np.array([[1, 9, 16], [5, 12, 3]], np.int32)
    width = 6  # logical pages per slot, 3 chunks of 2
    table = np.stack([np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in range(s)]) for _ in range(d)])
    table = table.astype(np.int32)
    counts = np.clip(lengths[..., None] - np.arange(width) * page, 0, page)
    got = np.asarray(paged_attention(q, pool, jnp.asarray(table), jnp.asarray(counts), jnp.int32(3),
                                     pages_per_chunk=2, dtype=jnp.float32))
    for i in range(d):
        for j in range(s):
            tokens = np.asarray(pool)[i, table[i, j]].reshape(-1, kvh, 2, dh)[: lengths[i, j]]  # [n, KVH, k|v, Dh]
            scores = np.einsum("khe,nke->khn", np.asarray(q)[i, j], tokens[:, :, 0]) / np.sqrt(dh)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            np.testing.assert_allclose(got[i, j], np.einsum("khn,nke->khe", probs, tokens[:, :, 1]), atol=1e-5)
        ref = ref_ragged_paged_attention(q[i].reshape(s, kvh * hg, dh), pool[i], jnp.asarray(lengths[i]),
                                         jnp.asarray(table[i]), jnp.arange(s + 1, dtype=jnp.int32),
                                         jnp.array([s], jnp.int32), sm_scale=dh**-0.5)
        np.testing.assert_allclose(got[i], np.asarray(ref).reshape(s, kvh, hg, dh), atol=1e-5)
    # a write lands in its page and offset only, keys and values interleaved by head
    k, v = jnp.full((d, 2, kvh, dh), 7.0), jnp.full((d, 2, kvh, dh), 9.0)
    written = write_tokens(pool, jnp.asarray([[3, 0], [5, 0]]), jnp.asarray([[2, 0], [1, 0]]), k, v)
    assert float(written[0, 3, 2, 0, 0]) == 7 and float(written[1, 5, 1, 3, 5]) == 9
    assert int(jnp.sum(written != pool)) <= 4 * 2 * kvh * dh


def test_the_ragged_kernel_call_traces():
    """The TPU kernel does not run on CPU, but its call traces: shapes and arguments as the engine
    passes them (explicit block sizes: the tuned table needs a TPU)."""
    shape = lambda s, t: jax.ShapeDtypeStruct(s, t)
    blocks = dict(num_kv_pages_per_block=8, num_queries_per_block=8, vmem_limit_bytes=32 * 2**20)
    out = jax.eval_shape(lambda *a: kernel_paged_attention(*a, block_sizes=blocks),
                         shape((1, 8, 2, 4, 128), jnp.float32), shape((1, 64, 16, 4, 128), jnp.bfloat16),
                         shape((1, 8, 16), jnp.int32), shape((1, 8), jnp.int32))
    assert out.shape == (1, 8, 2, 4, 128) and out.dtype == jnp.float32


_gpu_kernel = jax.jit(lambda q, pool, table, kv_len, k_splits, layout, split_rule, store: gpu_paged_attention(
    q, pool, table, kv_len, interpret=True, layout=layout, pages_per_block=1, k_splits=k_splits,
    split_rule=split_rule, store=store), static_argnames=("k_splits", "layout", "split_rule", "store"))
_xla_path = jax.jit(lambda q, pool, table, counts: paged_attention(q, pool, table, counts, jnp.int32(2),
                                                                   pages_per_chunk=2, dtype=jnp.bfloat16))


@pytest.mark.parametrize("case", [(2, 3, 4, 2, "per_kv_head", "table", "all"), (1, 4, 8, 3, "per_kv_head", "length", "live"),
                                  (4, 2, 4, 2, "per_slot", "length", "all"), (2, 3, 8, 3, "per_slot", "table", "live")])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1))
def test_gpu_paged_kernel_equals_the_xla_path(case, seed):
    """The GPU (Triton) paged attention kernel, run by Pallas' interpreter on CPU, on our interleaved
    pool as the engine holds it: equals `paged_attention` (XLA) on every live slot, for (kv heads,
    GQA group, page size, partitions of a slot's pages, layout; each split rule and store of the
    partials at least once: `gpu_paged_attention.SPLIT_RULES`, `STORES`) = (2, 3, 4, 2), (1, 4, 8, 3) a program
    per kv head (a group padded to the kernel's 16 query rows; partitions: the flash-decoding combine,
    three of a 4-page slot padding its page table to 6), (4, 2, 4, 2), (2, 3, 8, 3) a program per slot
    (every kv head's keys a loop step, each query row masked to its own head's: 8 and 6 real rows of
    16); lengths cross pages, an idle slot gives 0. Tolerance: a bf16 pool; the kernel rounds
    unnormalised probabilities to bf16 (the XLA path normalised ones). Four shapes: one compile each."""
    kvh, hg, page, splits, layout, split_rule, store = case
    rng = np.random.default_rng(seed)
    slots, dh, width, pages = 3, 16, 4, 24
    pool = jnp.asarray(rng.normal(size=(1, pages, page, 2 * kvh, dh)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(1, slots, kvh, hg, dh)), jnp.float32)
    lengths = np.concatenate([[0], rng.integers(1, width * page + 1, size=slots - 1)])[None].astype(np.int32)
    table = np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in range(slots)])[None].astype(np.int32)
    counts = np.clip(lengths[..., None] - np.arange(width) * page, 0, page)
    want = np.asarray(_xla_path(q, pool, table, counts))
    got = _gpu_kernel(q, pool, table, lengths, k_splits=splits, layout=layout, split_rule=split_rule, store=store)
    assert got.shape == q.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got)[0, 1:], want[0, 1:], atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(got)[0, 0], 0.0)  # the idle slot


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads, group, layout", [(8, 2, "per_kv_head"), (8, 4, "per_kv_head"), (8, 2, "per_slot")])
def test_gpu_paged_kernel_in_bf16_at_qwen3_shapes(kv_heads, group, layout):
    """The Triton paged attention kernel (for real on a GPU, Pallas' interpreter elsewhere:
    `tests.gpu_kernels.pallas_interpret`) at Qwen3 shapes: head_dim 128, GQA 16:8 and 32:8 a program
    per kv head, 16:8 a program per slot, 16-token pages, a bf16 pool, the layout's default blocks and
    k-split; slots of ragged lengths over scattered pages and an idle slot (output 0). Equals the XLA
    path and a float64 reference to bf16 tolerances (`tests.gpu_kernels.BF16_*`)."""
    rng = np.random.default_rng(group)
    slots, dh, page, width, pages = 4, 128, 16, 8, 40
    pool = bf16_normal(rng, (1, pages, page, 2 * kv_heads, dh))
    q = rng.standard_normal((1, slots, kv_heads, group, dh))
    lengths = np.array([[0, 1, 37, width * page]], np.int32)  # idle, one token, within a page's middle, full
    table = np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in range(slots)])[None].astype(np.int32)
    counts = np.clip(lengths[..., None] - np.arange(width) * page, 0, page)
    pool_bf16, q32 = jnp.asarray(pool, jnp.bfloat16), jnp.asarray(q, jnp.float32)
    got = jax.jit(lambda *a: gpu_paged_attention(*a, layout=layout, interpret=pallas_interpret()))(
        q32, pool_bf16, jnp.asarray(table), jnp.asarray(lengths))
    xla = jax.jit(lambda *a: paged_attention(*a, jnp.int32(width // 2), pages_per_chunk=2, dtype=jnp.bfloat16))(
        q32, pool_bf16, jnp.asarray(table), jnp.asarray(counts))
    want = paged_attention_reference(q[0], pool[0], table[0], lengths[0])
    assert got.shape == q.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got)[0, 0], 0.0)  # the idle slot
    assert_close_bf16(np.asarray(got)[0, 1:], want[1:], "kernel vs float64")
    assert_close_bf16(np.asarray(xla)[0, 1:], want[1:], "xla path vs float64")
    assert_close_bf16(np.asarray(got)[0, 1:], np.asarray(xla)[0, 1:], "kernel vs xla path")


@pytest.mark.parametrize("layout", ["per_kv_head", "per_slot"])
def test_continuous_engine_on_the_gpu_kernel_gives_the_static_rows(qwen3, monkeypatch, layout):
    """The engine's GPU path end to end on CPU: `generate` and the engine taken for a GPU, the kernel
    (in each grid layout, `gpu_paged_attention.LAYOUT`) run by Pallas' interpreter (float32: no bf16
    rounding between the paths) on every layer's pool as the engine writes it, its page tables and
    lengths. The greedy case of `test_continuous_engine_gives_the_static_rows` (its static rollout
    compiled once in a session): the static engine's tokens, log-probs to float32 rounding."""
    import functools

    from jaxrl4llm.kernels import choice
    from jaxrl4llm.sampling import continuous, gpu_paged_attention as gpa

    monkeypatch.setattr(gpa, "LAYOUT", layout)  # read when the kernel's call traces
    monkeypatch.setattr(choice, "is_gpu", lambda devices: True)  # the one rule: kernels.choice
    monkeypatch.setattr(choice, "gpu_kernel_supports", lambda *shape: True)
    calls = []
    monkeypatch.setattr(continuous, "gpu_paged_attention", lambda *a, **k: calls.append(a[0].shape) or
                        functools.partial(gpa.gpu_paged_attention, interpret=True)(*a, **k))
    _, _, graphdef, state = qwen3
    prompts = random_prompts(6, lengths=(7, 3, 12, 5, 9))
    kwargs = dict(num_samples=3, max_new_tokens=21, pad_token_id=PAD, rng=jax.random.key(5), greedy=True,
                  eos_token_ids=[])
    static = generate(graphdef, state, prompts, engine="static", **kwargs)
    # its static arguments are the CPU kernel's (jit's cache key): compile it anew, and drop it after
    continuous.continuous_program.clear_cache()
    try:
        on_gpu_kernel = generate(graphdef, state, prompts, engine="continuous", slots=4, kv_page_size=4,
                                 decode_burst=3, paged_attention="kernel", **kwargs)
    finally:
        continuous.continuous_program.clear_cache()
    assert calls and all(shape[1:] == (4, 2, 2, 24) for shape in calls)  # [D, S, KVH, H/KVH, Dh], every layer
    for name in ("response_tokens", "response_mask", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(on_gpu_kernel, name)), np.asarray(getattr(static, name)))
    np.testing.assert_allclose(np.asarray(on_gpu_kernel.logprobs), np.asarray(static.logprobs), atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 8), st.integers(1, 8), st.integers(1, 4))
def test_engine_slots_are_whole_shards_and_never_more_than_the_rows(slots, prompts_per_shard, samples, shards):
    """S = D min(ceil(slots / D), P / D * G): what generate, partial rollouts and plan decode with."""
    prompts, rows = prompts_per_shard * shards, prompts_per_shard * shards * samples
    got = engine_slots(slots, num_prompts=prompts, samples=samples, shards=shards)
    assert got % shards == 0 and min(slots, rows) <= got <= rows and got - min(slots, rows) < shards
    assert engine_slots(None, num_prompts=prompts, samples=samples, shards=shards) == rows


def test_generate_says_why_the_kernel_cannot_run():
    from jaxrl4llm.kernels.choice import decode_attention_choice
    from jaxrl4llm.models import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, dtype="float32")
    devices = jax.devices()[:1]
    assert decode_attention_choice(config, devices, cpu_kernels=False, page_size=16).kernel == "xla"  # CPU, no kernels
    with pytest.raises(ValueError, match=r"'kernel' on TPU .*on GPU \(a power-of-two head_dim.*This call: cpu, "
                                         r"head_dim 32, kv_page_size 16, float32"):
        decode_attention_choice(config, devices, cpu_kernels=False, requested="kernel", page_size=16)


# ------------------------------------------------------------------ the engine's stages, one at a time
T_STAGES, R_STAGES, G_STAGES, PAGE_STAGES = 16, 8, 3, 4
_stage = dict(prefill=jax.jit(prefill, static_argnums=(0, 7)), insert=jax.jit(insert, static_argnums=0),
              refill=jax.jit(refill, static_argnums=0), decode_step=jax.jit(decode_step, static_argnums=0),
              decode_burst=jax.jit(decode_burst, static_argnums=0), retire=jax.jit(retire, static_argnums=1))


def _empty_engine(qwen3, prompts, *, slots, budgets=None, burst=3):
    """(engine, weights, sampling, state): a greedy engine (one shard, pages of 4 tokens, bursts of
    `burst` steps) over `prompts` (G = 3 rows each), every slot free."""
    _, config, graphdef, state = qwen3
    backend = decode_backend(config, mesh=None, use_kernels=False, block_size=32)
    spec = EngineSpec(config=config, backend=backend, num_samples=G_STAGES, max_new_tokens=R_STAGES, top_k=0,
                      use_top_p=False, greedy=True, slots=slots, page_size=PAGE_STAGES, burst=burst)
    engine = Engine.resolve(spec, num_prompts=len(prompts), prompt_len=T_STAGES, halves=1)
    padded = left_pad_prompts(prompts, pad_token_id=PAD, length=T_STAGES, num_rows=len(prompts))
    rows = len(prompts) * G_STAGES
    budgets = np.full((rows,), R_STAGES, np.int32) if budgets is None else np.asarray(budgets, np.int32)
    queue = Queue(tokens=jnp.asarray(padded.tokens)[None], mask=jnp.asarray(padded.mask, jnp.int32)[None],
                  uniforms=jnp.zeros((1, 1, 1), jnp.float32), budget=jnp.asarray(budgets)[None])
    sampling = Sampling(jnp.float32(1.0), jnp.float32(1.0), jnp.asarray([-1], jnp.int32), jnp.int32(PAD))
    weights = weights_program(graphdef, state, config=config, backend=backend)
    return engine, weights, sampling, empty_state(engine, queue, jnp.asarray([rows], jnp.int32), jnp.int32(PAD))


def _next_token_logits(qwen3, tokens):
    """The model's next-token logits [V] after `tokens` (the training forward: the oracle)."""
    _, _, graphdef, state = qwen3
    tokens = jnp.asarray([tokens], jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits = forward(graphdef, state, tokens, positions=positions, attention_mask=jnp.ones_like(tokens))
    return np.asarray(logits)[0, -1]


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_prefill_writes_the_prompts_kv_into_fresh_pages_and_draws_the_first_token_of_each_row(qwen3):
    """One round of one prompt (7 tokens, pages of 4): two pages taken from the stack, holding the
    prompt's keys and values as `prefill_kv` computes them (key of head h at column 2h, its value at
    2h + 1; to float32 rounding: another program's fusion); an entry with length 7 and G refs; its G
    rows' first tokens are the greedy next token of the training forward, with its log-probability;
    the other prompt's rows untouched."""
    prompts = random_prompts(3, lengths=(7, 3))
    engine, weights, sampling, state = _empty_engine(qwen3, prompts, slots=3)
    top = int(state.free.top[0])
    state = _stage["prefill"](engine, weights, sampling, state, jnp.asarray([0]), jnp.asarray([1]), 0, 1)
    entries = state.entries
    assert int(entries.length[0, 0]) == 7 and int(entries.refs[0, 0]) == G_STAGES and int(entries.of_prompt[0, 0]) == 0
    assert np.all(np.asarray(entries.refs[0, 1:]) == 0)
    pages = np.asarray(entries.pages[0, 0])
    assert int(state.free.top[0]) == top - 2 and len(set(pages[:2])) == 2 and 0 not in pages[:2]
    assert np.all(pages[2:] == 0)
    _, config, _, _ = qwen3
    padded = left_pad_prompts(prompts[:1], pad_token_id=PAD, length=T_STAGES, num_rows=1)
    _, keys, values, _ = prefill_kv(weights, config, jnp.asarray(padded.tokens), jnp.asarray(padded.mask),
                                 backend=engine.spec.backend)
    for layer_pool, layer_keys, layer_values in zip(state.pool, keys, values):
        for i in range(7):  # prompt token i: padded position T - 7 + i, page i // 4, offset i % 4
            stored = np.asarray(layer_pool[0, pages[i // PAGE_STAGES], i % PAGE_STAGES])
            np.testing.assert_allclose(stored[0::2], np.asarray(layer_keys[0, T_STAGES - 7 + i]), atol=1e-5)
            np.testing.assert_allclose(stored[1::2], np.asarray(layer_values[0, T_STAGES - 7 + i]), atol=1e-5)
    logits = _next_token_logits(qwen3, prompts[0])
    out = state.out
    np.testing.assert_array_equal(np.asarray(out.tokens[0, :G_STAGES, 0]), [np.argmax(logits)] * G_STAGES)
    np.testing.assert_allclose(np.asarray(out.logprobs[0, :G_STAGES, 0]), _log_softmax(logits).max(), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(out.length[0]), [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(out.segment[0]), [0, 0, 0, -1, -1, -1])


def test_insert_gives_the_first_free_slots_the_next_rows_and_each_a_copy_of_the_prompts_partial_page(qwen3):
    """After the prompt's prefill, an admission of 2 rows into 3 free slots: slots 0 and 1 take rows
    0 and 1 (length 1, their first token, live), slot 2 stays free; each taken slot's first own page
    is a fresh copy of the prompt's partial last page (7 tokens: page 1 holds 3), so its tokens
    continue there and the shared page is never written."""
    prompts = random_prompts(3, lengths=(7, 3))
    engine, weights, sampling, state = _empty_engine(qwen3, prompts, slots=3)
    state = _stage["prefill"](engine, weights, sampling, state, jnp.asarray([0]), jnp.asarray([1]), 0, 1)
    top = int(state.free.top[0])
    admitted = admission(state)
    np.testing.assert_array_equal(np.asarray(admitted.count), [3])  # every free slot, rows waiting
    state = _stage["insert"](engine, state, Admission(admitted.free_slot, jnp.asarray([2], jnp.int32)))
    slots = state.slots
    np.testing.assert_array_equal(np.asarray(slots.row[0]), [0, 1, -1])
    np.testing.assert_array_equal(np.asarray(slots.length[0]), [1, 1, 0])
    np.testing.assert_array_equal(np.asarray(slots.live[0]), [True, True, False])
    np.testing.assert_array_equal(np.asarray(slots.held[0]), [True, True, False])
    np.testing.assert_array_equal(np.asarray(slots.token[0, :2]), np.asarray(state.out.tokens[0, :2, 0]))
    assert int(state.next_row[0]) == 2 and int(state.free.top[0]) == top - 2
    copies = np.asarray(slots.pages[0, :2, 0])
    shared = int(state.entries.pages[0, 0, 1])
    assert len({*copies, shared, 0}) == 4
    for layer_pool in state.pool:
        for copy in copies:
            np.testing.assert_array_equal(np.asarray(layer_pool[0, copy]), np.asarray(layer_pool[0, shared]))


def test_decode_step_feeds_each_live_slot_its_last_token_and_samples_the_forwards_next_token(qwen3):
    """Two steps after an admission of the prompt's 3 rows (7 prompt tokens, pages of 4): each step
    gives the training forward's greedy next token after the prompt and the row's tokens so far,
    with its log-probability; the first step's fed token fills the copied page (no page taken), the
    second's starts a new one (one page a slot)."""
    prompts = random_prompts(3, lengths=(7, 3))
    engine, weights, sampling, state = _empty_engine(qwen3, prompts, slots=3)
    state = _stage["prefill"](engine, weights, sampling, state, jnp.asarray([0]), jnp.asarray([1]), 0, 1)
    state = _stage["insert"](engine, state, admission(state))
    tokens = list(prompts[0]) + [int(state.out.tokens[0, 0, 0])]
    for step, pages_taken in ((1, 0), (2, 3)):
        top = int(state.free.top[0])
        state = _stage["decode_step"](engine, weights, sampling, state)
        logits = _next_token_logits(qwen3, tokens)
        out = state.out
        np.testing.assert_array_equal(np.asarray(out.tokens[0, :3, step]), [np.argmax(logits)] * 3)
        np.testing.assert_allclose(np.asarray(out.logprobs[0, :3, step]), _log_softmax(logits).max(), atol=1e-4)
        np.testing.assert_array_equal(np.asarray(state.slots.length[0]), [step + 1] * 3)
        assert int(state.free.top[0]) == top - pages_taken
        tokens.append(int(np.argmax(logits)))
    own = np.asarray(state.slots.pages[0, :, :2])
    assert len(set(own.ravel()) | {0}) == 7  # two own pages a slot, all distinct


def test_decode_burst_runs_at_most_burst_steps_and_stops_a_row_at_its_budget(qwen3):
    """Bursts of 3 steps over 3 admitted rows with budgets 2, 8, 8: row 0 stops after 2 tokens (no
    longer live, still holding its pages until retired), the others advance by the burst."""
    prompts = random_prompts(3, lengths=(7, 3))
    engine, weights, sampling, state = _empty_engine(qwen3, prompts, slots=3, budgets=[2, 8, 8, 8, 8, 8])
    state = _stage["prefill"](engine, weights, sampling, state, jnp.asarray([0]), jnp.asarray([1]), 0, 1)
    state = _stage["insert"](engine, state, admission(state))
    state = _stage["decode_burst"](engine, weights, sampling, state)
    np.testing.assert_array_equal(np.asarray(state.slots.length[0]), [2, 4, 4])
    np.testing.assert_array_equal(np.asarray(state.slots.live[0]), [False, True, True])
    np.testing.assert_array_equal(np.asarray(state.slots.held[0]), [True, True, True])
    np.testing.assert_array_equal(np.asarray(state.out.length[0, :3]), [2, 4, 4])


@pytest.mark.xla_default_opt  # bit-equality of two programs (tests/conftest.py)
def test_refill_retires_finished_slots_admits_waiting_rows_and_every_page_comes_back(qwen3):
    """Refills and bursts by hand over 2 prompts x 3 rows on 3 slots (budgets 2, 8, ...): the first
    refill prefills prompt 0 and admits its rows; after a burst, the next retires row 0's slot and
    gives it row 3, prefilling prompt 1 (whose later rows wait, their first tokens drawn); run to
    the end, the rows are `continuous_program`'s, and after a last retire every page is free."""
    prompts = random_prompts(3, lengths=(7, 3))
    budgets = [2, 8, 8, 8, 5, 8]
    engine, weights, sampling, state = _empty_engine(qwen3, prompts, slots=3, budgets=budgets)
    state = _stage["refill"](engine, weights, sampling, state)
    np.testing.assert_array_equal(np.asarray(state.slots.row[0]), [0, 1, 2])
    state = _stage["refill"](engine, weights, sampling, _stage["decode_burst"](engine, weights, sampling, state))
    np.testing.assert_array_equal(np.asarray(state.slots.row[0]), [3, 1, 2])
    assert int(state.next_row[0]) == 4
    np.testing.assert_array_equal(np.asarray(state.out.length[0, 3:]), [1, 1, 1])  # prompt 1 prefilled
    entry_of = np.asarray(state.entries.of_prompt[0])
    np.testing.assert_array_equal(np.asarray(state.entries.refs[0])[entry_of], [2, 3])
    for _ in range(10):
        if not (np.asarray(state.slots.live).any() or int(state.next_row[0]) < int(state.end[0])):
            break
        state = _stage["refill"](engine, weights, sampling, _stage["decode_burst"](engine, weights, sampling, state))
    state = _stage["retire"](state, PAGE_STAGES)
    free = state.free
    assert int(free.top[0]) == engine.pool_pages - 1
    assert sorted(np.asarray(free.stack[0, :engine.pool_pages - 1]).tolist()) == list(range(1, engine.pool_pages))
    padded = left_pad_prompts(prompts, pad_token_id=PAD, length=T_STAGES, num_rows=2)
    want = continuous_program(weights, padded.tokens, padded.mask, padded.row_valid, jax.random.key(0), np.int32(0),
                              np.float32(1.0), np.float32(1.0), np.asarray([-1], np.int32), np.int32(PAD),
                              np.asarray(budgets, np.int32), spec=engine.spec)
    got = rows_of_half(engine, state, 0)
    for name in ("response_tokens", "lengths", "logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


def assert_routes_are_the_forwards(rollout, graphdef, state, config):
    """A rollout's recorded routes (uint8 [N, R, L, k], prompt routes [P, T, L, k], row n's prompt n // G)
    are the forward's expert ids over each row's prompt + response: every real prompt token's, and
    the response tokens' fed back (all but the last), 0 elsewhere; they differ from token to token."""
    rows, steps = rollout.response_tokens.shape
    group = rows // rollout.prompt_routes.shape[0]
    routes, prompt_routes = np.asarray(rollout.routes), np.asarray(rollout.prompt_routes)
    assert routes.shape == (rows, steps, config.num_layers, config.num_experts_per_tok) and routes.dtype == np.uint8
    width = rollout.prompt_tokens.shape[1]  # the prompt bucket
    assert prompt_routes.shape == (rows // group, width, config.num_layers, config.num_experts_per_tok)
    assert prompt_routes.dtype == np.uint8
    tokens = jnp.concatenate([rollout.prompt_tokens, rollout.response_tokens], axis=1)
    mask = jnp.concatenate([rollout.prompt_mask, rollout.response_mask], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    _, expected = forward(graphdef, state, tokens, positions=positions, attention_mask=mask, return_routes=True)
    expected = np.asarray(expected)
    prompt_mask, lengths = np.asarray(rollout.prompt_mask) > 0, np.asarray(rollout.lengths)
    for n in range(rows):
        real = prompt_mask[n]
        np.testing.assert_array_equal(prompt_routes[n // group][real], expected[n, :width][real],
                                      err_msg=f"prompt of row {n}")
        assert np.all(prompt_routes[n // group][~real] == 0)
        fed = lengths[n] - 1  # the last token is never fed
        np.testing.assert_array_equal(routes[n, :fed], expected[n, width:width + fed], err_msg=f"row {n}")
        assert np.all(routes[n, fed:] == 0)
    assert len(np.unique(expected.reshape(-1, config.num_experts_per_tok), axis=0)) > 4


def test_recorded_routes_are_the_forwards_expert_ids_of_every_prompt_and_fed_token(tmp_path_factory, key):
    """A tiny Qwen3-MoE, greedy, 3 prompts x 2 rows on 4 slots (rows admitted as others finish),
    pages of 4 tokens, per-row budgets: the prompt routes and the response routes (token t's at t,
    for the tokens fed back) are the forward's expert ids over prompt + response, 0 elsewhere;
    recording leaves the rollout as it was."""
    from tests.sampling.conftest import load_family

    _, config, graphdef, state = load_family("qwen3_moe", tmp_path_factory)
    prompts = random_prompts(3, lengths=(6, 2, 9))
    budgets = [7, 3, 1, 7, 5, 6]
    run = lambda record: generate(graphdef, state, prompts, num_samples=2, max_new_tokens=7, greedy=True,
                                  eos_token_ids=[], pad_token_id=PAD, rng=key, slots=4, kv_page_size=4,
                                  decode_burst=3, row_max_new_tokens=budgets, record_routes=record)
    plain, rollout = run(False), run(True)
    assert plain.routes is None and plain.prompt_routes is None
    assert_same_rows(rollout, plain)
    assert_routes_are_the_forwards(rollout, graphdef, state, config)
    np.testing.assert_array_equal(np.asarray(rollout.lengths), budgets)
    with pytest.raises(ValueError, match="record_routes: routes are recorded .* by the continuous engine"):
        generate(graphdef, state, prompts, num_samples=2, max_new_tokens=7, eos_token_ids=[], pad_token_id=PAD,
                 rng=key, engine="static", record_routes=True)
