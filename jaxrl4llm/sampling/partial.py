"""Partial rollouts: one continuous engine carried across rollouts and policy versions.

    stream = PartialRollouts(graphdef, state, mesh=..., num_prompts=P, num_samples=G, max_new_tokens=R, ...)
    stream.enqueue(prompts_0, rng_0); stream.enqueue(prompts_1, rng_1)
    rollout_0, versions_0 = stream.segment(graphdef, state_v, version=v)   # 0 complete, 1 begun
    stream.enqueue(prompts_2, rng_2)
    rollout_1, versions_1 = stream.segment(graphdef, state_w, version=w)   # 1's begun rows finish under w

The continuous engine (`continuous.py`) holds two rollouts: a segment decodes until the older one
is complete and admits the newer one's rows into the slots its rows free, so the slots never
drain at a rollout's tail (its longest rows finish while the next rollout's rows decode beside
them). The rows of the newer rollout that are still decoding when the segment ends continue in
the next segment, under the weights that segment is given: an in-flight weight update, as in
verl's partial rollouts, AReaL and PipelineRL. Their KV cache is kept as the earlier weights wrote
it (PipelineRL and NeMo-RL keep it too; recomputing it would cost a prefill of every carried
row); the behaviour log-prob of each token is what its sampling distribution gave, so
importance weights against it are exact whichever weights wrote the cache.

A row spans at most two segments (a segment ends only when its rollout is complete, and it
admits rows of the next rollout only), so token j of row n was sampled by

    version(n, j) = first[n] if j < split[n] else second[n]           (`RowVersions`)

With the same weights in every segment, rollout t's rows are the rows `generate` samples for its
prompts with rng_t (row n's uniforms depend on (rng_t, n) only): a test holds the engines to it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl4llm.kernels.choice import DecodeAttention
from jaxrl4llm.models.causal_lm import CausalLM, merge
from jaxrl4llm.models.decode import DECODE_RULES
from jaxrl4llm.models.sharding import logical_to_spec
from jaxrl4llm.sampling.buckets import left_pad_prompts
from jaxrl4llm.sampling.continuous import (BURST, PAGE_SIZE, engine_spec_for, partial_enqueue, partial_init,
                                            partial_segment)
from jaxrl4llm.sampling.decode_loop import block_size_for, decode_backend, weights_program
from jaxrl4llm.sampling.decode_mesh import data_parallel_size
from jaxrl4llm.sampling.generate import use_cpu_kernels
from jaxrl4llm.sampling.rollout import Rollout
from jaxrl4llm.sampling.stops import apply_stop_strings, end_token_ids, stop_token_sequences


class RowVersions(NamedTuple):
    """Which policy versions sampled a rollout's rows, on the host: first, split, second [N] int;
    token j of row n came from version first[n] if j < split[n], else second[n]."""

    first: np.ndarray
    split: np.ndarray
    second: np.ndarray

    def token_versions(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(versions [2N], tokens [2N]): each row's two parts, the tokens each version sampled."""
        lengths = np.asarray(lengths, np.int64)
        head = np.minimum(self.split, lengths)
        return np.concatenate([self.first, self.second]), np.concatenate([head, lengths - head])


