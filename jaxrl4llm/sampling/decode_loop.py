"""The sampler's device program: prefill, then a `lax.while_loop` of decode steps, all in one jit.

    y_0 ~ pi(. | prompt);   y_t ~ pi(. | prompt, y_<t)   for t < R, until every row has emitted EOS

One compiled program per (config, prompt bucket, batch bucket, G, R, top_k, flags, mesh).
The generated-token KV cache is preallocated in `num_blocks` blocks; block j is filled by
the j-th while_loop (its buffer is the loop carry, updated in place by dynamic_update_slice)
and attended to by every later step, so step t reads O(t) cache (see models/decode.py).
Each while_loop exits as soon as every row is done, and later loops then run zero times.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from flax import nnx

from jaxrl4llm.kernels import exact
from jaxrl4llm.kernels.native import bf16_pairs as kernel_bf16_pairs
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decode import (DECODE_RULES, DecodeBackend, decode_step, decode_weight_shardings, decode_weights,
                                     empty_block, prefill)
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.models.lora import merge_lora
from jaxrl4llm.models.sharding import logical_to_spec
from jaxrl4llm.sampling.decode_backends import CpuBackend, ExactBackend
from jaxrl4llm.sampling.decode_mesh import vocab_shards
from jaxrl4llm.sampling.filters import row_uniforms, sample_tokens
from jaxrl4llm.sampling.stops import ends_with_stop_sequence, last_tokens


class DecodeState(NamedTuple):
    """Loop carry. t: index of the next response token; token/done/eos_seen/length [N];
    tokens/logprobs/logprobs_untruncated [N, R]."""

    t: jax.Array
    token: jax.Array
    done: jax.Array
    eos_seen: jax.Array
    length: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array


class ProgramOutput(NamedTuple):
    """Device outputs over all N_pad = P_pad * G rows (padding rows included)."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    response_tokens: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    routes: jax.Array | None = None  # the continuous engine's recorded routes (`rollout.Rollout`)
    prompt_routes: jax.Array | None = None


