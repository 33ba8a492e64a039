"""The continuous sampler: S slots over a paged KV cache, refilled from a queue of prompts, in one jit.

    while rows remain:                                  (one lax.while_loop)
        retire finished slots (their pages back to the pool)
        give each free slot the next waiting row         (in row order; a prompt is prefilled at the
                                                          prompt bucket when its first row is admitted)
        run up to `burst` decode steps over the S slots  (each slot: its own row, length, position)

Row n answers prompt n // G and draws its uniforms from (rng, n) (`filters.row_uniforms`), so it
samples what the static engine (`decode_loop.sample_program`) samples for row n, whichever slot
runs it and when; tokens and log-probs are written by row id into the same `ProgramOutput`.

A prompt's KV is prefilled once into pool pages that its G rows read (`paged_cache`), and the
first tokens of all G rows are drawn then (its later rows, admitted when slots free up, start
from them); the prompt's pages go back when its last row finishes. A slot writes its own tokens' KV into pages taken as
it grows and attends over its live pages only. With a mesh, the rows are split into D
data-parallel shards (contiguous prompt ranges, as the static engine splits them), each with its
own slots, pool and queue; weights and KV heads are split over "tensor".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decode import DecodeBackend, FusedLayer, _lm_head, prefill_kv
from jaxrl4llm.models.layers.decoder import decoder_layer
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.sampling.decode_loop import ProgramOutput
from jaxrl4llm.sampling.decode_mesh import vocab_shards
from jaxrl4llm.sampling.filters import row_uniforms, sample_tokens
from jaxrl4llm.kernels.backend import CpuBackend
from jaxrl4llm.kernels.decode_attention import supports as kernel_supports
from jaxrl4llm.kernels.paged_attention import paged_attention as cpu_paged_attention
from jaxrl4llm.sampling.gpu_paged_attention import gpu_kernel_supports, gpu_paged_attention, is_gpu
from jaxrl4llm.sampling.paged_cache import (POOL_AXES, TRASH_PAGE, FreePages, copy_pages, empty_free_pages, empty_pool,
                                            kernel_paged_attention, paged_attention, pool_pages, pop_pages,
                                            push_pages, write_tokens)

PAGE_SIZE = 16
PAGES_PER_CHUNK = 8
BURST = 16


def prefill_batch(prompts: int, slots: int, samples: int, prefill_prompts: int | None = None) -> tuple[int, bool]:
    """How a shard of `prompts` prompts on `slots` slots (G = `samples` rows a prompt) prefills the
    prompts a refill admits: (A, choose). A = min(prompts, prefill_prompts or slots // G), at least 1:
    the prompts of one batched round. choose: whether each refill picks at run time between rounds
    of A prompts (when it admits more than A / 2) and rounds of one (two loops one after the other,
    one with no trips); not when A is every prompt (one admission takes them all) or 1. `plan`
    prices the two loops with this rule."""
    a = max(1, min(prompts, prefill_prompts or slots // samples))
    return a, not (a == prompts or a == 1)


class Slots(NamedTuple):
    """Per shard and slot [D, S]: row (local row id, -1 = none), entry (its prompt's entry), length
    (response tokens so far), token (the last one), live (still decoding), held (holds pages:
    live, or finished and not yet retired); pages [D, S, Rp] its response pages."""

    row: jax.Array
    entry: jax.Array
    length: jax.Array
    token: jax.Array
    live: jax.Array
    held: jax.Array
    pages: jax.Array


class Entries(NamedTuple):
    """Prompts in the pool, per shard [D, Q]: pages [D, Q, Tp], length (real prompt tokens), refs
    (its rows not yet retired: admitted or waiting); of_prompt [D, Pd] the entry of each prompt."""

    pages: jax.Array
    length: jax.Array
    refs: jax.Array
    of_prompt: jax.Array


class Outputs(NamedTuple):
    """Per shard and buffer row: tokens, logprobs, logprobs_untruncated [D, H*N_d, R]; length, eos_seen,
    segment (the segment that prefilled the row's prompt and drew its first token; -1 before),
    split (its first token sampled by the next segment's weights; R if none) [D, H*N_d]."""

    tokens: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    length: jax.Array
    eos_seen: jax.Array
    segment: jax.Array
    split: jax.Array


class Queue(NamedTuple):
    """The rows the engine admits, per shard, in H halves of P_d prompts (N_d = P_d*G rows) each:
    tokens, mask [D, H*P_d, T]; uniforms [D, H*N_d, R] ([D, 1, 1] when greedy); budget [D, H*N_d]."""

    tokens: jax.Array
    mask: jax.Array
    uniforms: jax.Array
    budget: jax.Array


class EngineState(NamedTuple):
    """Row m of a shard's stream (rows in admission order) lives in buffer row m % (H*N_d) and
    answers buffer prompt (m // G) % (H*P_d): H = 1 for one call's rows, 2 for partial rollouts."""

    slots: Slots
    entries: Entries
    free: FreePages
    next_row: jax.Array  # [D] the shard's next waiting row (stream index)
    end: jax.Array  # [D] rows before it may be admitted (stream index)
    pool: list  # L arrays [D, pages, page, 2 KVH, Dh] (`paged_cache`)
    out: Outputs
    queue: Queue
    segment: jax.Array  # [] the current segment (partial rollouts: one per weight version)
    done: jax.Array  # [] rollouts handed out (partial rollouts)


def _take(a, idx):
    """Per shard a[d][idx[d]]: a [D, X, ...], idx [D, ...] int32 (clipped) -> [D, ..., ...]."""
    return jax.vmap(lambda x, i: x[jnp.clip(i, 0, x.shape[0] - 1)])(a, idx)


def _put(a, idx, value):
    """Per shard a[d][idx[d]] = value[d]; out-of-range idx (e.g. -1 mapped to X) is dropped."""
    size = a.shape[1]
    idx = jnp.where((idx >= 0) & (idx < size), idx, size)
    return jax.vmap(lambda x, i, v: x.at[i].set(v.astype(x.dtype), mode="drop"))(a, idx, value)


def _put2(a, i, j, value):
    """Per shard a[d][i[d], j[d]] = value[d] (i out of range: dropped)."""
    size = a.shape[1]
    i = jnp.where((i >= 0) & (i < size), i, size)
    return jax.vmap(lambda x, r, c, v: x.at[r, c].set(v.astype(x.dtype), mode="drop"))(a, i, j, value)


def _record(out: Outputs, rows, column, sample, live, eos_ids, pad_id) -> tuple[Outputs, jax.Array]:
    """Write the sample of each live slot at (row, column): rows, column, live [D, S]. Returns (out, is_eos)."""
    token = jnp.where(live, sample.tokens, pad_id).astype(jnp.int32)
    is_eos = jnp.any(token[..., None] == eos_ids, axis=-1) & live
    rows = jnp.where(live, rows, -1)
    out = out._replace(
        tokens=_put2(out.tokens, rows, column, token),
        logprobs=_put2(out.logprobs, rows, column, sample.logprob),
        logprobs_untruncated=_put2(out.logprobs_untruncated, rows, column, sample.logprob_untruncated),
        length=_put(out.length, rows, column + 1),
        eos_seen=_put(out.eos_seen, rows, is_eos),
    )
    return out, is_eos


def _retire(state: EngineState, page_size: int) -> EngineState:
    """Finished slots (held, not live) give back their response pages; prompts without rows their pages."""
    slots, entries = state.slots, state.entries
    done = slots.held & ~slots.live
    # own pages taken: the prompt's partial last page (copied at admission) and tokens 0..length-2 fed back
    prompt_len = _take(entries.length, slots.entry)
    used = -(-(prompt_len % page_size + slots.length - 1) // page_size)
    rp = slots.pages.shape[-1]
    release = done[..., None] & (jnp.arange(rp) < used[..., None])
    d, s = done.shape
    free = push_pages(state.free, slots.pages.reshape(d, -1), release.reshape(d, -1))
    q = entries.refs.shape[1]
    drop = jax.vmap(lambda e, m: jnp.zeros((q,), jnp.int32).at[jnp.where(m, e, q)].add(1, mode="drop"))(slots.entry, done)
    refs = entries.refs - drop
    gone = (entries.refs > 0) & (refs == 0)
    tp = entries.pages.shape[-1]
    prompt_used = -(-entries.length // page_size)
    release = gone[..., None] & (jnp.arange(tp) < prompt_used[..., None])
    free = push_pages(free, entries.pages.reshape(d, -1), release.reshape(d, -1))
    return state._replace(slots=slots._replace(held=slots.held & ~done), entries=entries._replace(refs=refs), free=free)


class _Engine(NamedTuple):
    """The engine's stages for one program (built under its jit): sizes and closures."""

    empty_state: object  # (queue, end) -> EngineState
    burst_loop: object  # EngineState -> EngineState: admit, then up to `burst` decode steps
    rows_c: object  # constrain an array's leading axis to the "batch" rule
    nd: int  # rows of a shard per half
    pd: int  # prompts of a shard per half


def _engine(weights, temperature, top_p, eos_ids, pad_id, *, config: ModelConfig, num_samples: int, max_new_tokens: int,
            top_k: int, use_top_p: bool, greedy: bool, backend: DecodeBackend, use_kernels: bool, num_shards: int,
            slots: int, num_prompts: int, prompt_len: int, halves: int, page_size: int, pages_per_chunk: int,
            burst: int, prefill_prompts: int | None, attention: str) -> _Engine:
    """The stages of the continuous engine over `halves` x `num_prompts` prompts of width `prompt_len`
    (`continuous_program` documents the arguments)."""
    g, r, t = num_samples, max_new_tokens, prompt_len
    d = num_shards
    if num_prompts % d or slots % d:
        raise ValueError(f"continuous sampler: {num_prompts} prompts and {slots} slots must split over {d} shards")
    pd, sd = num_prompts // d, slots // d
    nd = pd * g
    hp, hn = halves * pd, halves * nd  # buffer prompts and rows of a shard
    kvh, hg, dh = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    cache_dtype = jnp.dtype(config.dtype)
    dtype = jnp.dtype(config.dtype)
    tp = -(-t // page_size)
    rp = -(-(page_size - 1 + max(r - 1, 1)) // page_size)  # own pages: a partial prompt page + R-1 tokens
    width = -(-(tp + rp) // pages_per_chunk) * pages_per_chunk  # logical pages of a slot, whole chunks
    q = sd + 1  # prompt entries: every prompt with a row in a slot, and one whose rows wait
    num_pages = pool_pages(sd, q, tp, rp)
    a_big, choose = prefill_batch(pd, sd, g, prefill_prompts)
    b = backend
    batch_axes, tensor_axis = (), None
    if b.mesh is not None:
        rules = dict(b.rules)
        axes = rules["batch"]
        batch_axes = tuple(a for a in ((axes,) if isinstance(axes, str) else tuple(axes or ())) if a in b.mesh.shape)
        tensor_axis = rules["kv_heads"] if isinstance(rules["kv_heads"], str) else None
    rows_c = lambda x: b.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    gpu_kernel = attention == "kernel" and is_gpu(list(b.mesh.devices.flat) if b.mesh is not None else jax.devices())
    cpu_kernel = attention == "kernel" and isinstance(b, CpuBackend) and not gpu_kernel
    if gpu_kernel and not gpu_kernel_supports(dh, cache_dtype, page_size):
        raise ValueError(f"continuous sampler: attention='kernel' on GPU needs a power-of-two head_dim >= 16 (this "
                         f"model's: {dh}), a power-of-two page size (kv_page_size: {page_size}) and a bfloat16 or "
                         f"float16 model ({cache_dtype}); use paged_attention='xla'")
    if cpu_kernel and not (b.kernels and kernel_supports(config.dtype, config.dtype)):
        raise ValueError("continuous sampler: attention='kernel' on CPU needs the CPU kernels (one device, a "
                         "bfloat16 or float32 model)")
    sample = functools.partial(sample_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               use_top_p=use_top_p, greedy=greedy, use_kernels=use_kernels,
                               shards=vocab_shards(b.mesh, b.rules))  # top-k per vocab shard + one gather
    buffer_row = lambda m: jnp.where(m >= 0, m % hn, -1)  # a stream row's buffer row (-1: none)

    def draw(queue: Queue, logits, rows, column):
        """Sample [D, M] slots: logits [D, M, V]; the uniforms of buffer rows `rows` at `column`."""
        m = rows.shape[1]
        u = None if greedy else _take(queue.uniforms, rows)  # [D, M, R]
        u = None if greedy else jnp.take_along_axis(u, jnp.broadcast_to(column, (d, m))[..., None], axis=2)
        flat = sample(logits.reshape(d * m, -1), None, uniform=None if greedy else u.reshape(d * m, 1))
        return jax.tree.map(lambda x: x.reshape(d, m), flat)

    def prefill_round(i, state: EngineState, first_prompt, count, a: int) -> EngineState:
        """Prefill stream prompts first_prompt + i*A .. + A-1 of each shard (those < first_prompt + count [D]):
        their KV into fresh pages, an entry each, and the first tokens of all their G rows."""
        en, out = state.entries, state.out
        k = i * a + jnp.arange(a, dtype=jnp.int32)[None, :]  # [1, A]
        valid = k < count[:, None]  # [D, A]
        prompt = (first_prompt[:, None] + k) % hp  # buffer prompts
        toks, msk = _take(state.queue.tokens, prompt), _take(state.queue.mask, prompt)  # [D, A, T]
        logits, ks, vs = prefill_kv(weights, config, rows_c(toks.reshape(d * a, t)), rows_c(msk.reshape(d * a, t)),
                                    backend=b, cache_dtype=cache_dtype)
        length = jnp.sum(msk, axis=-1)  # [D, A]
        need = valid[..., None] & (jnp.arange(tp) < -(-length // page_size)[..., None])  # [D, A, Tp]
        free, ids = pop_pages(state.free, need.reshape(d, -1))
        ids = ids.reshape(d, a, tp)
        pos = jnp.arange(tp * page_size)  # logical prompt token i sits at padded position T - L + i
        real = valid[..., None] & (pos < length[..., None])  # [D, A, Tp*page]
        src = jnp.clip(t - length[..., None] + pos, 0, t - 1)
        dst = jnp.where(real, jnp.take_along_axis(ids, jnp.broadcast_to(pos // page_size, real.shape), 2), TRASH_PAGE)
        offset = jnp.broadcast_to(pos % page_size, real.shape)

        def real_tokens(x):  # x [D*A, T, KVH, Dh] -> the prompts' real tokens [D, A*Tp*page, KVH, Dh]
            return jnp.take_along_axis(x.reshape(d, a, t, kvh, dh), src[..., None, None], axis=2).reshape(d, -1, kvh, dh)

        pool = [write_tokens(p, dst.reshape(d, -1), offset.reshape(d, -1), real_tokens(k), real_tokens(v), cache_dtype)
                for p, k, v in zip(state.pool, ks, vs)]
        # the i-th new prompt takes the i-th free entry
        free_entry = en.refs == 0
        rank = jnp.cumsum(free_entry, axis=1, dtype=jnp.int32) - 1
        nth_free = jax.vmap(lambda fe, r: jnp.zeros((q,), jnp.int32).at[jnp.where(fe, r, q)].set(
            jnp.arange(q, dtype=jnp.int32), mode="drop"))(free_entry, rank)  # [D, Q]
        entry = jnp.where(valid, jnp.take_along_axis(nth_free, jnp.broadcast_to(jnp.arange(a), valid.shape), 1), -1)
        en = Entries(_put(en.pages, entry, ids), _put(en.length, entry, length),
                     _put(en.refs, entry, jnp.full(entry.shape, g, jnp.int32)),
                     _put(en.of_prompt, jnp.where(valid, prompt, -1), entry))
        # first tokens of every row of these prompts (rows admitted now or later read them from `out`)
        rows = jnp.where(valid[..., None], prompt[..., None] * g + jnp.arange(g), -1).reshape(d, a * g)
        first = draw(state.queue, jnp.repeat(logits.reshape(d, a, -1), g, axis=1), jnp.maximum(rows, 0),
                     jnp.zeros((), jnp.int32))
        out, _ = _record(out, rows, jnp.zeros_like(rows), first, rows >= 0, eos_ids, pad_id)
        out = out._replace(segment=_put(out.segment, rows, jnp.broadcast_to(state.segment, rows.shape)))
        return state._replace(entries=en, free=free, pool=pool, out=out)

    def admit(state: EngineState) -> EngineState:
        """Retire finished slots, then give each free slot the next waiting row (in stream order),
        prefilling the prompts whose first row is admitted, A at a time."""
        state = _retire(state, page_size)
        sl = state.slots
        free_slot = ~sl.held
        count = jnp.minimum(jnp.sum(free_slot, axis=1, dtype=jnp.int32), state.end - state.next_row)  # [D]
        first_prompt = -(-state.next_row // g)  # prompts before it are prefilled
        new_prompts = -(-(state.next_row + count) // g) - first_prompt
        def prefill(s, a, rounds):
            return jax.lax.fori_loop(0, rounds, lambda i, s: prefill_round(i, s, first_prompt, new_prompts, a), s)

        most = jnp.max(new_prompts)
        if not choose:  # every row has a slot (one admission: A = all prompts), or A = 1
            state = prefill(state, a_big, -(-most // a_big))
        else:  # A at a time when more than A / 2 prompts come in, else one at a time: one of the two loops runs.
            # Two loops in a row, not a lax.cond between them: XLA:TPU copied the page pool into and out
            # of the loop inside each branch on every round, holding it twice (docs/sampling.md)
            batched = 2 * most > a_big
            state = prefill(state, a_big, jnp.where(batched, -(-most // a_big), 0))
            state = prefill(state, 1, jnp.where(batched, 0, most))
        out, en = state.out, state.entries
        rank = jnp.cumsum(free_slot, axis=1, dtype=jnp.int32) - 1
        mine = free_slot & (rank < count[:, None])  # [D, S]
        row = jnp.where(mine, state.next_row[:, None] + rank, -1)
        at = jnp.maximum(buffer_row(row), 0)
        token = jnp.take_along_axis(out.tokens[:, :, 0], at, axis=1)
        done = _take(out.eos_seen, at) | (_take(state.queue.budget, at) <= 1)
        entry = jnp.where(mine, _take(en.of_prompt, at // g), sl.entry)
        # the prompt's partial last page is copied into the slot's first own page (its tokens then
        # continue there: a slot's tokens stay contiguous, and shared pages are never written)
        prompt_len = _take(en.length, entry)
        partial = mine & (prompt_len % page_size != 0)
        free, copy = pop_pages(state.free, partial)
        source = jnp.where(partial, jnp.take_along_axis(_take(en.pages, entry), (prompt_len // page_size)[..., None]
                                                        .clip(0, tp - 1), axis=2)[..., 0], TRASH_PAGE)
        pages = jnp.where(partial[..., None] & (jnp.arange(rp) == 0), copy[..., None], sl.pages)
        sl = Slots(row=jnp.where(mine, row, sl.row), entry=entry,
                   length=jnp.where(mine, 1, sl.length), token=jnp.where(mine, token, sl.token),
                   live=jnp.where(mine, ~done, sl.live), held=sl.held | mine, pages=pages)
        return state._replace(slots=sl, next_row=state.next_row + count, free=free,
                              pool=[copy_pages(p, copy, source) for p in state.pool])

    def step(state: EngineState) -> EngineState:
        """One decode step of every live slot: feed its last token, sample the next."""
        sl, en = state.slots, state.entries
        j = sl.length - 1  # response index of the token fed back
        prompt_len = _take(en.length, sl.entry)  # [D, S]
        shared = prompt_len // page_size  # the prompt's full pages, read in place
        own = prompt_len % page_size + j  # index of the fed token among the slot's own pages' tokens
        need = sl.live & (own % page_size == 0)
        free, new = pop_pages(state.free, need)
        slot_ids = jnp.where(need, jnp.arange(sd, dtype=jnp.int32)[None], -1)
        own_page = jnp.clip(own // page_size, 0, rp - 1)
        pages = _put2(sl.pages, slot_ids, own_page, new)
        write_page = jnp.where(sl.live, jnp.take_along_axis(pages, own_page[..., None], axis=2)[..., 0], TRASH_PAGE)
        write_offset = jnp.where(sl.live, own % page_size, 0)
        # a slot's tokens are contiguous over its logical pages: the prompt's full pages, then its own
        logical = jnp.broadcast_to(jnp.arange(width)[None, None], (d, sd, width))
        in_prompt = logical < shared[..., None]
        from_prompt = jnp.take_along_axis(_take(en.pages, sl.entry), jnp.clip(logical, 0, tp - 1), axis=2)
        from_own = jnp.take_along_axis(pages, jnp.clip(logical - shared[..., None], 0, rp - 1), axis=2)
        table = jnp.where(in_prompt, from_prompt, from_own)
        kv_len = jnp.where(sl.live, prompt_len + sl.length, 0)  # the fed token included
        counts = jnp.clip(kv_len[..., None] - logical * page_size, 0, page_size)
        num_chunks = -(-jnp.max(-(-kv_len // page_size)) // pages_per_chunk)

        cos, sin = rope_tables(config, rows_c((prompt_len + j).reshape(d * sd, 1)))
        x = b.embed(weights["embed"], rows_c(sl.token.reshape(d * sd, 1)))  # [M, 1, D]
        pools = []
        for i, p in enumerate(weights["layers"]):
            def attend(q, k, v, i=i):
                q = q.reshape(d, sd, kvh, hg, dh)
                if cpu_kernel:  # the new token written and the live pages read in place, in C++
                    out, pool = cpu_paged_attention(q, state.pool[i], k.reshape(d, sd, kvh, dh),
                                                    v.reshape(d, sd, kvh, dh), write_page, write_offset, table, kv_len)
                    return out.reshape(d * sd, 1, kvh * hg, dh), pool
                pool = write_tokens(state.pool[i], write_page, write_offset, k.reshape(d, sd, kvh, dh),
                                    v.reshape(d, sd, kvh, dh), cache_dtype)
                pool = b.constrain(pool, POOL_AXES)
                if gpu_kernel:
                    out = gpu_paged_attention(q, pool, table, kv_len, mesh=b.mesh, batch_axes=batch_axes,
                                              tensor_axis=tensor_axis)
                elif attention == "kernel":
                    out = kernel_paged_attention(q, pool, table, kv_len, mesh=b.mesh, batch_axes=batch_axes,
                                                 tensor_axis=tensor_axis)
                else:
                    out = paged_attention(q, pool, table, counts, num_chunks, pages_per_chunk=pages_per_chunk,
                                          dtype=dtype, value_dtype=cache_dtype)
                return out.reshape(d * sd, 1, kvh * hg, dh), pool

            x, pool = decoder_layer(FusedLayer(p, config, b), x, cos, sin, attend)
            pools.append(pool)
        logits = _lm_head(weights, config, b, x[:, 0]).reshape(d, sd, -1)
        rows = buffer_row(sl.row)
        drawn = draw(state.queue, logits, jnp.maximum(rows, 0), sl.length)
        out, is_eos = _record(state.out, rows, sl.length, drawn, sl.live, eos_ids, pad_id)
        length = sl.length + sl.live.astype(jnp.int32)
        done = is_eos | (length >= _take(state.queue.budget, jnp.maximum(rows, 0)))
        sl = sl._replace(length=length, token=jnp.where(sl.live, drawn.tokens, sl.token), live=sl.live & ~done,
                         pages=pages)
        return state._replace(slots=sl, free=free, pool=pools, out=out)

    def burst_loop(state: EngineState) -> EngineState:
        state = admit(state)
        cond = lambda c: (c[0] < burst) & jnp.any(c[1].slots.live)
        body = lambda c: (c[0] + 1, step(c[1]))
        return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]

    zeros = lambda shape, dtype, fill=0: rows_c(jnp.full(shape, fill, dtype))
    bits = isinstance(b, CpuBackend)
    pool = lambda: b.constrain(empty_pool((d, num_pages, page_size, 2 * kvh, dh), cache_dtype, bits=bits), POOL_AXES)

    def empty_state(queue: Queue, end) -> EngineState:
        return EngineState(
            slots=Slots(row=zeros((d, sd), jnp.int32, -1), entry=zeros((d, sd), jnp.int32),
                        length=zeros((d, sd), jnp.int32), token=zeros((d, sd), jnp.int32), live=zeros((d, sd), bool),
                        held=zeros((d, sd), bool), pages=zeros((d, sd, rp), jnp.int32)),
            entries=Entries(zeros((d, q, tp), jnp.int32), zeros((d, q), jnp.int32), zeros((d, q), jnp.int32),
                            zeros((d, hp), jnp.int32)),
            free=empty_free_pages(d, num_pages),
            next_row=jnp.zeros((d,), jnp.int32),
            end=end,
            pool=[pool() for _ in range(config.num_layers)],
            out=Outputs(zeros((d, hn, r), jnp.int32) + pad_id, zeros((d, hn, r), jnp.float32),
                        zeros((d, hn, r), jnp.float32), zeros((d, hn), jnp.int32), zeros((d, hn), bool),
                        zeros((d, hn), jnp.int32, -1), zeros((d, hn), jnp.int32, r)),
            queue=queue,
            segment=jnp.zeros((), jnp.int32),
            done=jnp.zeros((), jnp.int32),
        )

    return _Engine(empty_state, burst_loop, rows_c, nd, pd)


def _rows_of_half(eng: _Engine, state: EngineState, half, num_samples: int, max_new_tokens: int) -> ProgramOutput:
    """The rows of buffer half `half` (traced) as one call's ProgramOutput ([N, ...], shards in order)."""
    d = state.next_row.shape[0]
    nd, pd = eng.nd, eng.pd
    take = lambda x, size: jax.lax.dynamic_slice_in_dim(x, half * size, size, axis=1)
    unshard = lambda x: eng.rows_c(x.reshape((d * x.shape[1],) + x.shape[2:]))
    out, queue = state.out, state.queue
    length = unshard(take(out.length, nd))
    steps = jnp.arange(max_new_tokens, dtype=jnp.int32)
    prompts = lambda x: eng.rows_c(jnp.repeat(unshard(take(x, pd)), num_samples, axis=0))
    return ProgramOutput(
        prompt_tokens=prompts(queue.tokens),
        prompt_mask=prompts(queue.mask).astype(jnp.float32),
        response_tokens=unshard(take(out.tokens, nd)),
        response_mask=(steps[None, :] < length[:, None]).astype(jnp.float32),
        logprobs=unshard(take(out.logprobs, nd)),
        logprobs_untruncated=unshard(take(out.logprobs_untruncated, nd)),
        lengths=length,
        truncated=~unshard(take(out.eos_seen, nd)),
    )


_STATIC = ("config", "num_samples", "max_new_tokens", "top_k", "use_top_p", "greedy", "backend", "use_kernels",
           "num_shards", "slots", "page_size", "pages_per_chunk", "burst", "prefill_prompts", "attention")


@functools.partial(jax.jit, static_argnames=_STATIC)
def continuous_program(weights, prompt_tokens, prompt_mask, row_valid, rng, first_row, temperature, top_p, eos_ids,
                       pad_id, row_budget, *, config: ModelConfig, num_samples: int, max_new_tokens: int, top_k: int,
                       use_top_p: bool, greedy: bool, backend: DecodeBackend, use_kernels: bool = False,
                       num_shards: int = 1, slots: int, page_size: int = PAGE_SIZE,
                       pages_per_chunk: int = PAGES_PER_CHUNK, burst: int = BURST,
                       prefill_prompts: int | None = None, attention: str = "xla") -> ProgramOutput:
    """`decode_loop.sample_program` (same arguments and output, rows for rows) on `slots` slots.

    Args (beyond sample_program's):
      row_budget [N] int32: row n stops after row_budget[n] tokens (<= max_new_tokens; truncated
        unless its last token is an EOS): per-row response budgets, e.g. a benchmark's forced lengths.
      num_shards: D, data-parallel shards (the mesh's "batch" size; P and `slots` multiples of D).
      slots: S, rows decoded at once over all shards (a multiple of D).
      page_size: tokens per KV page; pages_per_chunk: pages read per attention chunk.
      burst: decode steps between two refills.
      prefill_prompts: A, prompts per shard prefilled in one batch when a refill admits more than
        A / 2 prompts (the first admission, which fills every slot), else one at a time (a refill
        that needs one prompt does not pay for A); None: S/D // G, the prompts that fill the slots.
      attention: "xla" (`paged_cache.paged_attention`, any platform) or "kernel": on TPU the ragged
        paged attention kernel (`paged_cache.kernel_paged_attention`), on GPU the Pallas/Triton paged
        attention kernel (`gpu_paged_attention`), on CPU the C++ kernel (`kernels.paged_attention`,
        which also writes the new token in place; a CpuBackend with kernels).
    Returns: ProgramOutput with N = P * num_samples rows, R = max_new_tokens.
    """
    g, r, d = num_samples, max_new_tokens, num_shards
    num_prompts, t = prompt_tokens.shape
    eng = _engine(weights, temperature, top_p, eos_ids, pad_id, config=config, num_samples=g, max_new_tokens=r,
                  top_k=top_k, use_top_p=use_top_p, greedy=greedy, backend=backend, use_kernels=use_kernels,
                  num_shards=d, slots=slots, num_prompts=num_prompts, prompt_len=t, halves=1, page_size=page_size,
                  pages_per_chunk=pages_per_chunk, burst=burst, prefill_prompts=prefill_prompts, attention=attention)
    shard = lambda x: eng.rows_c(x.reshape((d, -1) + x.shape[1:]))
    num_real = jnp.sum(shard(row_valid.astype(jnp.int32)), axis=1)  # [D] (padding prompts come last)
    queue = Queue(tokens=shard(prompt_tokens), mask=shard(prompt_mask.astype(jnp.int32)),  # [D, Pd, T]
                  uniforms=jnp.zeros((d, 1, 1), jnp.float32) if greedy else shard(row_uniforms(rng, first_row,
                                                                                               num_prompts * g, r)),
                  budget=shard(jnp.minimum(row_budget.astype(jnp.int32), r)))  # [D, Nd]
    state = eng.empty_state(queue, num_real * g)
    more = lambda s: jnp.any(s.slots.live) | jnp.any(s.next_row < s.end)
    state = jax.lax.while_loop(more, eng.burst_loop, state)
    return _rows_of_half(eng, state, 0, g, r)


# ------------------------------------------------------------------ partial rollouts (sampling/partial.py)
@functools.partial(jax.jit, static_argnames=_STATIC + ("num_prompts", "prompt_len"))
def partial_init(pad_id, *, num_prompts: int, prompt_len: int, config: ModelConfig, num_samples: int,
                 max_new_tokens: int, top_k: int, use_top_p: bool, greedy: bool, backend: DecodeBackend,
                 use_kernels: bool = False, num_shards: int = 1, slots: int, page_size: int = PAGE_SIZE,
                 pages_per_chunk: int = PAGES_PER_CHUNK, burst: int = BURST, prefill_prompts: int | None = None,
                 attention: str = "xla") -> EngineState:
    """An empty engine for partial rollouts: two halves of `num_prompts` prompts of width `prompt_len`
    (rollout t in half t % 2), no rows enqueued."""
    g, r, d = num_samples, max_new_tokens, num_shards
    eng = _engine(None, None, None, None, pad_id, config=config, num_samples=g, max_new_tokens=r, top_k=top_k,
                  use_top_p=use_top_p, greedy=greedy, backend=backend, use_kernels=use_kernels, num_shards=d,
                  slots=slots, num_prompts=num_prompts, prompt_len=prompt_len, halves=2, page_size=page_size,
                  pages_per_chunk=pages_per_chunk, burst=burst, prefill_prompts=prefill_prompts, attention=attention)
    zeros = lambda shape, dtype: eng.rows_c(jnp.zeros(shape, dtype))
    hp, hn = 2 * eng.pd, 2 * eng.nd
    queue = Queue(zeros((d, hp, prompt_len), jnp.int32), zeros((d, hp, prompt_len), jnp.int32),
                  jnp.zeros((d, 1, 1), jnp.float32) if greedy else zeros((d, hn, r), jnp.float32),
                  zeros((d, hn), jnp.int32))
    return eng.empty_state(queue, jnp.zeros((d,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("num_samples", "max_new_tokens", "greedy", "backend"),
                   donate_argnums=(0,))
def partial_enqueue(state: EngineState, prompt_tokens, prompt_mask, rng, row_budget, pad_id, *, num_samples: int,
                    max_new_tokens: int, greedy: bool, backend: DecodeBackend) -> EngineState:
    """Append a rollout's P prompts [P, T] (all real) to the stream: their rows become admissible
    after the rows already enqueued. Row n draws its uniforms from (rng, n) (`filters.row_uniforms`),
    as `continuous_program` with first_row 0; row_budget [P*G]. The half it takes must have been
    handed out (`partial_segment`): at most two rollouts are in the engine at a time."""
    g, r = num_samples, max_new_tokens
    d, hp = state.queue.tokens.shape[:2]
    pd, nd = hp // 2, hp // 2 * g
    rows_c = lambda x: backend.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    shard = lambda x: rows_c(x.reshape((d, -1) + x.shape[1:]))
    half = (state.end[0] // nd) % 2
    put = lambda buf, x, size: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), half * size, axis=1)
    queue = state.queue
    queue = Queue(put(queue.tokens, shard(prompt_tokens), pd), put(queue.mask, shard(prompt_mask), pd),
                  queue.uniforms if greedy else put(queue.uniforms, shard(row_uniforms(rng, 0, pd * d * g, r)), nd),
                  put(queue.budget, shard(jnp.minimum(row_budget.astype(jnp.int32), r)), nd))
    out = state.out
    fill = lambda x, value: put(x, jnp.full((d, nd) + x.shape[2:], value, x.dtype), nd)
    out = Outputs(fill(out.tokens, pad_id), fill(out.logprobs, 0), fill(out.logprobs_untruncated, 0),
                  fill(out.length, 0), fill(out.eos_seen, False), fill(out.segment, -1), fill(out.split, r))
    return state._replace(queue=queue, out=out, end=state.end + nd)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(1,))
def partial_segment(weights, state: EngineState, temperature, top_p, eos_ids, pad_id, *, config: ModelConfig,
                    num_samples: int, max_new_tokens: int, top_k: int, use_top_p: bool, greedy: bool,
                    backend: DecodeBackend, use_kernels: bool = False, num_shards: int = 1, slots: int,
                    page_size: int = PAGE_SIZE, pages_per_chunk: int = PAGES_PER_CHUNK, burst: int = BURST,
                    prefill_prompts: int | None = None,
                    attention: str = "xla") -> tuple[EngineState, ProgramOutput, jax.Array, jax.Array]:
    """One segment of partial rollouts: decode with `weights` until the oldest rollout in the engine
    is complete, admitting the next rollout's rows (if enqueued) into slots its rows free; hand the
    oldest rollout out. Rows carried in from the previous segment continue under these weights
    from where they stopped (their KV cache as the earlier weights wrote it).

    Returns (state, ProgramOutput of the rollout [N = P*G rows], segment [N], split [N]): row n's
    tokens before split[n] were drawn in segment segment[n], the rest in segment[n] + 1 (a row
    spans at most two segments: a segment ends only when its rollout is complete, and the
    next rollout is the only one it admits from).
    """
    g, r, d = num_samples, max_new_tokens, num_shards
    hp, t = state.queue.tokens.shape[1:]
    eng = _engine(weights, temperature, top_p, eos_ids, pad_id, config=config, num_samples=g, max_new_tokens=r,
                  top_k=top_k, use_top_p=use_top_p, greedy=greedy, backend=backend, use_kernels=use_kernels,
                  num_shards=d, slots=slots, num_prompts=hp // 2 * d, prompt_len=t, halves=2, page_size=page_size,
                  pages_per_chunk=pages_per_chunk, burst=burst, prefill_prompts=prefill_prompts, attention=attention)
    nd, hn = eng.nd, 2 * eng.nd
    sl, out = state.slots, state.out
    # tokens from here on are this segment's: of rows live in slots, and of rows whose first token an
    # earlier segment drew at its prompt's prefill, still waiting for a slot
    live_rows = jnp.where(sl.live, sl.row % hn, -1)
    split = _put(out.split, live_rows, sl.length)
    waiting = state.next_row[:, None] + jnp.arange(g, dtype=jnp.int32)  # [D, G]
    prefilled = (waiting < -(-state.next_row // g)[:, None] * g) & (waiting < state.end[:, None])
    split = _put(split, jnp.where(prefilled, waiting % hn, -1), jnp.ones_like(waiting))
    state = state._replace(out=out._replace(split=split))
    end_t = (state.done + 1) * nd  # the oldest rollout's rows are the stream rows before it
    more = lambda s: jnp.any(s.slots.live & (s.slots.row < end_t)) | jnp.any(s.next_row < end_t)
    state = jax.lax.while_loop(more, eng.burst_loop, state)
    half = state.done % 2
    rollout = _rows_of_half(eng, state, half, g, r)
    per_row = lambda x: eng.rows_c(jax.lax.dynamic_slice_in_dim(x, half * nd, nd, axis=1).reshape(d * nd))
    segment, split = per_row(state.out.segment), per_row(state.out.split)
    return state._replace(segment=state.segment + 1, done=state.done + 1), rollout, segment, split
