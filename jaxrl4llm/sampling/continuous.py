"""The continuous sampler: S slots over a paged KV cache, refilled from a queue of prompts, in one jit.

    while rows remain:                                  (one lax.while_loop)
        refill:  retire finished slots (their pages back to the pool)          `retire`
                 prefill the prompts of the rows it admits, A at a time        `prefill`
                 give each free slot the next waiting row (in row order)       `insert`
        decode:  up to `burst` decode steps over the S slots                   `decode_burst`, `decode_step`
                 (each slot: its own row, length, position)

The stages are pure functions of the carried `EngineState` (JetStream's prefill / insert /
generate, without the class around them); the one static argument of every jitted program is an
`EngineSpec`, which `Engine.resolve` turns into a shard's sizes for the call's prompt shapes.

Row n answers prompt n // G and draws its uniforms from (rng, n) (`filters.row_uniforms`), so it
samples what the static engine (`decode_loop.sample_program`) samples for row n, whichever slot
runs it and when; tokens and log-probs are written by row id into the same `ProgramOutput`.

A prompt's KV is prefilled once into pool pages that its G rows read (`paged_cache`), and the
first tokens of all G rows are drawn then (its later rows, admitted when slots free up, start
from them); the prompt's pages go back when its last row finishes. A slot writes its own tokens' KV into pages taken as
it grows and attends over its live pages only. With a mesh, the rows are split into D
data-parallel shards (contiguous prompt ranges, as the static engine splits them), each with its
own slots, pool and queue; weights and KV heads are split over "tensor".

With tools (`tool_init`, `tool_segment`, `tool_resume`, `tool_result`; the host loop is
`tool_rollout.run_tools`), a slot whose model tokens spell a trigger parks (`park`): it keeps its
pages and stops decoding while the others decode on; the engine runs in segments, and the host
writes the tool's observation into the row's next columns, which `decode_step` feeds as if
sampled (`forced_draw`). Without tools `EngineState.tools` is None and the programs are as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl4llm.kernels import exact
from jaxrl4llm.kernels.choice import DecodeAttention, decode_attention_choice, mesh_devices, mesh_tensor_parallel
from jaxrl4llm.kernels.paged_attention import paged_attention as cpu_paged_attention
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decode import DecodeBackend, FusedLayer, lm_head, prefill_kv
from jaxrl4llm.models.layers.decoder import decoder_layer
from jaxrl4llm.models.layers.moe import route_dtype
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.sampling.decode_backends import CpuBackend
from jaxrl4llm.sampling.decode_loop import ProgramOutput
from jaxrl4llm.sampling.decode_mesh import data_parallel_size, vocab_shards
from jaxrl4llm.sampling.filters import row_uniforms, sample_tokens
from jaxrl4llm.sampling.gpu_paged_attention import gpu_paged_attention
from jaxrl4llm.sampling.stops import ends_with_stop_sequence
from jaxrl4llm.sampling.paged_cache import (POOL_AXES, TRASH_PAGE, FreePages, as_values, copy_pages, empty_free_pages,
                                            empty_pool, gather_pages,
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What the continuous engine is: the static argument of its jitted programs (hashable).

    config: the model; backend: the decode backend (`decode_loop.decode_backend`; its mesh, if any);
    num_samples: G rows a prompt; max_new_tokens: R, a row's response budget; top_k (0 = off),
    use_top_p, greedy: the sampling filters (`filters.sample_tokens`); use_kernels: the CPU kernels'
    top-k; num_shards: D, data-parallel shards (the mesh's "batch" size; prompts and `slots` are
    multiples of D); slots: S, rows decoded at once over all shards; page_size: tokens per KV page;
    pages_per_chunk: pages the XLA attention reads per chunk; burst: decode steps between two
    refills; prefill_prompts: A, prompts of a shard prefilled in one batch (`prefill_batch`; None:
    the prompts that fill a shard's slots); attention: the decode step's paged attention, a
    `kernels.choice.DecodeAttention` resolved by `kernels.choice.decode_attention_choice` (the run's
    layout, or `generate`): xla, tpu_ragged, gpu_triton or cpu_native. record_routes: a
    mixture-of-experts model's prefill and decode steps also write the expert ids of every prompt
    and fed token (`Outputs.routes`, `Outputs.prompt_routes`; off: the programs carry neither).
    """

    config: ModelConfig
    backend: DecodeBackend
    num_samples: int
    max_new_tokens: int
    top_k: int
    use_top_p: bool
    greedy: bool
    slots: int
    use_kernels: bool = False
    num_shards: int = 1
    page_size: int = PAGE_SIZE
    pages_per_chunk: int = PAGES_PER_CHUNK
    burst: int = BURST
    prefill_prompts: int | None = None
    attention: DecodeAttention = DecodeAttention.XLA
    record_routes: bool = False