def block_size_for(max_new_tokens: int, kv_width: int, *, max_blocks: int = 4, min_block: int = 32,
                   min_block_elements: int = 4096) -> int:
    """Generated-KV block size: blk = max(min_block, min_block_elements / kv_width, ceil((R-1) / max_blocks)),
    rounded up to 8. kv_width = KVH * Dh, a slot's keys per row and layer.

    R-1 slots hold the keys of response tokens 0..R-2 (the last token is never fed back).
    More blocks = less cache read per step but one more compiled copy of the step body, and
    per step one more pair of batched attention matmuls per layer, each costing a fixed
    N*KVH small products: with narrow KV (a tiny model) that fixed cost dominates, so a block
    holds at least `min_block_elements` keys per row (8x8 rows, R = 128: 64-slot blocks took
    1.11-1.18 ms per step against 1.27-1.37 ms for 32-slot ones at KVH * Dh = 64; at
    KVH * Dh = 256, 32 slots beat 64: 43.1 against 45.5 ms).
    """
    slots = max(max_new_tokens - 1, 1)
    blk = max(min_block, -(-min_block_elements // max(kv_width, 1)), -(-slots // max_blocks))
    return -(-blk // 8) * 8


def constrain_rows(x, mesh: Mesh | None):
    """x with its leading axis (rows) on the decode layout's "batch" rule over `mesh` (the rows
    split over its data-parallel axes, `models.decode.DECODE_RULES`); x itself without a mesh."""
    if mesh is None:
        return x
    spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), DECODE_RULES, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def record_step(state: DecodeState, sample, eos_ids, pad_id, num_rows: int, budget=None,
                stop_seqs=None) -> DecodeState:
    """Write step t's sample into column t (pad / 0 for rows already done) and advance t; a row
    whose length reaches its budget [N] (optional) is done, and one whose last tokens spell a stop
    string (stop_seqs [S, L], optional: `stops.stop_token_sequences`) ends as at an EOS."""
    live = ~state.done
    token = jnp.where(live, sample.tokens, pad_id).astype(jnp.int32)
    is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1) & live
    column = lambda buf, col: jax.lax.dynamic_update_slice(buf, col[:, None].astype(buf.dtype),
                                                           (jnp.zeros((), jnp.int32), state.t))
    tokens = column(state.tokens, token)
    if stop_seqs is not None:
        window = last_tokens(tokens, jnp.broadcast_to(state.t, (num_rows,)), stop_seqs.shape[1])
        is_eos = is_eos | (ends_with_stop_sequence(window, stop_seqs) & live)
    zero = jnp.zeros((num_rows,), jnp.float32)
    length = state.length + live.astype(jnp.int32)
    done = state.done | is_eos
    return DecodeState(
        t=state.t + 1,
        token=token,
        done=done if budget is None else done | (length >= budget),
        eos_seen=state.eos_seen | is_eos,
        length=length,
        tokens=tokens,
        logprobs=column(state.logprobs, jnp.where(live, sample.logprob, zero)),
        logprobs_untruncated=column(state.logprobs_untruncated, jnp.where(live, sample.logprob_untruncated, zero)),
    )


def decode_backend(config: ModelConfig, *, mesh: Mesh | None, use_kernels: bool, block_size: int) -> DecodeBackend:
    """The decode backend of one sampler call: `decode_backends.CpuBackend` on CPU (16-bit moves as
    bits; with `use_kernels`, the C++ kernels and, on their AVX512-BF16 paths, packed weights and
    the pair KV layout), the platform-neutral `DecodeBackend` elsewhere; `decode_backends.ExactBackend`
    under model.numerics=exact (one device)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if config.numerics == "exact":
        exact.require(devices)
        return ExactBackend()
    if {d.platform for d in devices} != {"cpu"}:
        return DecodeBackend(mesh=mesh)
    packed = use_kernels and jnp.dtype(config.dtype) == jnp.bfloat16 and kernel_bf16_pairs()
    pairs = packed and config.head_dim % 2 == 0 and block_size % 2 == 0
    return CpuBackend(mesh=mesh, kernels=use_kernels, packed=packed, pairs=pairs)


def weights_program(graphdef: nnx.GraphDef, state, *, config: ModelConfig, backend: DecodeBackend):
    """The model state (any dtype/sharding, LoRA adapters merged in) -> the decode weights
    (`models.decode.decode_weights` in the backend's layout, on the backend's mesh).

    A separate program so that its outputs reach `sample_program` as row-major buffers in the
    output-major layout it chose. Inside one program XLA folds the transposes back into the
    dots (the loop then multiplies by input-major weights, measured slower on CPU).
    One jitted program per (graphdef, config, backend, state tree), in `WEIGHTS_PROGRAMS`.
    """
    return weights_jit(graphdef, state, config=config, backend=backend)(state)


WEIGHTS_PROGRAMS: dict = {}


def weights_jit(graphdef: nnx.GraphDef, state, *, config: ModelConfig, backend: DecodeBackend):
    """`weights_program`'s jitted function for this state's tree (`.lower(state)` compiles it
    ahead of time), with out_shardings on the backend's mesh (`models.decode.decode_weight_shardings`)."""
    key = (graphdef, config, backend, jax.tree.structure(state))
    if key not in WEIGHTS_PROGRAMS:
        WEIGHTS_PROGRAMS[key] = _build_weights_jit(graphdef, state, config, backend)
    return WEIGHTS_PROGRAMS[key]


def _build_weights_jit(graphdef: nnx.GraphDef, state, config: ModelConfig, backend: DecodeBackend):
    def build(state):
        _, plain = merge_lora(graphdef, state)
        return decode_weights(plain, config, backend)

    out_shardings = None
    if backend.mesh is not None:
        plain = jax.eval_shape(lambda s: merge_lora(graphdef, s)[1], state)
        out_shardings = decode_weight_shardings(plain, config, backend)
    return jax.jit(build, out_shardings=out_shardings)


@functools.partial(
    jax.jit,
    static_argnames=("config", "num_samples", "max_new_tokens", "top_k", "use_top_p", "greedy", "block_size", "backend",
                     "use_kernels"),
)
def sample_program(weights, prompt_tokens, prompt_mask, row_valid, rng, first_row, temperature, top_p, eos_ids, pad_id,
                   row_budget=None, min_p=None, stop_seqs=None, *,
                   config: ModelConfig, num_samples: int, max_new_tokens: int, top_k: int, use_top_p: bool,
                   greedy: bool, block_size: int, backend: DecodeBackend,
                   use_kernels: bool = False) -> ProgramOutput:
    """Sample `num_samples` responses of up to `max_new_tokens` tokens for each left-padded prompt.

    Args:
      weights: `weights_program(...)`: the decode weights (cast, fused, output-major, resharded).
      prompt_tokens, prompt_mask [P, T] int32 (left-padded; mask 1 = real); row_valid [P] bool.
      rng: PRNG key; row n draws its R uniforms U(0, 1] from fold_in(rng, first_row + n)
        (`filters.row_uniforms`), so chunks of rows sample what one call over all rows does.
      first_row: int32 scalar, the global index of this call's first row.
      temperature, top_p: float32 scalars.
      eos_ids [E] int32; pad_id int32 scalar.
      row_budget: optional [N] int32, row n stops after row_budget[n] tokens (truncated unless its
        last token is an EOS): per-row response budgets, e.g. a benchmark's forced lengths.
      min_p: optional float32 scalar, min-p sampling (`filters.min_p_keep`); None = off (the
        program without it).
      stop_seqs: optional [S, L] int32, stop strings' token spellings (`stops.stop_token_sequences`):
        a row whose last tokens spell one ends there, as at an EOS; None = off (the program without it).
      backend: the decode backend (`decode_backend`; the same one `weights_program` used).
      use_kernels: top-k with the CPU kernel (`jaxrl4llm.kernels`; the caller checks that the
        program runs on CPU and that they are loaded).
    Returns: ProgramOutput with N = P * num_samples rows, R = max_new_tokens.
    """
    g, r = num_samples, max_new_tokens
    num_rows = prompt_tokens.shape[0] * g
    mesh = backend.mesh
    first_logits, prompt_kv = prefill(weights, config, prompt_tokens, prompt_mask, backend=backend)
    sample = functools.partial(sample_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               use_top_p=use_top_p, greedy=greedy, use_kernels=use_kernels,
                               shards=vocab_shards(mesh, backend.rules), min_p=min_p)
    prompt_len = constrain_rows(jnp.repeat(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32), g), mesh)
    padding_row = constrain_rows(jnp.repeat(~row_valid, g), mesh)
    zeros = lambda dtype: constrain_rows(jnp.zeros((num_rows, r), dtype), mesh)
    state = DecodeState(
        t=jnp.zeros((), jnp.int32),
        token=jnp.zeros((num_rows,), jnp.int32),
        done=padding_row,
        eos_seen=jnp.zeros((num_rows,), bool),
        length=jnp.zeros((num_rows,), jnp.int32),
        tokens=zeros(jnp.int32) + pad_id,
        logprobs=zeros(jnp.float32),
        logprobs_untruncated=zeros(jnp.float32),
    )
    # Every step's row uniforms drawn up front (u[n, t] in (0, 1]): no PRNG work in the loop.
    column = lambda a, t: jax.lax.dynamic_slice_in_dim(a, t, 1, axis=1)  # [N, R, ...] -> step t's [N, 1, ...]
    uniforms = None if greedy else constrain_rows(row_uniforms(rng, first_row, num_rows, r), mesh)
    step_uniform = lambda t: None if greedy else column(uniforms, t)
    first = sample(constrain_rows(jnp.repeat(first_logits, g, axis=0), mesh), None, uniform=step_uniform(0))
    budget = None if row_budget is None else constrain_rows(row_budget.astype(jnp.int32), mesh)
    state = record_step(state, first, eos_ids, pad_id, num_rows, budget, stop_seqs)

    # rotary tables of every step's input position (prompt_len + t - 1) up front: no cos/sin in the loop
    cos, sin = (constrain_rows(a, mesh) for a in
                rope_tables(config, prompt_len[:, None] + jnp.arange(r, dtype=jnp.int32)[None, :] - 1))
    step_rope = lambda t: (column(cos, t), column(sin, t))
    num_blocks = -(-(r - 1) // block_size)
    done_blocks = []
    for j in range(num_blocks):
        block_end = (j + 1) * block_size  # slots [j*blk, (j+1)*blk) hold response tokens t-1

        def cond(carry, block_end=block_end):
            state, _ = carry
            return (state.t < r) & (state.t - 1 < block_end) & ~jnp.all(state.done)

        def body(carry, j=j, done_blocks=tuple(done_blocks)):
            state, block = carry
            slot = state.t - 1 - j * block_size
            logits, block = decode_step(weights, config, state.token, step_rope(state.t), prompt_kv,
                                        list(done_blocks), block, slot, backend=backend)
            return record_step(state, sample(logits, None, uniform=step_uniform(state.t)), eos_ids, pad_id, num_rows,
                               budget, stop_seqs), block

        block = empty_block(config, num_rows, block_size, backend=backend)
        state, block = jax.lax.while_loop(cond, body, (state, block))
        if j + 1 < num_blocks:  # the last block is never attended to again
            done_blocks.append(backend.seal(block))

    steps = jnp.arange(r, dtype=jnp.int32)
    return ProgramOutput(
        prompt_tokens=constrain_rows(jnp.repeat(prompt_tokens, g, axis=0), mesh),
        prompt_mask=constrain_rows(jnp.repeat(prompt_mask, g, axis=0).astype(jnp.float32), mesh),
        response_tokens=state.tokens,
        response_mask=(steps[None, :] < state.length[:, None]).astype(jnp.float32),
        logprobs=state.logprobs,
        logprobs_untruncated=state.logprobs_untruncated,
        lengths=state.length,
        truncated=~state.eos_seen,
    )
