"""The sampler for any NNX causal LM (the bring-your-own protocol, docs/models.md): no KV cache.

    y_t ~ pi(. | prompt, y_<t) = sample(model(tokens_[:T+t], positions, mask)[T-1+t])

Each step runs the model's `__call__` over the whole [N, T + R] buffer (prompt + the tokens
generated so far; later slots are masked out and causal attention never sees them) and reads
the logits at the last filled slot: R full forwards instead of one prefill and R one-token
steps, so it costs O(R) times our KV-cache decoder (`decode_loop.py`). It needs nothing of the
model beyond `__call__(tokens, positions, attention_mask) -> logits`, and draws with the same
`sample_tokens` and the same per-row uniforms, so a model sampled both ways gives the same rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm.models.causal_lm import merge, positions_from_mask
from jaxrl4llm.sampling.decode_loop import DecodeState, ProgramOutput, constrain_rows, record_step
from jaxrl4llm.sampling.filters import row_uniforms, sample_tokens


@functools.partial(jax.jit, static_argnames=("graphdef", "num_samples", "max_new_tokens", "top_k", "use_top_p",
                                             "greedy", "mesh"))
def generic_sample_program(graphdef, state, prompt_tokens, prompt_mask, row_valid, rng, first_row, temperature, top_p, eos_ids,
                           pad_id, min_p=None, *, num_samples: int, max_new_tokens: int, top_k: int, use_top_p: bool, greedy: bool,
                           mesh: Mesh | None) -> ProgramOutput:
    """`decode_loop.sample_program` for a model known only by its `__call__` (shapes there).

    Args: graphdef, state: the NNX model; prompt_tokens, prompt_mask [P, T] left-padded;
      row_valid [P]; the rest as `sample_program`.
    """
    g, r = num_samples, max_new_tokens
    num_prompts, t = prompt_tokens.shape
    num_rows = num_prompts * g
    model = merge(graphdef, state)
    rows = lambda a: constrain_rows(jnp.repeat(a, g, axis=0), mesh)
    tokens = jnp.concatenate([rows(prompt_tokens), jnp.full((num_rows, r), pad_id, jnp.int32)], axis=1)
    mask = jnp.concatenate([rows(prompt_mask.astype(jnp.int32)), jnp.zeros((num_rows, r), jnp.int32)], axis=1)
    sample = functools.partial(sample_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               use_top_p=use_top_p, greedy=greedy, min_p=min_p)
    uniforms = None if greedy else constrain_rows(row_uniforms(rng, first_row, num_rows, r), mesh)
    zeros = lambda dtype: constrain_rows(jnp.zeros((num_rows, r), dtype), mesh)
    state0 = DecodeState(
        t=jnp.zeros((), jnp.int32), token=jnp.zeros((num_rows,), jnp.int32),
        done=constrain_rows(jnp.repeat(~row_valid, g), mesh), eos_seen=jnp.zeros((num_rows,), bool),
        length=jnp.zeros((num_rows,), jnp.int32), tokens=zeros(jnp.int32) + pad_id, logprobs=zeros(jnp.float32),
        logprobs_untruncated=zeros(jnp.float32))

    def cond(carry):
        s, _, _ = carry
        return (s.t < r) & ~jnp.all(s.done)

    def body(carry):
        s, tokens, mask = carry
        logits = model(tokens, positions_from_mask(mask), mask)  # [N, T + R, V]
        last = jax.lax.dynamic_index_in_dim(logits, t - 1 + s.t, axis=1, keepdims=False).astype(jnp.float32)
        u = None if greedy else jax.lax.dynamic_slice_in_dim(uniforms, s.t, 1, axis=1)
        live = ~s.done
        s = record_step(s, sample(last, None, uniform=u), eos_ids, pad_id, num_rows)
        column = (jnp.zeros((), jnp.int32), t + s.t - 1)
        tokens = jax.lax.dynamic_update_slice(tokens, s.token[:, None], column)
        mask = jax.lax.dynamic_update_slice(mask, live.astype(jnp.int32)[:, None], column)
        return s, tokens, mask

    final, _, _ = jax.lax.while_loop(cond, body, (state0, tokens, mask))
    steps = jnp.arange(r, dtype=jnp.int32)
    return ProgramOutput(
        prompt_tokens=rows(prompt_tokens), prompt_mask=rows(prompt_mask).astype(jnp.float32),
        response_tokens=final.tokens, response_mask=(steps[None, :] < final.length[:, None]).astype(jnp.float32),
        logprobs=final.logprobs, logprobs_untruncated=final.logprobs_untruncated, lengths=final.length,
        truncated=~final.eos_seen)