def engine_slots(slots: int | None, *, num_prompts: int, samples: int, shards: int) -> int:
    """S, the engine's slots over all shards for `slots` asked (None: every row) and `num_prompts`
    prompts (a multiple of the D shards) of G `samples` rows each, as `generate`, the partial-rollout
    engine and `plan` size them: rounded up to a multiple of D, every row at most:
        S = D min(ceil(slots / D), P / D * G)"""
    return min(-(-(slots or num_prompts * samples) // shards), num_prompts // shards * samples) * shards


def engine_spec_for(config: ModelConfig, backend: DecodeBackend, *, mesh, num_prompts: int, num_samples: int,
                    max_new_tokens: int, top_k: int, top_p: float, greedy: bool, use_kernels: bool, slots: int | None,
                    page_size: int, burst: int, attention: DecodeAttention | None = None,
                    requested_attention: str | None = None, record_routes: bool = False) -> EngineSpec:
    """The EngineSpec of `num_prompts` prompts (a multiple of the mesh's D data-parallel shards) of
    `num_samples` rows each, built alike by `generate`, the partial-rollout engine and `plan`: S =
    `engine_slots(slots, ...)`; `attention` the run's layout's kernel, or None: resolved here by
    `kernels.choice.decode_attention_choice` from `requested_attention` (rollout.decode_attention)."""
    shards = data_parallel_size(mesh)
    if attention is None:
        attention = decode_attention_choice(config, mesh_devices(mesh), cpu_kernels=use_kernels,
                                            requested=requested_attention, page_size=int(page_size),
                                            tensor_parallel=mesh_tensor_parallel(mesh)).kernel
    return EngineSpec(config=config, backend=backend, num_samples=num_samples, max_new_tokens=max_new_tokens,
                      top_k=int(top_k), use_top_p=bool(top_p < 1.0), greedy=bool(greedy), use_kernels=use_kernels,
                      num_shards=shards, slots=engine_slots(slots, num_prompts=num_prompts, samples=num_samples,
                                                            shards=shards),
                      page_size=int(page_size), burst=int(burst), attention=attention,
                      record_routes=bool(record_routes))


class ShardSizes(NamedTuple):
    """A shard's page counts and prefill batch (`shard_sizes`; `Engine`'s fields of the same names)."""

    prompt_pages: int  # Tp, pages of a whole prompt
    response_pages: int  # Rp, a slot's own pages: a partial prompt page + R - 1 tokens
    table_pages: int  # W, a slot's logical pages (Tp + Rp in whole chunks)
    entries: int  # Q, prompt entries: every prompt with a row in a slot, and one whose rows wait
    pool_pages: int  # pages of a shard's pool (`paged_cache.pool_pages`)
    prefill_prompts: int  # A (`prefill_batch`)
    choose_prefill: bool  # a refill picks rounds of A or of one prompt (`prefill_batch`)


def shard_sizes(*, prompts_per_shard: int, slots_per_shard: int, samples: int, prompt_len: int, max_new_tokens: int,
                page_size: int = PAGE_SIZE, pages_per_chunk: int = PAGES_PER_CHUNK,
                prefill_prompts: int | None = None) -> ShardSizes:
    """A shard's pages and prefill batch for P_d prompts of width T, S_d slots, G samples, R new tokens:
        Tp = ceil(T / page), Rp = ceil((page - 1 + max(R - 1, 1)) / page), W = Tp + Rp up to a whole
        chunk, Q = S_d + 1, the pool `pool_pages(S_d, Q, Tp, Rp)`, A = `prefill_batch(P_d, S_d, G)`.
    `Engine.resolve` sizes the engine with it and `sampling.memory.continuous_memory` counts its bytes."""
    prompt_pages = -(-prompt_len // page_size)
    response_pages = -(-(page_size - 1 + max(max_new_tokens - 1, 1)) // page_size)
    table_pages = -(-(prompt_pages + response_pages) // pages_per_chunk) * pages_per_chunk
    entries = slots_per_shard + 1
    at_once, choose = prefill_batch(prompts_per_shard, slots_per_shard, samples, prefill_prompts)
    return ShardSizes(prompt_pages, response_pages, table_pages, entries,
                      pool_pages(slots_per_shard, entries, prompt_pages, response_pages), at_once, choose)


@dataclasses.dataclass(frozen=True)
class Engine:
    """An `EngineSpec` resolved for one program's prompts (`resolve`, at trace time): the sizes of
    a shard's buffers, slots and page pool. The engine buffers
    `halves` x `prompts_per_shard` prompts a shard (1 half for one call, 2 for partial rollouts)."""

    spec: EngineSpec
    prompt_len: int  # T, a prompt's padded width
    prompts_per_shard: int  # P_d, a shard's prompts per half
    rows_per_shard: int  # N_d = P_d * G
    buffer_prompts: int  # H * P_d, a shard's prompt buffer
    buffer_rows: int  # H * N_d, a shard's row buffer
    slots_per_shard: int  # S_d
    prompt_pages: int  # Tp, pages of a whole prompt
    response_pages: int  # Rp, a slot's own pages: a partial prompt page + R - 1 tokens
    table_pages: int  # W, a slot's logical pages (Tp + Rp in whole chunks)
    entries: int  # Q, prompt entries: every prompt with a row in a slot, and one whose rows wait
    pool_pages: int  # pages of a shard's pool
    prefill_prompts: int  # A (`prefill_batch`)
    choose_prefill: bool  # a refill picks rounds of A or of one prompt (`prefill_batch`)

    @staticmethod
    def resolve(spec: EngineSpec, *, num_prompts: int, prompt_len: int, halves: int) -> Engine:
        """The engine of `spec` over `halves` x `num_prompts` prompts (all shards) of width `prompt_len`."""
        shards, page_size = spec.num_shards, spec.page_size
        if spec.attention not in tuple(DecodeAttention):
            raise ValueError(f"continuous sampler: attention={spec.attention!r}; one of "
                             f"{', '.join(k.value for k in DecodeAttention)} (kernels.choice.decode_attention_choice "
                             f"resolves a request such as 'auto' or 'kernel')")
        if num_prompts % shards or spec.slots % shards:
            raise ValueError(f"continuous sampler: {num_prompts} prompts and {spec.slots} slots must split over "
                             f"{shards} shards")
        prompts_per_shard, slots_per_shard = num_prompts // shards, spec.slots // shards
        rows_per_shard = prompts_per_shard * spec.num_samples
        sizes = shard_sizes(prompts_per_shard=prompts_per_shard, slots_per_shard=slots_per_shard,
                            samples=spec.num_samples, prompt_len=prompt_len, max_new_tokens=spec.max_new_tokens,
                            page_size=page_size, pages_per_chunk=spec.pages_per_chunk,
                            prefill_prompts=spec.prefill_prompts)
        return Engine(spec=spec, prompt_len=prompt_len, prompts_per_shard=prompts_per_shard,
                      rows_per_shard=rows_per_shard, buffer_prompts=halves * prompts_per_shard,
                      buffer_rows=halves * rows_per_shard, slots_per_shard=slots_per_shard, **sizes._asdict())

    def constrain_rows(self, x: jax.Array) -> jax.Array:
        """x with its leading axis on the "batch" rule (the shards, or rows over the shards)."""
        return self.spec.backend.constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def buffer_row(self, stream_row: jax.Array) -> jax.Array:
        """A stream row's buffer row (-1: none)."""
        return jnp.where(stream_row >= 0, stream_row % self.buffer_rows, -1)


class Sampling(NamedTuple):
    """The traced sampling settings of a program: temperature, top_p [] float32; eos_ids [E] int32
    (tokens that end a row: EOS and stop token ids); pad_id [] int32 (fills the tokens after a row's
    end); min_p [] float32 or None (off: the program without min-p, `filters.min_p_keep`); stop_seqs
    [S, L] int32 or None: stop strings' token spellings (`stops.stop_token_sequences`; off: None)."""

    temperature: jax.Array
    top_p: jax.Array
    eos_ids: jax.Array
    pad_id: jax.Array
    min_p: jax.Array | None = None
    stop_seqs: jax.Array | None = None


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
    split (its first token sampled by the next segment's weights; R if none) [D, H*N_d]. With
    `EngineSpec.record_routes` (else None): routes [D, H*N_d, R, L k], the expert ids of the token
    fed at each response index (layer l's j-th at l k + j); prompt_routes [D, H*P_d, T, L k], of each
    buffer prompt's tokens (0 on its padding); both `moe.route_dtype`. A token's L k ids are one minor
    dim: XLA:TPU pads a minor dim to 128 lanes, so [.., L, k] held 16x its ids (k = 8) and [.., L k]
    none at Qwen3-30B-A3B's 48 x 8 = 384."""

    tokens: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    length: jax.Array
    eos_seen: jax.Array
    segment: jax.Array
    split: jax.Array
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None


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
    tools: Tools | None = None  # tool calls (`tool_init`; None: a run without tools, its programs unchanged)


class Tools(NamedTuple):
    """The tool-call state of a run with tools (`tool_init`, `tool_segment`, `tool_resume`; the host
    loop is `sampling.tool_rollout`). parked [D, S]: a slot handed to the host (held, not live: its
    pages kept, no decode step); turns [D, S]: the calls its row made; mask [D, N_d, R]: a response
    column the host wrote (a forced tool token: decoded as if sampled, never EOS, never a trigger);
    triggers [K, L] int32: the format's trigger spellings (`stops.trigger_token_sequences`);
    max_turns [] int32: calls a row may make (past them a trigger decodes on); steps [] int32: decode
    steps run; parked_steps [] int32: slot-steps spent parked (all shards)."""

    parked: jax.Array
    turns: jax.Array
    mask: jax.Array
    triggers: jax.Array
    max_turns: jax.Array
    steps: jax.Array
    parked_steps: jax.Array


def _take(a, idx):
    """Per shard a[d][idx[d]]: a [D, X, ...], idx [D, ...] int32 (clipped) -> [D, ..., ...]."""
    return jax.vmap(lambda x, i: x[jnp.clip(i, 0, x.shape[0] - 1)])(a, idx)


def _put(a, idx, value, unique: bool = False):
    """Per shard a[d][idx[d]] = value[d]; out-of-range idx (e.g. -1 mapped to X) is dropped. `unique`:
    the in-range idx of a shard are distinct (XLA:GPU then stores; otherwise each element is a
    system-scope atomic compare-and-swap, `paged_cache.write_tokens`)."""
    size = a.shape[1]
    idx = jnp.where((idx >= 0) & (idx < size), idx, size)
    return jax.vmap(lambda x, i, v: x.at[i].set(v.astype(x.dtype), mode="drop", unique_indices=unique))(a, idx, value)


def _put2(a, i, j, value, unique: bool = False):
    """Per shard a[d][i[d], j[d]] = value[d] (i out of range: dropped); `unique` as `_put`."""
    size = a.shape[1]
    i = jnp.where((i >= 0) & (i < size), i, size)
    return jax.vmap(lambda x, r, c, v: x.at[r, c].set(v.astype(x.dtype), mode="drop", unique_indices=unique))(
        a, i, j, value)


def _record(out: Outputs, rows, column, sample, live, eos_ids, pad_id, stop_seqs=None) -> tuple[Outputs, jax.Array]:
    """Write the sample of each live slot at (row, column): rows, column, live [D, S]. Returns (out,
    is_eos): the token ends the row (an EOS or stop id, or with stop_seqs [S, L] the row's last
    tokens spelling a stop string, `stops.ends_with_stop_sequence`)."""
    token = jnp.where(live, sample.tokens, pad_id).astype(jnp.int32)
    is_eos = jnp.any(token[..., None] == eos_ids, axis=-1) & live
    rows = jnp.where(live, rows, -1)
    tokens = _put2(out.tokens, rows, column, token, unique=True)  # a live slot writes its own row
    if stop_seqs is not None:  # the row's last L tokens, read from its buffer row
        width, max_new_tokens = stop_seqs.shape[1], tokens.shape[-1]
        cols = column[..., None] - width + 1 + jnp.arange(width, dtype=jnp.int32)  # [D, S, L]
        window = jax.vmap(lambda x, r, c: x[r[:, None], c])(tokens, jnp.clip(rows, 0, tokens.shape[1] - 1),
                                                            jnp.clip(cols, 0, max_new_tokens - 1))
        window = jnp.where(cols >= 0, window, -2)
        is_eos = is_eos | (ends_with_stop_sequence(window, stop_seqs) & live)
    out = out._replace(
        tokens=tokens,
        logprobs=_put2(out.logprobs, rows, column, sample.logprob, unique=True),
        logprobs_untruncated=_put2(out.logprobs_untruncated, rows, column, sample.logprob_untruncated, unique=True),
        length=_put(out.length, rows, column + 1, unique=True),
        eos_seen=_put(out.eos_seen, rows, is_eos, unique=True),
    )
    return out, is_eos


def retire(state: EngineState, page_size: int) -> EngineState:
    """Finished slots (held, not live) give back their response pages, and prompts left without rows
    their prompt pages (JetStream's free_resource)."""
    slots, entries = state.slots, state.entries
    done = slots.held & ~slots.live
    if state.tools is not None:  # a parked slot keeps its pages until the host resumes it
        done = done & ~state.tools.parked
        state = state._replace(tools=state.tools._replace(turns=jnp.where(done, 0, state.tools.turns)))
    # own pages taken: the prompt's partial last page (copied at admission) and tokens 0..length-2 fed back
    prompt_len = _take(entries.length, slots.entry)
    used = -(-(prompt_len % page_size + slots.length - 1) // page_size)
    response_pages = slots.pages.shape[-1]
    release = done[..., None] & (jnp.arange(response_pages) < used[..., None])
    shards = done.shape[0]
    free = push_pages(state.free, slots.pages.reshape(shards, -1), release.reshape(shards, -1))
    num_entries = entries.refs.shape[1]
    drop = jax.vmap(lambda entry, finished: jnp.zeros((num_entries,), jnp.int32).at[
        jnp.where(finished, entry, num_entries)].add(1, mode="drop"))(slots.entry, done)
    refs = entries.refs - drop
    gone = (entries.refs > 0) & (refs == 0)
    prompt_pages = entries.pages.shape[-1]
    prompt_used = -(-entries.length // page_size)
    release = gone[..., None] & (jnp.arange(prompt_pages) < prompt_used[..., None])
    free = push_pages(free, entries.pages.reshape(shards, -1), release.reshape(shards, -1))
    return state._replace(slots=slots._replace(held=slots.held & ~done), entries=entries._replace(refs=refs), free=free)


def draw(engine: Engine, sampling: Sampling, queue: Queue, logits, rows, column):
    """Sample [D, M] slots: logits [D, M, V]; the uniforms of buffer rows `rows` [D, M] at response
    index `column`. Returns a `filters.TokenSample` of [D, M] arrays."""
    spec = engine.spec
    shards, count = rows.shape
    uniforms = None
    if not spec.greedy:
        uniforms = _take(queue.uniforms, rows)  # [D, M, R]
        uniforms = jnp.take_along_axis(uniforms, jnp.broadcast_to(column, (shards, count))[..., None], axis=2)
    flat = sample_tokens(logits.reshape(shards * count, -1), None,
                         uniform=None if spec.greedy else uniforms.reshape(shards * count, 1),
                         temperature=sampling.temperature,
                         top_k=spec.top_k, top_p=sampling.top_p, use_top_p=spec.use_top_p, greedy=spec.greedy,
                         use_kernels=spec.use_kernels, min_p=sampling.min_p, exact=spec.config.numerics == "exact",
                         shards=vocab_shards(spec.backend.mesh, spec.backend.rules))  # top-k per vocab shard + a gather
    return jax.tree.map(lambda x: x.reshape(shards, count), flat)


def prefill(engine: Engine, weights, sampling: Sampling, state: EngineState, first_prompt, count, round_index,
            prompts_per_round: int) -> EngineState:
    """One prefill round: stream prompts first_prompt + round_index*A .. + A-1 of each shard (A =
    `prompts_per_round`; those < first_prompt + count, [D]): their KV into fresh pages of the pool,
    an entry each, and the first tokens of all their G rows (drawn now; rows admitted later read
    them from `out`)."""
    spec = engine.spec
    config, backend, page_size = spec.config, spec.backend, spec.page_size
    shards, samples, prompt_len = spec.num_shards, spec.num_samples, engine.prompt_len
    kv_heads, head_dim, cache_dtype = config.num_kv_heads, config.head_dim, jnp.dtype(config.dtype)
    prompt_pages, num_entries = engine.prompt_pages, engine.entries
    entries, out = state.entries, state.out
    nth_new = round_index * prompts_per_round + jnp.arange(prompts_per_round, dtype=jnp.int32)[None, :]  # [1, A]
    valid = nth_new < count[:, None]  # [D, A]
    prompt = (first_prompt[:, None] + nth_new) % engine.buffer_prompts  # buffer prompts
    tokens, mask = _take(state.queue.tokens, prompt), _take(state.queue.mask, prompt)  # [D, A, T]
    logits, keys, values, routes = prefill_kv(weights, config,
                                      engine.constrain_rows(tokens.reshape(shards * prompts_per_round, prompt_len)),
                                      engine.constrain_rows(mask.reshape(shards * prompts_per_round, prompt_len)),
                                      backend=backend, cache_dtype=cache_dtype)
    length = jnp.sum(mask, axis=-1)  # [D, A]
    need = valid[..., None] & (jnp.arange(prompt_pages) < -(-length // page_size)[..., None])  # [D, A, Tp]
    free, page_ids = pop_pages(state.free, need.reshape(shards, -1))
    page_ids = page_ids.reshape(shards, prompts_per_round, prompt_pages)
    position = jnp.arange(prompt_pages * page_size)  # logical prompt token i sits at padded position T - L + i
    real = valid[..., None] & (position < length[..., None])  # [D, A, Tp*page]
    source = jnp.clip(prompt_len - length[..., None] + position, 0, prompt_len - 1)
    write_page = jnp.where(real, jnp.take_along_axis(page_ids, jnp.broadcast_to(position // page_size, real.shape), 2),
                           TRASH_PAGE)
    write_offset = jnp.broadcast_to(position % page_size, real.shape)

    def real_tokens(x):  # x [D*A, T, KVH, Dh] -> the prompts' real tokens [D, A*Tp*page, KVH, Dh]
        x = x.reshape(shards, prompts_per_round, prompt_len, kv_heads, head_dim)
        return jnp.take_along_axis(x, source[..., None, None], axis=2).reshape(shards, -1, kv_heads, head_dim)

    pool = [write_tokens(layer_pool, write_page.reshape(shards, -1), write_offset.reshape(shards, -1),
                         real_tokens(layer_keys), real_tokens(layer_values), cache_dtype)
            for layer_pool, layer_keys, layer_values in zip(state.pool, keys, values)]
    # the i-th new prompt takes the i-th free entry
    free_entry = entries.refs == 0
    rank = jnp.cumsum(free_entry, axis=1, dtype=jnp.int32) - 1
    nth_free = jax.vmap(lambda is_free, rank: jnp.zeros((num_entries,), jnp.int32).at[
        jnp.where(is_free, rank, num_entries)].set(jnp.arange(num_entries, dtype=jnp.int32), mode="drop"))(
        free_entry, rank)  # [D, Q]
    entry = jnp.where(valid, jnp.take_along_axis(nth_free, jnp.broadcast_to(jnp.arange(prompts_per_round),
                                                                            valid.shape), 1), -1)
    entries = Entries(_put(entries.pages, entry, page_ids), _put(entries.length, entry, length),
                      _put(entries.refs, entry, jnp.full(entry.shape, samples, jnp.int32)),
                      _put(entries.of_prompt, jnp.where(valid, prompt, -1), entry))
    if spec.record_routes:  # routes [D*A, T, L, k] of the prompts' tokens, 0 on their padding
        routes = jnp.where(mask.reshape(-1, prompt_len)[..., None, None] > 0, routes, 0)
        out = out._replace(prompt_routes=_put(out.prompt_routes, jnp.where(valid, prompt, -1),
                                              routes.reshape((shards, prompts_per_round, prompt_len, -1)),
                                              unique=True))
    # first tokens of every row of these prompts (rows admitted now or later read them from `out`)
    rows = jnp.where(valid[..., None], prompt[..., None] * samples + jnp.arange(samples), -1)
    rows = rows.reshape(shards, prompts_per_round * samples)
    first = draw(engine, sampling, state.queue, jnp.repeat(logits.reshape(shards, prompts_per_round, -1), samples,
                                                           axis=1), jnp.maximum(rows, 0), jnp.zeros((), jnp.int32))
    out, _ = _record(out, rows, jnp.zeros_like(rows), first, rows >= 0, sampling.eos_ids, sampling.pad_id,
                     sampling.stop_seqs)
    out = out._replace(segment=_put(out.segment, rows, jnp.broadcast_to(state.segment, rows.shape)))
    return state._replace(entries=entries, free=free, pool=pool, out=out)


class Admission(NamedTuple):
    """What a refill admits, per shard: free_slot [D, S] the slots holding no row; count [D] the
    waiting rows it gives them (at most the free slots)."""

    free_slot: jax.Array
    count: jax.Array


def admission(state: EngineState) -> Admission:
    """The rows the next refill admits: as many waiting rows (in stream order) as slots are free."""
    free_slot = ~state.slots.held
    count = jnp.minimum(jnp.sum(free_slot, axis=1, dtype=jnp.int32), state.end - state.next_row)  # [D]
    return Admission(free_slot, count)


def insert(engine: Engine, state: EngineState, admitted: Admission) -> EngineState:
    """Give each free slot the next waiting row (in stream order; their prompts prefilled): the row's
    first token, drawn at its prompt's prefill, is the token the slot feeds back first."""
    page_size, samples = engine.spec.page_size, engine.spec.num_samples
    slots, out, entries = state.slots, state.out, state.entries
    free_slot, count = admitted
    rank = jnp.cumsum(free_slot, axis=1, dtype=jnp.int32) - 1
    mine = free_slot & (rank < count[:, None])  # [D, S]
    row = jnp.where(mine, state.next_row[:, None] + rank, -1)
    buffer_index = jnp.maximum(engine.buffer_row(row), 0)
    token = jnp.take_along_axis(out.tokens[:, :, 0], buffer_index, axis=1)
    done = _take(out.eos_seen, buffer_index) | (_take(state.queue.budget, buffer_index) <= 1)
    entry = jnp.where(mine, _take(entries.of_prompt, buffer_index // samples), slots.entry)
    # the prompt's partial last page is copied into the slot's first own page (its tokens then
    # continue there: a slot's tokens stay contiguous, and shared pages are never written)
    prompt_len = _take(entries.length, entry)
    partial = mine & (prompt_len % page_size != 0)
    free, copy = pop_pages(state.free, partial)
    entry_pages = _take(entries.pages, entry)
    last_prompt_page = (prompt_len // page_size)[..., None].clip(0, engine.prompt_pages - 1)
    source = jnp.where(partial, jnp.take_along_axis(entry_pages, last_prompt_page, axis=2)[..., 0], TRASH_PAGE)
    pages = jnp.where(partial[..., None] & (jnp.arange(engine.response_pages) == 0), copy[..., None], slots.pages)
    slots = Slots(row=jnp.where(mine, row, slots.row), entry=entry,
                  length=jnp.where(mine, 1, slots.length), token=jnp.where(mine, token, slots.token),
                  live=jnp.where(mine, ~done, slots.live), held=slots.held | mine, pages=pages)
    return state._replace(slots=slots, next_row=state.next_row + count, free=free,
                          pool=[copy_pages(layer_pool, copy, source) for layer_pool in state.pool])


def refill(engine: Engine, weights, sampling: Sampling, state: EngineState) -> EngineState:
    """Retire finished slots, then give each free slot the next waiting row (in stream order),
    prefilling the prompts whose first row is admitted, A at a time (`prefill_batch`)."""
    samples, rounds_of = engine.spec.num_samples, engine.prefill_prompts
    state = retire(state, engine.spec.page_size)
    slots = state.slots
    admitted = admission(state)
    first_prompt = -(-state.next_row // samples)  # prompts before it are prefilled
    new_prompts = -(-(state.next_row + admitted.count) // samples) - first_prompt

    def prefill_rounds(state, prompts_per_round: int, rounds):
        return jax.lax.fori_loop(0, rounds, lambda i, state: prefill(
            engine, weights, sampling, state, first_prompt, new_prompts, i, prompts_per_round), state)

    most = jnp.max(new_prompts)
    if not engine.choose_prefill:  # every row has a slot (one admission: A = all prompts), or A = 1
        state = prefill_rounds(state, rounds_of, -(-most // rounds_of))
    else:  # A at a time when more than A / 2 prompts come in, else one at a time: one of the two loops runs.
        # Two loops in a row, not a lax.cond between them: XLA:TPU copied the page pool into and out
        # of the loop inside each branch on every round, holding it twice (docs/sampling.md)
        batched = 2 * most > rounds_of
        state = prefill_rounds(state, rounds_of, jnp.where(batched, -(-most // rounds_of), 0))
        state = prefill_rounds(state, 1, jnp.where(batched, 0, most))
    # the prefill loops carry the slots unchanged: insert reads them as the loops found them
    return insert(engine, state._replace(slots=slots), admitted)


class StepPages(NamedTuple):
    """Where a decode step writes and reads each slot's KV [D, S]: write_page, write_offset (the
    fed token's page and place; the trash page for idle slots); table [D, S, W] (a slot's logical
    pages: its prompt's full pages, then its own); kv_len (tokens the slot attends to, the fed
    one included; 0 when idle); counts [D, S, W] (tokens on each logical page); num_chunks []
    (chunks of pages the longest live slot spans)."""

    write_page: jax.Array
    write_offset: jax.Array
    table: jax.Array
    kv_len: jax.Array
    counts: jax.Array
    num_chunks: jax.Array


def _kernel_mesh_axes(backend: DecodeBackend) -> tuple[tuple[str, ...], str | None]:
    """(batch_axes, tensor_axis): the mesh axes a paged attention kernel's shard_map splits the
    shards and the kv heads over (the backend's "batch" and "kv_heads" rules); ((), None) without a mesh."""
    if backend.mesh is None:
        return (), None
    rules = dict(backend.rules)
    batch = rules["batch"]
    batch = (batch,) if isinstance(batch, str) else tuple(batch or ())
    tensor_axis = rules["kv_heads"] if isinstance(rules["kv_heads"], str) else None
    return tuple(axis for axis in batch if axis in backend.mesh.shape), tensor_axis


def _attend(engine: Engine, layer_pool, pages: StepPages, queries, keys, values):
    """One layer's attention of the fed tokens over their slots' pages, the fed tokens' keys and
    values written first: queries [D*S, 1, H, Dh], keys, values [D*S, 1, KVH, Dh] -> (out
    [D*S, 1, H, Dh] float32, the layer's pool)."""
    spec = engine.spec
    config, backend = spec.config, spec.backend
    shards, slots = spec.num_shards, engine.slots_per_shard
    kv_heads, head_dim, cache_dtype = config.num_kv_heads, config.head_dim, jnp.dtype(config.dtype)
    group = config.num_heads // kv_heads
    queries = queries.reshape(shards, slots, kv_heads, group, head_dim)
    keys, values = keys.reshape(shards, slots, kv_heads, head_dim), values.reshape(shards, slots, kv_heads, head_dim)
    if spec.attention == DecodeAttention.EXACT:  # the training forward's kernel over the slot's keys in order
        pool = write_tokens(layer_pool, pages.write_page, pages.write_offset, keys, values, cache_dtype)
        slot_keys, slot_values = (as_values(x, cache_dtype).reshape(shards * slots, -1, kv_heads, head_dim)
                                  for x in gather_pages(pool, pages.table))  # [D*S, W*page, KVH, Dh]
        kv_len = pages.kv_len.reshape(shards * slots, 1)
        zero = jnp.zeros_like(kv_len)
        out = exact.attention(queries.reshape(shards * slots, 1, kv_heads * group, head_dim), slot_keys, slot_values,
                              jnp.stack([zero, kv_len, zero, zero], axis=-1), dtype=jnp.dtype(config.dtype),
                              kv_dtype=cache_dtype)
        return out, pool
    if spec.attention == DecodeAttention.CPU_NATIVE:  # the new token written and the live pages read in place, in C++
        out, pool = cpu_paged_attention(queries, layer_pool, keys, values, pages.write_page, pages.write_offset,
                                        pages.table, pages.kv_len)
        return out.reshape(shards * slots, 1, kv_heads * group, head_dim), pool
    pool = write_tokens(layer_pool, pages.write_page, pages.write_offset, keys, values, cache_dtype)
    pool = backend.constrain(pool, POOL_AXES)
    batch_axes, tensor_axis = _kernel_mesh_axes(backend)
    if spec.attention == DecodeAttention.GPU_TRITON:
        out = gpu_paged_attention(queries, pool, pages.table, pages.kv_len, mesh=backend.mesh, batch_axes=batch_axes,
                                  tensor_axis=tensor_axis)
    elif spec.attention == DecodeAttention.TPU_RAGGED:
        out = kernel_paged_attention(queries, pool, pages.table, pages.kv_len, mesh=backend.mesh,
                                     batch_axes=batch_axes, tensor_axis=tensor_axis)
    else:
        out = paged_attention(queries, pool, pages.table, pages.counts, pages.num_chunks,
                              pages_per_chunk=spec.pages_per_chunk, dtype=jnp.dtype(config.dtype),
                              value_dtype=cache_dtype)
    return out.reshape(shards * slots, 1, kv_heads * group, head_dim), pool


def decode_step(engine: Engine, weights, sampling: Sampling, state: EngineState) -> EngineState:
    """One decode step of every live slot (JetStream's generate): feed its last token (its KV into
    the slot's pages, a page taken when the token starts one), sample the next."""
    spec = engine.spec
    config, backend, page_size = spec.config, spec.backend, spec.page_size
    shards, slots_per_shard, table_pages = spec.num_shards, engine.slots_per_shard, engine.table_pages
    slots, entries = state.slots, state.entries
    fed = slots.length - 1  # response index of the token fed back
    prompt_len = _take(entries.length, slots.entry)  # [D, S]
    shared = prompt_len // page_size  # the prompt's full pages, read in place
    own = prompt_len % page_size + fed  # index of the fed token among the slot's own pages' tokens
    need = slots.live & (own % page_size == 0)
    free, new_page = pop_pages(state.free, need)
    slot_ids = jnp.where(need, jnp.arange(slots_per_shard, dtype=jnp.int32)[None], -1)
    own_page = jnp.clip(own // page_size, 0, engine.response_pages - 1)
    slot_pages = _put2(slots.pages, slot_ids, own_page, new_page, unique=True)  # one page a slot
    write_page = jnp.where(slots.live, jnp.take_along_axis(slot_pages, own_page[..., None], axis=2)[..., 0],
                           TRASH_PAGE)
    write_offset = jnp.where(slots.live, own % page_size, 0)
    # a slot's tokens are contiguous over its logical pages: the prompt's full pages, then its own
    logical = jnp.broadcast_to(jnp.arange(table_pages)[None, None], (shards, slots_per_shard, table_pages))
    in_prompt = logical < shared[..., None]
    from_prompt = jnp.take_along_axis(_take(entries.pages, slots.entry), jnp.clip(logical, 0, engine.prompt_pages - 1),
                                      axis=2)
    from_own = jnp.take_along_axis(slot_pages, jnp.clip(logical - shared[..., None], 0, engine.response_pages - 1),
                                   axis=2)
    table = jnp.where(in_prompt, from_prompt, from_own)
    kv_len = jnp.where(slots.live, prompt_len + slots.length, 0)  # the fed token included
    counts = jnp.clip(kv_len[..., None] - logical * page_size, 0, page_size)
    num_chunks = -(-jnp.max(-(-kv_len // page_size)) // spec.pages_per_chunk)
    pages = StepPages(write_page, write_offset, table, kv_len, counts, num_chunks)

    cos, sin = rope_tables(config, engine.constrain_rows((prompt_len + fed).reshape(shards * slots_per_shard, 1)))
    x = backend.embed(weights["embed"], engine.constrain_rows(slots.token.reshape(shards * slots_per_shard, 1)))
    pool, routes = [], []
    for layer_weights, layer_pool in zip(weights["layers"], state.pool):
        attend = functools.partial(_attend, engine, layer_pool, pages)
        x, written, ids, _ = decoder_layer(FusedLayer(layer_weights, config, backend), x, cos, sin, attend)
        pool.append(written)
        routes.append(ids)
    logits = lm_head(weights, config, backend, x[:, 0]).reshape(shards, slots_per_shard, -1)
    rows = engine.buffer_row(slots.row)
    drawn = draw(engine, sampling, state.queue, logits, jnp.maximum(rows, 0), slots.length)
    tools, forcing = state.tools, None
    if tools is not None:  # a column the host wrote: its token is fed on as if sampled
        drawn, forcing = forced_draw(tools, state.out, rows, slots.length, logits, drawn, slots.live,
                                     sampling.temperature)
    out, is_eos = _record(state.out, rows, slots.length, drawn, slots.live, sampling.eos_ids, sampling.pad_id,
                          sampling.stop_seqs)
    if tools is not None:  # a forced token never ends its row
        is_eos = is_eos & ~forcing
        out = out._replace(eos_seen=_put(out.eos_seen, jnp.where(slots.live, rows, -1), is_eos, unique=True))
    if spec.record_routes:  # the fed token's expert ids [D*S, 1, k] a layer -> its row at response index `fed`
        routes = jnp.stack(routes, axis=2).reshape(shards, slots_per_shard, -1)  # [D, S, L k]
        out = out._replace(routes=_put2(out.routes, jnp.where(slots.live, rows, -1), fed, routes, unique=True))
    length = slots.length + slots.live.astype(jnp.int32)
    done = is_eos | (length >= _take(state.queue.budget, jnp.maximum(rows, 0)))
    live = slots.live & ~done
    if tools is not None:  # a model token completing a trigger parks its slot (`park`)
        tools, parks = park(tools, out.tokens, rows, slots.length, live & ~forcing)
        live = live & ~parks
    slots = slots._replace(length=length, token=jnp.where(slots.live, drawn.tokens, slots.token),
                           live=live, pages=slot_pages)
    return state._replace(slots=slots, free=free, pool=pool, out=out, tools=tools)


def _take2(a, i, j):
    """Per shard a[d][i[d], j[d]] (indices clipped): a [D, X, Y], i, j [D, ...] -> [D, ...]."""
    return jax.vmap(lambda x, r, c: x[jnp.clip(r, 0, x.shape[0] - 1), jnp.clip(c, 0, x.shape[1] - 1)])(a, i, j)


def forced_draw(tools: Tools, out: Outputs, rows, column, logits, drawn, live, temperature):
    """The draw of a step with tools: a live slot whose row's column `column` the host wrote
    (tools.mask) takes the written token, its log-prob log softmax(logits / temperature)[token]
    (both log-probs; the trainer masks tool tokens out). rows, column, live [D, S]; logits [D, S, V].
    Returns (drawn, forcing [D, S])."""
    forcing = live & _take2(tools.mask, rows, column)
    token = _take2(out.tokens, rows, column)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1),
                                  token[..., None], axis=-1)[..., 0]
    pick = lambda forced, sampled: jnp.where(forcing, forced, sampled)
    return drawn._replace(tokens=pick(token, drawn.tokens), logprob=pick(logprob, drawn.logprob),
                          logprob_untruncated=pick(logprob, drawn.logprob_untruncated)), forcing


def park(tools: Tools, tokens, rows, column, candidate) -> tuple[Tools, jax.Array]:
    """Park the candidate slots (live, not done, the token at `column` sampled) whose row's last
    tokens spell a trigger (`stops.ends_with_stop_sequence`) over model tokens only (a window
    touching a forced column never matches: a trigger inside tool output does not re-trigger), while
    the row has turns left. tokens [D, N_d, R] (this step's written); rows, column, candidate [D, S].
    Returns (tools, parks [D, S]); the step and parked slot-step counters advance."""
    width, max_new_tokens = tools.triggers.shape[1], tokens.shape[-1]
    cols = column[..., None] - width + 1 + jnp.arange(width, dtype=jnp.int32)  # [D, S, L]
    gather = lambda x: jax.vmap(lambda a, r, c: a[r[:, None], c])(x, jnp.clip(rows, 0, x.shape[1] - 1),
                                                                  jnp.clip(cols, 0, max_new_tokens - 1))
    window = jnp.where((cols >= 0) & ~gather(tools.mask), gather(tokens), -2)
    parks = candidate & (tools.turns < tools.max_turns) & ends_with_stop_sequence(window, tools.triggers)
    return tools._replace(parked=tools.parked | parks, turns=tools.turns + parks.astype(jnp.int32),
                          steps=tools.steps + 1,
                          parked_steps=tools.parked_steps + jnp.sum(tools.parked, dtype=jnp.int32)), parks


def decode_burst(engine: Engine, weights, sampling: Sampling, state: EngineState, stop=None) -> EngineState:
    """Up to `burst` decode steps, fewer when every slot finishes first, or when `stop(state)` [] bool
    holds before a step (a tool segment's end, `tool_segment`; None: never)."""
    more = lambda carry: (carry[0] < engine.spec.burst) & jnp.any(carry[1].slots.live)
    if stop is not None:
        more = lambda carry, more=more: more(carry) & ~stop(carry[1])
    step = lambda carry: (carry[0] + 1, decode_step(engine, weights, sampling, carry[1]))
    return jax.lax.while_loop(more, step, (jnp.zeros((), jnp.int32), state))[1]


def refill_and_decode(engine: Engine, weights, sampling: Sampling, state: EngineState, stop=None) -> EngineState:
    """The body of the engine's loop: a refill, then a burst of decode steps (`decode_burst`'s stop)."""
    return decode_burst(engine, weights, sampling, refill(engine, weights, sampling, state), stop)


def empty_state(engine: Engine, queue: Queue, end, pad_id) -> EngineState:
    """The engine with every slot free and the pool empty, over `queue`: rows before `end` [D]
    (stream index) may be admitted; the outputs filled with `pad_id`."""
    spec = engine.spec
    config, backend = spec.config, spec.backend
    shards, slots, rows, prompts = spec.num_shards, engine.slots_per_shard, engine.buffer_rows, engine.buffer_prompts
    max_new_tokens, num_entries = spec.max_new_tokens, engine.entries
    zeros = lambda shape, dtype, fill=0: engine.constrain_rows(jnp.full(shape, fill, dtype))
    pool_shape = (shards, engine.pool_pages, spec.page_size, 2 * config.num_kv_heads, config.head_dim)
    bits = isinstance(backend, CpuBackend)
    empty_layer = lambda: backend.constrain(empty_pool(pool_shape, jnp.dtype(config.dtype), bits=bits), POOL_AXES)
    state = EngineState(
        slots=Slots(row=zeros((shards, slots), jnp.int32, -1), entry=zeros((shards, slots), jnp.int32),
                    length=zeros((shards, slots), jnp.int32), token=zeros((shards, slots), jnp.int32),
                    live=zeros((shards, slots), bool), held=zeros((shards, slots), bool),
                    pages=zeros((shards, slots, engine.response_pages), jnp.int32)),
        entries=Entries(zeros((shards, num_entries, engine.prompt_pages), jnp.int32),
                        zeros((shards, num_entries), jnp.int32), zeros((shards, num_entries), jnp.int32),
                        zeros((shards, prompts), jnp.int32)),
        free=empty_free_pages(shards, engine.pool_pages),
        next_row=jnp.zeros((shards,), jnp.int32),
        end=end,
        pool=[empty_layer() for _ in range(config.num_layers)],
        out=Outputs(zeros((shards, rows, max_new_tokens), jnp.int32) + pad_id,
                    zeros((shards, rows, max_new_tokens), jnp.float32),
                    zeros((shards, rows, max_new_tokens), jnp.float32), zeros((shards, rows), jnp.int32),
                    zeros((shards, rows), bool), zeros((shards, rows), jnp.int32, -1),
                    zeros((shards, rows), jnp.int32, max_new_tokens)),
        queue=queue,
        segment=jnp.zeros((), jnp.int32),
        done=jnp.zeros((), jnp.int32),
    )
    if spec.record_routes:
        routes_shape = (config.num_layers * config.num_experts_per_tok,)
        dtype = route_dtype(config.num_experts)
        state = state._replace(out=state.out._replace(
            routes=zeros((shards, rows, max_new_tokens) + routes_shape, dtype),
            prompt_routes=zeros((shards, prompts, queue.tokens.shape[2]) + routes_shape, dtype)))
    return state


def rows_of_half(engine: Engine, state: EngineState, half) -> ProgramOutput:
    """The rows of buffer half `half` (traced) as one call's ProgramOutput ([N, ...], shards in order)."""
    spec = engine.spec
    shards, rows, prompts = spec.num_shards, engine.rows_per_shard, engine.prompts_per_shard
    take = lambda x, size: jax.lax.dynamic_slice_in_dim(x, half * size, size, axis=1)
    unshard = lambda x: engine.constrain_rows(x.reshape((shards * x.shape[1],) + x.shape[2:]))
    out, queue = state.out, state.queue
    length = unshard(take(out.length, rows))
    steps = jnp.arange(spec.max_new_tokens, dtype=jnp.int32)
    of_prompts = lambda x: engine.constrain_rows(jnp.repeat(unshard(take(x, prompts)), spec.num_samples, axis=0))
    of_layers = lambda x: x.reshape(x.shape[:-1] + (spec.config.num_layers, -1))  # [.., L k] -> [.., L, k]
    return ProgramOutput(
        prompt_tokens=of_prompts(queue.tokens),
        prompt_mask=of_prompts(queue.mask).astype(jnp.float32),
        response_tokens=unshard(take(out.tokens, rows)),
        response_mask=(steps[None, :] < length[:, None]).astype(jnp.float32),
        logprobs=unshard(take(out.logprobs, rows)),
        logprobs_untruncated=unshard(take(out.logprobs_untruncated, rows)),
        lengths=length,
        truncated=~unshard(take(out.eos_seen, rows)),
        routes=None if out.routes is None else of_layers(unshard(take(out.routes, rows))),
        prompt_routes=None if out.prompt_routes is None else of_layers(unshard(take(out.prompt_routes, prompts))),
    )


def call_state(engine: Engine, prompt_tokens, prompt_mask, row_valid, rng, first_row, pad_id,
               row_budget) -> EngineState:
    """The empty engine of one call over its P prompts [P, T] (`continuous_program`'s arguments): the
    queue of its rows (uniforms of rows first_row.. from rng, budgets cut to max_new_tokens), the
    real rows (padding prompts come last) admissible."""
    spec = engine.spec
    samples, max_new_tokens, shards = spec.num_samples, spec.max_new_tokens, spec.num_shards
    num_prompts = prompt_tokens.shape[0]
    shard = lambda x: engine.constrain_rows(x.reshape((shards, -1) + x.shape[1:]))
    num_real = jnp.sum(shard(row_valid.astype(jnp.int32)), axis=1)  # [D] (padding prompts come last)
    queue = Queue(tokens=shard(prompt_tokens), mask=shard(prompt_mask.astype(jnp.int32)),  # [D, Pd, T]
                  uniforms=jnp.zeros((shards, 1, 1), jnp.float32) if spec.greedy else shard(
                      row_uniforms(rng, first_row, num_prompts * samples, max_new_tokens)),  # [D, Nd, R]
                  budget=shard(jnp.minimum(row_budget.astype(jnp.int32), max_new_tokens)))  # [D, Nd]
    return empty_state(engine, queue, num_real * samples, pad_id)


@functools.partial(jax.jit, static_argnames=("spec",))
def continuous_program(weights, prompt_tokens, prompt_mask, row_valid, rng, first_row, temperature, top_p, eos_ids,
                       pad_id, row_budget, min_p=None, stop_seqs=None, *, spec: EngineSpec) -> ProgramOutput:
    """`decode_loop.sample_program` (same arguments and output, rows for rows) on `spec.slots` slots.

    Args (beyond sample_program's):
      row_budget [N] int32: row n stops after row_budget[n] tokens (<= max_new_tokens; truncated
        unless its last token is an EOS): per-row response budgets, e.g. a benchmark's forced lengths.
      min_p: optional float32 scalar, min-p sampling (`filters.min_p_keep`); None = off.
      stop_seqs: optional [S, L] int32 (`stops.stop_token_sequences`): a row whose last tokens spell
        a stop string ends there as at an EOS, its slot freed; None = off.
      spec: the engine (`EngineSpec`); its fields beyond sample_program's static arguments:
        num_shards: D, data-parallel shards (the mesh's "batch" size; P and `slots` multiples of D).
        slots: S, rows decoded at once over all shards (a multiple of D).
        page_size: tokens per KV page; pages_per_chunk: pages read per attention chunk.
        burst: decode steps between two refills.
        prefill_prompts: A, prompts per shard prefilled in one batch when a refill admits more than
          A / 2 prompts (the first admission, which fills every slot), else one at a time (a refill
          that needs one prompt does not pay for A); None: S/D // G, the prompts that fill the slots.
        attention: a `kernels.choice.DecodeAttention`, resolved by `kernels.choice.decode_attention_choice`:
          xla (`paged_cache.paged_attention`, any platform), tpu_ragged (the ragged paged attention
          kernel, `paged_cache.kernel_paged_attention`), gpu_triton (the Pallas/Triton paged attention
          kernel, `gpu_paged_attention`) or cpu_native (the C++ kernel, `kernels.paged_attention`,
          which also writes the new token in place; a CpuBackend with kernels).
    Returns: ProgramOutput with N = P * num_samples rows, R = max_new_tokens.
    """
    num_prompts, prompt_len = prompt_tokens.shape
    engine = Engine.resolve(spec, num_prompts=num_prompts, prompt_len=prompt_len, halves=1)
    sampling = Sampling(temperature, top_p, eos_ids, pad_id, min_p, stop_seqs)
    state = call_state(engine, prompt_tokens, prompt_mask, row_valid, rng, first_row, pad_id, row_budget)
    more = lambda state: jnp.any(state.slots.live) | jnp.any(state.next_row < state.end)
    state = jax.lax.while_loop(more, functools.partial(refill_and_decode, engine, weights, sampling), state)
    return rows_of_half(engine, state, 0)


# ------------------------------------------------------------------ tool calls (sampling/tool_rollout.py)
class ParkedRows(NamedTuple):
    """What a tool segment hands the host, per shard and slot [D, S]: parked (the slot waits for its
    row's tool call), row (its row, over all shards: d * N_d + local; -1 none), length (response
    tokens so far), budget (the row's response budget); tokens, mask [D, S, R] (the row's response
    tokens and tool mask). busy [] bool: a slot decodes or a row waits for a free slot; steps,
    parked_steps [] int32 (`Tools`)."""

    parked: jax.Array
    row: jax.Array
    length: jax.Array
    budget: jax.Array
    tokens: jax.Array
    mask: jax.Array
    busy: jax.Array
    steps: jax.Array
    parked_steps: jax.Array


def _tool_engine(spec: EngineSpec, state: EngineState) -> Engine:
    """The engine of a run with tools (one call's prompts, `tool_init`) from its state's queue."""
    shards, prompts, prompt_len = state.queue.tokens.shape
    return Engine.resolve(spec, num_prompts=shards * prompts, prompt_len=prompt_len, halves=1)


@functools.partial(jax.jit, static_argnames=("spec",))
def tool_init(prompt_tokens, prompt_mask, row_valid, rng, first_row, pad_id, row_budget, triggers, max_turns, *,
              spec: EngineSpec) -> EngineState:
    """The engine of one call with tools (`continuous_program`'s first arguments): no row admitted,
    no slot parked; triggers [K, L] int32 (`stops.trigger_token_sequences`), max_turns [] int32."""
    num_prompts, prompt_len = prompt_tokens.shape
    engine = Engine.resolve(spec, num_prompts=num_prompts, prompt_len=prompt_len, halves=1)
    state = call_state(engine, prompt_tokens, prompt_mask, row_valid, rng, first_row, pad_id, row_budget)
    per_slot = lambda dtype: engine.constrain_rows(jnp.zeros((spec.num_shards, engine.slots_per_shard), dtype))
    mask = engine.constrain_rows(jnp.zeros(state.out.tokens.shape, bool))
    zero = jnp.zeros((), jnp.int32)
    return state._replace(tools=Tools(per_slot(bool), per_slot(jnp.int32), mask, jnp.asarray(triggers, jnp.int32),
                                      jnp.asarray(max_turns, jnp.int32), zero, zero))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(1,))
def tool_segment(weights, state: EngineState, temperature, top_p, eos_ids, pad_id, max_steps, min_p=None,
                 stop_seqs=None, park_wait=None, *, spec: EngineSpec) -> tuple[EngineState, ParkedRows]:
    """One segment of a run with tools: refills and bursts of decode steps (`refill_and_decode`)
    while a slot decodes or a row waits for a free one, for at most `max_steps` [] int32 decode
    steps, and with `park_wait` [] int32 (None: no such end) until the slots parked during the
    segment have waited `park_wait` slot-steps in all (`segment_end`); then finished slots retire.
    Parked slots keep their pages and wait (`tool_resume`). Returns (state, ParkedRows)."""
    engine = _tool_engine(spec, state)
    sampling = Sampling(temperature, top_p, eos_ids, pad_id, min_p, stop_seqs)
    stop = functools.partial(segment_end, state.tools, max_steps=max_steps, park_wait=park_wait)

    def busy(state):
        free = jnp.any(~state.slots.live & ~state.tools.parked, axis=1)  # [D] a slot a refill may give a row
        return jnp.any(state.slots.live) | jnp.any((state.next_row < state.end) & free)

    more = lambda state: busy(state) & ~stop(state)
    state = jax.lax.while_loop(more, functools.partial(refill_and_decode, engine, weights, sampling, stop=stop),
                               state)
    state = retire(state, spec.page_size)
    slots, tools, rows = state.slots, state.tools, engine.rows_per_shard
    local = jnp.maximum(slots.row, 0)
    shard_of = jnp.arange(spec.num_shards, dtype=jnp.int32)[:, None]
    return state, ParkedRows(tools.parked, jnp.where(slots.held, shard_of * rows + slots.row, -1), slots.length,
                             _take(state.queue.budget, local), _take(state.out.tokens, local),
                             _take(tools.mask, local), busy(state), tools.steps, tools.parked_steps)


def segment_end(start: Tools, state: EngineState, *, max_steps, park_wait=None):
    """Whether a tool segment that began at `start` ends before its next decode step: `max_steps`
    steps ran, or (park_wait not None) slots parked since its start have waited park_wait slot-steps
    in all: waited = (parked_steps - parked_steps at start) - steps run x slots parked at start
    (those stay parked: nothing resumes within a segment). A call's row then reaches the host
    without idling to a fixed segment's end, at most one host round trip's worth of slot-steps
    (`tool_rollout.run_tools` sets park_wait so) behind."""
    tools = state.tools
    ran = tools.steps - start.steps
    end = ran >= max_steps
    if park_wait is not None:
        waited = tools.parked_steps - start.parked_steps - ran * jnp.sum(start.parked, dtype=jnp.int32)
        parked_since = jnp.sum(tools.parked, dtype=jnp.int32) > jnp.sum(start.parked, dtype=jnp.int32)
        end = end | (parked_since & (waited >= park_wait))
    return end


@functools.partial(jax.jit, donate_argnums=(0,))
def tool_resume(state: EngineState, resume, tokens, count, refund) -> EngineState:
    """Resume parked slots: resume [D, S] bool; their rows' next count [D, S] response columns get
    tokens [D, S, K] int32 (the observation, forced: `Tools.mask`), the slot decodes on; refund
    [D, S] bool: the call did not count against max_turns (a trigger inside the code)."""
    slots, tools, out = state.slots, state.tools, state.out
    width = tokens.shape[-1]
    rows = jnp.where(resume, slots.row, -1)[..., None] + jnp.zeros((width,), jnp.int32)  # [D, S, K]
    column = slots.length[..., None] + jnp.arange(width, dtype=jnp.int32)
    rows = jnp.where(jnp.arange(width) < count[..., None], rows, -1)
    flat = lambda x: x.reshape(x.shape[0], -1)
    put = lambda a, v: _put2(a, flat(rows), flat(column), flat(v), unique=True)
    out = out._replace(tokens=put(out.tokens, tokens))
    tools = tools._replace(mask=put(tools.mask, jnp.ones(tokens.shape, bool)),
                           parked=tools.parked & ~resume, turns=tools.turns - (resume & refund).astype(jnp.int32))
    return state._replace(slots=slots._replace(live=slots.live | resume), tools=tools, out=out)


@functools.partial(jax.jit, static_argnames=("spec",))
def tool_result(state: EngineState, *, spec: EngineSpec) -> tuple[ProgramOutput, jax.Array]:
    """The call's rows (`rows_of_half`) and their tool mask [N, R] float32 (1 on forced tool tokens
    within each row's length)."""
    engine = _tool_engine(spec, state)
    out = rows_of_half(engine, state, 0)
    mask = engine.constrain_rows(state.tools.mask.reshape((-1,) + state.tools.mask.shape[2:]))
    return out, mask.astype(jnp.float32) * out.response_mask


# ------------------------------------------------------------------ partial rollouts (sampling/partial.py)
@functools.partial(jax.jit, static_argnames=("spec", "num_prompts", "prompt_len"))
def partial_init(pad_id, *, spec: EngineSpec, num_prompts: int, prompt_len: int) -> EngineState:
    """An empty engine for partial rollouts: two halves of `num_prompts` prompts of width `prompt_len`
    (rollout t in half t % 2), no rows enqueued."""
    max_new_tokens, shards = spec.max_new_tokens, spec.num_shards
    engine = Engine.resolve(spec, num_prompts=num_prompts, prompt_len=prompt_len, halves=2)
    zeros = lambda shape, dtype: engine.constrain_rows(jnp.zeros(shape, dtype))
    prompts, rows = engine.buffer_prompts, engine.buffer_rows
    queue = Queue(zeros((shards, prompts, prompt_len), jnp.int32), zeros((shards, prompts, prompt_len), jnp.int32),
                  jnp.zeros((shards, 1, 1), jnp.float32) if spec.greedy else zeros((shards, rows, max_new_tokens),
                                                                                   jnp.float32),
                  zeros((shards, rows), jnp.int32))
    return empty_state(engine, queue, jnp.zeros((shards,), jnp.int32), pad_id)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(0,))
def partial_enqueue(state: EngineState, prompt_tokens, prompt_mask, rng, row_budget, pad_id, *,
                    spec: EngineSpec) -> EngineState:
    """Append a rollout's P prompts [P, T] (all real) to the stream: their rows become admissible
    after the rows already enqueued. Row n draws its uniforms from (rng, n) (`filters.row_uniforms`),
    as `continuous_program` with first_row 0; row_budget [P*G]. The half it takes must have been
    handed out (`partial_segment`): at most two rollouts are in the engine at a time."""
    samples, max_new_tokens = spec.num_samples, spec.max_new_tokens
    shards, buffer_prompts = state.queue.tokens.shape[:2]
    prompts, rows = buffer_prompts // 2, buffer_prompts // 2 * samples  # a shard's prompts and rows per half
    constrain_rows = lambda x: spec.backend.constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    shard = lambda x: constrain_rows(x.reshape((shards, -1) + x.shape[1:]))
    half = (state.end[0] // rows) % 2
    put = lambda buffer, x, size: jax.lax.dynamic_update_slice_in_dim(buffer, x.astype(buffer.dtype), half * size,
                                                                      axis=1)
    queue = state.queue
    queue = Queue(put(queue.tokens, shard(prompt_tokens), prompts), put(queue.mask, shard(prompt_mask), prompts),
                  queue.uniforms if spec.greedy else put(queue.uniforms, shard(row_uniforms(
                      rng, 0, prompts * shards * samples, max_new_tokens)), rows),
                  put(queue.budget, shard(jnp.minimum(row_budget.astype(jnp.int32), max_new_tokens)), rows))
    out = state.out
    fill = lambda x, value, size=rows: put(x, jnp.full((shards, size) + x.shape[2:], value, x.dtype), size)
    out = Outputs(fill(out.tokens, pad_id), fill(out.logprobs, 0), fill(out.logprobs_untruncated, 0),
                  fill(out.length, 0), fill(out.eos_seen, False), fill(out.segment, -1),
                  fill(out.split, max_new_tokens),
                  None if out.routes is None else fill(out.routes, 0),
                  None if out.prompt_routes is None else fill(out.prompt_routes, 0, prompts))
    return state._replace(queue=queue, out=out, end=state.end + rows)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(1,))
def partial_segment(weights, state: EngineState, temperature, top_p, eos_ids, pad_id, min_p=None, stop_seqs=None, *,
                    spec: EngineSpec) -> tuple[EngineState, ProgramOutput, jax.Array, jax.Array]:
    """One segment of partial rollouts: decode with `weights` until the oldest rollout in the engine
    is complete, admitting the next rollout's rows (if enqueued) into slots its rows free; hand the
    oldest rollout out. Rows carried in from the previous segment continue under these weights
    from where they stopped (their KV cache as the earlier weights wrote it).

    Returns (state, ProgramOutput of the rollout [N = P*G rows], segment [N], split [N]): row n's
    tokens before split[n] were drawn in segment segment[n], the rest in segment[n] + 1 (a row
    spans at most two segments: a segment ends only when its rollout is complete, and the
    next rollout is the only one it admits from).
    """
    samples, shards = spec.num_samples, spec.num_shards
    buffer_prompts, prompt_len = state.queue.tokens.shape[1:]
    engine = Engine.resolve(spec, num_prompts=buffer_prompts // 2 * shards, prompt_len=prompt_len, halves=2)
    sampling = Sampling(temperature, top_p, eos_ids, pad_id, min_p, stop_seqs)
    rows, buffer_rows = engine.rows_per_shard, engine.buffer_rows
    slots, out = state.slots, state.out
    # tokens from here on are this segment's: of rows live in slots, and of rows whose first token an
    # earlier segment drew at its prompt's prefill, still waiting for a slot
    live_rows = jnp.where(slots.live, slots.row % buffer_rows, -1)
    split = _put(out.split, live_rows, slots.length)
    waiting = state.next_row[:, None] + jnp.arange(samples, dtype=jnp.int32)  # [D, G]
    prefilled = (waiting < -(-state.next_row // samples)[:, None] * samples) & (waiting < state.end[:, None])
    split = _put(split, jnp.where(prefilled, waiting % buffer_rows, -1), jnp.ones_like(waiting))
    state = state._replace(out=out._replace(split=split))
    end = (state.done + 1) * rows  # the oldest rollout's rows are the stream rows before it
    more = lambda state: jnp.any(state.slots.live & (state.slots.row < end)) | jnp.any(state.next_row < end)
    state = jax.lax.while_loop(more, functools.partial(refill_and_decode, engine, weights, sampling), state)
    half = state.done % 2
    rollout = rows_of_half(engine, state, half)
    per_row = lambda x: engine.constrain_rows(jax.lax.dynamic_slice_in_dim(x, half * rows, rows, axis=1)
                                              .reshape(shards * rows))
    segment, split = per_row(state.out.segment), per_row(state.out.split)
    return state._replace(segment=state.segment + 1, done=state.done + 1), rollout, segment, split