class PartialRollouts:
    """Rollouts of P prompts x G samples drawn by a continuous engine kept across calls (module docstring).

    Args: graphdef, state: the model (`generate`'s); mesh: the sampler's mesh (rows over its batch
    axes, P a multiple of their size); num_prompts: P per rollout; prompt_len: T, every prompt's
    padded width (fixed for the stream); slots: S (None: all rows of one rollout); the sampling
    settings as `generate` takes them (min_p, stop_token_ids, stop_strings and tokenizer too: a
    rollout's rows are cut at their stop strings when a segment hands it out); fetch: a global array's whole value on this host (default
    `jax.device_get`; a multi-host run passes `train.hosts.fetch`); record_routes: a mixture-of-experts
    model's rollouts carry the expert ids of their prompt and response tokens (`Rollout.routes`,
    `Rollout.prompt_routes`), a row's routes recorded by whichever segment fed its tokens, and kept
    with the engine's in-flight state (`host_state`) as its other outputs are.
    """

    def __init__(self, graphdef, state, *, num_prompts: int, num_samples: int, max_new_tokens: int, prompt_len: int,
                 eos_token_ids: Sequence[int], pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, mesh: Mesh | None = None, slots: int | None = None,
                 cpu_kernels: bool | None = None, kv_page_size: int = PAGE_SIZE, decode_burst: int = BURST,
                 paged_attention: str | DecodeAttention | None = None, fetch=None, min_p: float = 0.0,
                 stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
                 record_routes: bool = False):
        model = merge(graphdef, state)
        if not isinstance(model, CausalLM):
            raise TypeError(f"partial rollouts need a jaxrl4llm CausalLM (the continuous engine); got "
                            f"{type(model).__name__}")
        config = model.config
        dp = data_parallel_size(mesh)
        if num_prompts % dp:
            raise ValueError(f"partial rollouts: {num_prompts} prompts a rollout do not split over the sampler's "
                             f"{dp} data-parallel shards; make rollout.prompts_per_step a multiple of {dp}")
        if prompt_len + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt width {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}")
        use_kernels = use_cpu_kernels(cpu_kernels, mesh)
        self.fetch = fetch or (lambda x: np.asarray(jax.device_get(x)))
        self.config, self.mesh, self.greedy = config, mesh, bool(greedy or temperature <= 0)
        self.backend = decode_backend(config, mesh=mesh, use_kernels=use_kernels,
                                      block_size=block_size_for(max_new_tokens, config.num_kv_heads * config.head_dim))
        self.num_prompts, self.num_samples, self.max_new_tokens, self.prompt_len = (num_prompts, num_samples,
                                                                                    max_new_tokens, prompt_len)
        self.eos = end_token_ids(eos_token_ids, stop_token_ids)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings are matched on decoded text: pass tokenizer=")
        self.stop_strings, self.tokenizer = tuple(stop_strings), tokenizer
        self.traced = {} if min_p <= 0 or self.greedy else {"min_p": np.float32(min_p)}  # off: no min_p argument
        stop_seqs = stop_token_sequences(tokenizer, self.stop_strings)  # in-loop early stop (`stops`)
        if stop_seqs is not None:
            self.traced["stop_seqs"] = stop_seqs
        self.pad_token_id = int(pad_token_id)
        self.temperature = np.float32(temperature if temperature > 0 else 1.0)
        self.top_p = np.float32(top_p)
        self.spec = engine_spec_for(config, self.backend, mesh=mesh, num_prompts=num_prompts, num_samples=num_samples,
                                    max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p, greedy=self.greedy,
                                    use_kernels=use_kernels, slots=slots, page_size=kv_page_size, burst=decode_burst,
                                    requested_attention=paged_attention, record_routes=record_routes)
        state = partial_init(np.int32(pad_token_id), spec=self.spec, num_prompts=num_prompts, prompt_len=prompt_len)
        # committed to its devices, as every later state is (a segment's output): one program each
        self.state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
        self.enqueued = 0  # rollouts enqueued
        self.handed_out = 0  # rollouts a segment returned
        self.versions: list[int] = []  # the policy version of each segment so far

    def _put(self, a: np.ndarray):
        if self.mesh is None:
            return a
        return jax.device_put(a, NamedSharding(self.mesh, logical_to_spec(
            ("batch",) + (None,) * (a.ndim - 1), DECODE_RULES, shape=a.shape, mesh=self.mesh)))

    def enqueue(self, prompts: Sequence[Sequence[int]], rng: jax.Array,
                row_max_new_tokens: Sequence[int] | None = None) -> None:
        """Append a rollout: P token-id lists (each at most prompt_len long); its row n draws from (rng, n)."""
        if len(prompts) != self.num_prompts:
            raise ValueError(f"partial rollouts: a rollout has {self.num_prompts} prompts, got {len(prompts)}")
        if self.enqueued - self.handed_out >= 2:
            raise ValueError("partial rollouts: two rollouts are in the engine already; call segment() first")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) and (min(p) < 0 or max(p) >= vocab):
                raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")
        padded = left_pad_prompts(prompts, pad_token_id=self.pad_token_id, length=self.prompt_len,
                                  num_rows=self.num_prompts)
        rows = self.num_prompts * self.num_samples
        budget = np.full((rows,), self.max_new_tokens, np.int32) if row_max_new_tokens is None else \
            np.asarray(row_max_new_tokens, np.int32)
        if budget.shape != (rows,) or budget.min() < 1 or budget.max() > self.max_new_tokens:
            raise ValueError(f"row_max_new_tokens must hold {rows} values in [1, {self.max_new_tokens}]")
        self.state = partial_enqueue(self.state, self._put(padded.tokens), self._put(padded.mask), rng,
                                     self._put(budget), np.int32(self.pad_token_id), spec=self.spec)
        self.enqueued += 1

    def segment(self, graphdef, state, *, version: int) -> tuple[Rollout, RowVersions]:
        """Decode with the model (graphdef, state), policy `version`, until the oldest enqueued rollout is
        complete; returns it (arrays on device) and which versions sampled its tokens."""
        if self.enqueued == self.handed_out:
            raise ValueError("partial rollouts: no rollout enqueued; call enqueue() first")
        weights = weights_program(graphdef, state, config=self.config, backend=self.backend)
        self.versions.append(int(version))
        self.state, out, segment, split = partial_segment(weights, self.state, self.temperature, self.top_p, self.eos,
                                                          np.int32(self.pad_token_id), spec=self.spec, **self.traced)
        self.handed_out += 1
        segment, split = self.fetch(segment), self.fetch(split)
        by_segment = np.asarray(self.versions)  # a row's second segment is the one after its first
        first = by_segment[segment]
        second = by_segment[np.minimum(segment + 1, len(self.versions) - 1)]
        rollout = apply_stop_strings(Rollout(*out), self.tokenizer, self.stop_strings, self.pad_token_id,
                                     fetch=self.fetch)
        return rollout, RowVersions(first, split, second)

    # ------------------------------------------------------------------ checkpoints
    def host_state(self, fetch) -> tuple[dict, dict]:
        """(arrays, metadata) of the engine between segments, for a checkpoint: arrays {"i": np.ndarray}
        (the engine state's leaves, whole, via `fetch`), metadata {enqueued, handed_out, versions}."""
        leaves = jax.tree.leaves(self.state)
        return ({str(i): fetch(x) for i, x in enumerate(leaves)},
                {"enqueued": self.enqueued, "handed_out": self.handed_out, "versions": list(self.versions)})

    def restore(self, arrays: dict, meta: dict) -> None:
        """Inverse of `host_state` on an engine built with the same settings: its arrays placed as the
        empty engine's are."""
        leaves, tree = jax.tree.flatten(self.state)
        if len(arrays) != len(leaves):
            raise ValueError(f"the checkpoint's sampler state has {len(arrays)} arrays, this engine {len(leaves)}: "
                             f"the rollout settings changed since it was saved")
        placed = []
        for i, leaf in enumerate(leaves):
            a = np.asarray(arrays[str(i)])
            if a.shape != leaf.shape:
                raise ValueError(f"the checkpoint's sampler state array {i} is {a.shape}, this engine's {leaf.shape}: "
                                 f"the rollout settings changed since it was saved")
            placed.append(jax.device_put(a.astype(leaf.dtype), leaf.sharding))
        self.state = jax.tree.unflatten(tree, placed)
        self.enqueued, self.handed_out = int(meta["enqueued"]), int(meta["handed_out"])
        self.versions = [int(v) for v in meta["versions"]]
