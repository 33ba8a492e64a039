"""Next-token sampling: temperature, min-p, top-k, top-p (nucleus), greedy, and the log-probs of the choice.

    z = logits / T;  keep = min-p(z) ∩ top-k(z) ∩ nucleus_p(softmax(z | min-p ∩ top-k));  y ~ softmax(z | keep)
    min-p(z) = {v : p_v >= min_p * max_u p_u} = {v : z_v >= max z + log min_p}   (Nguyen et al. 2024)

Order as in vLLM's v1 sampler (vllm/v1/sample/sampler.py: temperature, then the argmax-invariant
min-p, then top-k and top-p): top-p sees the distribution that min-p and top-k kept. Min-p and
top-k commute (both keep the largest logits), so min-p is applied to top-k's candidates.
Two log-probs come back for every chosen token y:

    logprob             = log softmax(z | keep)[y]   (the distribution y was drawn from)
    logprob_untruncated = log softmax(z)[y]          (temperature only: what a trainer's
                                                      teacher-forced forward recomputes)

Built for decode speed on CPU, where sorts, TopK, cumsum, variadic argmax and per-token
random draws over [N, V] cost more than the LM head itself: the vocabulary is viewed as
[N, V/c, c] blocks (c ~ sqrt V), so a step makes two fused passes over the logits (block
maxima; block sums of exp) and works on small arrays after that. Sampling is by inverse CDF
with one uniform per row. All functions are pure and jit-able; `top_k`, `use_top_p` and
`greedy` are static, `temperature` and `top_p` may be traced.

With tensor parallelism the LM head's logits are split over the vocabulary (`VocabShards`):
top-k then runs on each shard's slice and one all-gather of n*k candidates per row replaces
the resharding XLA would do for a whole-row top-k (`split_vocab_top_k`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl4llm.kernels import exact as exact_numerics
from jaxrl4llm.kernels.top_k import top_k as kernel_top_k

# Candidate sets up to this size use sort-free O(K^2) nucleus masks and cumsums; larger
# ones (top-p over a big vocabulary without top-k) fall back to a full sort.
_PAIRWISE_MAX = 256


class TokenSample(NamedTuple):
    """tokens [N] int32; logprob, logprob_untruncated [N] float32 (see module docstring)."""

    tokens: jax.Array
    logprob: jax.Array
    logprob_untruncated: jax.Array


# ---------------------------------------------------------------------------- small pieces
def first_argmax(z: jax.Array) -> jax.Array:
    """argmax over the last axis (lowest index on ties) as max + min reductions. [..., K] -> [...] int32."""
    size = z.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    best = jnp.max(z, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(z >= best, iota, size), axis=-1), size - 1)


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    """cumsum over the last (short) axis as a matmul with an upper-triangular ones matrix (fast on CPU)."""
    m = x.shape[-1]
    upper = jnp.triu(jnp.ones((m, m), x.dtype))
    return jnp.einsum("...i,ij->...j", x, upper, precision=jax.lax.Precision.HIGHEST)


def _pick(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse CDF: min{i : sum_{j<=i} w_j >= u sum_j w_j}, never an index with w = 0.

    Args: weights [N, K] >= 0 (at least one > 0 per row); u [N, 1] in (0, 1]. Returns [N] int32.
    """
    k = weights.shape[-1]
    cum = _inclusive_cumsum(weights)
    last_nonzero = jnp.max(jnp.where(weights > 0, jnp.arange(k), 0), axis=-1)
    return jnp.minimum(jnp.sum(cum < u * cum[:, -1:], axis=-1), last_nonzero).astype(jnp.int32)


def open_uniform(key: jax.Array, shape) -> jax.Array:
    """u ~ U(0, 1] float32 of `shape` (never 0, so inverse CDF never lands on a p = 0 entry)."""
    return 1.0 - jax.random.uniform(key, shape, jnp.float32)


def row_uniforms(key: jax.Array, first_row, num_rows: int, num_steps: int) -> jax.Array:
    """u[n, t] ~ U(0, 1], [num_rows, num_steps]: row n's draws come from fold_in(key, first_row + n).

    A row's uniforms depend on its global index only, so sampling the rows in chunks
    (`generate(prompts_per_chunk=...)`) draws what one call over all rows draws.
    """
    rows = jnp.asarray(first_row, jnp.int32) + jnp.arange(num_rows, dtype=jnp.int32)
    return jax.vmap(lambda r: open_uniform(jax.random.fold_in(key, r), (num_steps,)))(rows)


def block_size_for_vocab(vocab: int) -> int:
    """c = the power of two >= sqrt(V) (at least 8): [N, V] is viewed as [N, ceil(V / c), c]."""
    return max(8, 1 << int(np.ceil(np.log2(np.sqrt(vocab)))))


def _blocks(x: jax.Array, block: int, fill) -> jax.Array:
    """[N, V] -> [N, ceil(V / block), block], the tail padded with `fill`."""
    n, v = x.shape
    pad = -v % block
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(n, (v + pad) // block, block)


def _gather_blocks(blocks: jax.Array, ids: jax.Array) -> jax.Array:
    """blocks [N, B, c], ids [N, K] -> [N, K, c]."""
    return jnp.take_along_axis(blocks, ids[:, :, None], axis=1)


# ---------------------------------------------------------------------------- nucleus
def top_p_keep(sorted_logits: jax.Array, top_p) -> jax.Array:
    """keep[i] = sum_{j<i} p_j < top_p, p = softmax(sorted_logits): the nucleus of a descending row.

    The most likely token is always kept; top_p >= 1 keeps every token (no float round-off
    dropping the tail).

    Args: sorted_logits [..., K] sorted descending (entries may be -inf); top_p scalar in (0, 1].
    Returns: [..., K] bool.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = _inclusive_cumsum(probs) - probs if probs.shape[-1] <= _PAIRWISE_MAX else jnp.cumsum(probs, -1) - probs
    return (mass_before < top_p) | (top_p >= 1.0)


def nucleus_keep(logits: jax.Array, top_p) -> jax.Array:
    """keep[i] = sum_j p_j [z_j > z_i] < top_p: the nucleus of an unsorted row, without a sort.

    Equals `top_p_keep` of the sorted row except that tokens tied with the boundary token
    are kept together. O(K^2) per row: for candidate sets of a few hundred tokens.
    Args: logits [N, K] (entries may be -inf); top_p scalar. Returns [N, K] bool.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    # one fused compare-select-sum pass (a [N, K, K] 0/1 matrix times probs is a batched
    # matrix-vector product that XLA:CPU runs on a slow path: 107 us against 84 us at K = 100)
    higher = logits[:, None, :] > logits[:, :, None]  # [N, i, j]: z_j > z_i
    mass_before = jnp.sum(jnp.where(higher, probs[:, None, :], 0.0), axis=-1)
    return ((mass_before < top_p) | (top_p >= 1.0)) & (logits > -jnp.inf)


# ---------------------------------------------------------------------------- min-p
def min_p_keep(logits: jax.Array, min_p) -> jax.Array:
    """keep[v] = p_v >= min_p * max_u p_u, p = softmax(logits): min-p sampling's set.

        p_v >= min_p * p_max  <=>  z_v >= max z + log(min_p)   (Nguyen et al. 2024, "Turning Up the Heat")

    Compared on logits (no softmax); the argmax is always kept, min_p = 0 keeps every finite entry.
    Args: logits [..., K] (temperature applied; entries may be -inf); min_p scalar in [0, 1].
    Returns: [..., K] bool.
    """
    z_max = jnp.max(logits, axis=-1, keepdims=True)
    return (logits >= z_max + jnp.log(jnp.asarray(min_p, jnp.float32))) & (logits > -jnp.inf)


# ---------------------------------------------------------------------------- top-k
def top_k_logits(z: jax.Array, k: int, *, use_kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row, descending, and their indices: ([N, k], [N, k] int32).

    With `use_kernel` (CPU only): the CPU kernel `kernels.top_k`, the same result as lax.top_k.

    Two levels for large V: the k largest lie in the k blocks with the largest maxima, so
    TopK runs over the V/c block maxima and then over the k*c entries of those blocks
    (c ~ sqrt(V / k) balances the two), not over all V entries. Ties go to the lower index, as
    in lax.top_k.
    """
    if use_kernel:
        return kernel_top_k(z, k)
    n, vocab = z.shape
    block = max(8, 1 << int(np.round(np.log2(np.sqrt(vocab / k)))))
    num_blocks = -(-vocab // block)
    if num_blocks <= 2 * k:
        values, ids = jax.lax.top_k(z, k)
        return values, ids.astype(jnp.int32)
    blocks = _blocks(z, block, -jnp.inf)
    block_max = jnp.max(blocks, axis=-1)
    _, best_blocks = jax.lax.top_k(block_max, k)  # [N, k]
    # in index order, so candidates run in id order and TopK's ties go to the lower id (lax.top_k's
    # answer: the blocks with the k best maxima, ties to the lower block, hold the k best entries)
    best_blocks = jnp.sort(best_blocks, axis=1)
    candidates = _gather_blocks(blocks, best_blocks).reshape(n, k * block)
    values, pos = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best_blocks, pos // block, axis=1) * block + pos % block
    return values, ids.astype(jnp.int32)


class VocabShards(NamedTuple):
    """Where logits [N, V] live on a mesh: the vocabulary split over mesh axis `vocab`, the rows
    over the mesh axes `rows` (those that do not divide N are dropped: rows replicated there)."""

    mesh: Mesh
    vocab: str
    rows: tuple[str, ...] = ()

    def splits(self, vocab_size: int) -> bool:
        """True if the vocabulary axis has n > 1 shards that divide `vocab_size` evenly."""
        n = self.mesh.shape[self.vocab]
        return n > 1 and vocab_size % n == 0


def split_vocab_top_k(z: jax.Array, k: int, shards: VocabShards) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`top_k_logits(z, k)` and log sum_v exp z_v for logits whose vocabulary is split n ways.

        shard i: (top-k of z_i with global ids, m_i = max z_i, s_i = sum exp(z_i - m_i))
        one all-gather of the n (2k + 2) numbers per row, then on every shard:
        top-k over the n*k candidates;  log_norm = M + log sum_i s_i exp(m_i - M),  M = max_i m_i

    Exactly lax.top_k of the whole row: a shard's candidates come in shard order, each descending
    with ties to the lower id, so a stable top-k over them keeps the lower global id on ties; every
    entry of the global top-k is in its own shard's top-k. The all-gather (int32: the float values
    travel bit-cast) is the only collective; the results are replicated over the vocab axis.

    Args: z [N, V] float32 (V a multiple of the vocab shards); k static, 1 <= k <= V.
    Returns: (values [N, k] float32 descending, ids [N, k] int32, log_norm [N] float32).
    """
    mesh, axis = shards.mesh, shards.vocab
    n, vocab = z.shape
    rows, size = [], 1
    for a in shards.rows:
        if a in mesh.shape and a != axis and n % (size * mesh.shape[a]) == 0:
            rows.append(a)
            size *= mesh.shape[a]
    rows = tuple(rows) or None
    as_int = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    as_float = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)

    def per_shard(zl):  # zl [n_local, V / shards]
        width = zl.shape[1]
        kl = min(k, width)
        values, ids = top_k_logits(zl, kl)
        ids = ids + jax.lax.axis_index(axis).astype(jnp.int32) * width
        m = jnp.max(zl, axis=-1, keepdims=True)
        s = jnp.sum(jnp.exp(zl - jnp.where(m > -jnp.inf, m, 0.0)), axis=-1, keepdims=True)
        packed = jnp.concatenate([as_int(values), ids, as_int(m), as_int(s)], axis=-1)  # [n_local, 2kl + 2]
        every = jax.lax.all_gather(packed, axis, axis=1)  # [n_local, shards, 2kl + 2]
        candidates = as_float(every[..., :kl]).reshape(every.shape[0], -1)
        candidate_ids = every[..., kl:2 * kl].reshape(every.shape[0], -1)
        m_all, s_all = as_float(every[..., 2 * kl]), as_float(every[..., 2 * kl + 1])  # [n_local, shards]
        top = jnp.max(m_all, axis=-1, keepdims=True)
        top = jnp.where(top > -jnp.inf, top, 0.0)
        log_norm = top[:, 0] + jnp.log(jnp.sum(s_all * jnp.exp(m_all - top), axis=-1))
        values, pos = jax.lax.top_k(candidates, k)
        return values, jnp.take_along_axis(candidate_ids, pos, axis=1), log_norm

    return jax.shard_map(per_shard, mesh=mesh, in_specs=P(rows, axis),
                         out_specs=(P(rows, None), P(rows, None), P(rows)), check_vma=False)(z)


# ---------------------------------------------------------------------------- the sampler
def sample_tokens(logits: jax.Array, key: jax.Array | None, *, temperature=1.0, top_k: int = 0, top_p=1.0,
                  use_top_p: bool = False, greedy: bool = False, uniform: jax.Array | None = None,
                  use_kernels: bool = False, shards: VocabShards | None = None, min_p=None,
                  exact: bool = False) -> TokenSample:
    """y ~ softmax(z | min-p ∩ top-k ∩ top-p), z = logits / temperature (greedy: y = argmax z, lowest index on ties).

    Args:
      logits: [N, V] float32.
      key: PRNG key for this step (one uniform per row); unused when `uniform` is given.
      temperature: scalar > 0 (for greedy it only scales the returned log-probs).
      top_k: static; 0 = off, else keep the k largest logits.
      top_p: scalar in (0, 1]; applied only when `use_top_p` (static) is True.
      greedy: static; take the argmax (its `logprob` is then the untruncated one).
      uniform: optional [N, 1] float32 in (0, 1], the row uniforms drawn in advance (the decode
        loop draws all steps' uniforms at once: no PRNG work inside the loop).
      use_kernels: static; top-k with the CPU kernel (`jaxrl4llm.kernels`; CPU programs only).
      shards: static; where the logits live on a mesh. With a vocabulary split n > 1 ways, greedy
        (top-1) or 0 < top_k < V, top-k and the log-normaliser run per shard plus one all-gather
        (`split_vocab_top_k`); otherwise (plain temperature sampling, top-p alone) ignored.
      min_p: None = off (the program is the one without min-p); else a scalar in [0, 1] (may be
        traced): keep p >= min_p * p_max (`min_p_keep`) before top-k and top-p. Greedy ignores it.
      exact: static; `model.numerics=exact`: z = logits * (1 / temperature) and the untruncated
        log-prob by `kernels.exact.token_logprobs`, as the trainer computes them (`models.causal_lm`).
    Returns: TokenSample of [N] arrays.
    """
    n, vocab = logits.shape
    if exact:
        z = logits.astype(jnp.float32) * (1.0 / jnp.asarray(temperature, jnp.float32))
    else:
        z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if shards is not None and shards.splits(vocab) and greedy:  # argmax = top-1, ties to the lower id
        values, ids, log_norm = split_vocab_top_k(z, 1, shards)
        lp = values[:, 0] - log_norm
        return TokenSample(ids[:, 0], lp, lp)
    if shards is not None and shards.splits(vocab) and 0 < top_k < vocab:
        u = open_uniform(key, (n, 1)) if uniform is None else uniform
        candidates, candidate_ids, log_norm = split_vocab_top_k(z, top_k, shards)
        tokens, lp, chosen = _sample_candidates(candidates, candidate_ids, u, top_p, use_top_p, sorted_desc=True,
                                                min_p=min_p)
        return TokenSample(tokens, lp, chosen - log_norm)
    block = block_size_for_vocab(vocab)
    zb = _blocks(z, block, -jnp.inf)  # [N, B, c]
    block_max = jnp.max(zb, axis=-1)  # pass 1 over the logits
    row_max = jnp.max(block_max, axis=-1, keepdims=True)
    block_sums = jnp.sum(jnp.exp(zb - row_max[:, :, None]), axis=-1)  # pass 2 (fused exp + sum)
    log_norm = row_max[:, 0] + jnp.log(jnp.sum(block_sums, axis=-1))
    untruncated = lambda tokens: jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - log_norm
    if exact:
        untruncated = lambda tokens: exact_numerics.token_logprobs(z, tokens)

    def finish(tokens):
        lp = untruncated(tokens)
        return TokenSample(tokens, lp, lp)

    if greedy:  # argmax: the first block holding the row max, then the first max inside it
        b = first_argmax(block_max)
        inside = _gather_blocks(zb, b[:, None])[:, 0]
        return finish((b * block + first_argmax(inside)).astype(jnp.int32))

    u = open_uniform(key, (n, 1)) if uniform is None else uniform
    k = min(top_k, vocab) if top_k > 0 else vocab
    if k == vocab and not use_top_p:  # plain temperature sampling: inverse CDF over blocks, then inside one
        if min_p is not None:  # the entries below max z + log min_p leave the blocks (`min_p_keep`)
            zb = jnp.where(min_p_keep(zb.reshape(n, -1), min_p).reshape(zb.shape), zb, -jnp.inf)
            block_sums = jnp.sum(jnp.exp(zb - row_max[:, :, None]), axis=-1)
        b = _pick(block_sums, u)
        inside = jnp.exp(_gather_blocks(zb, b[:, None])[:, 0] - row_max)
        before = jnp.take_along_axis(_inclusive_cumsum(block_sums) - block_sums, b[:, None], axis=1)
        v = (u * jnp.sum(block_sums, axis=-1, keepdims=True) - before) / jnp.sum(inside, axis=-1, keepdims=True)
        tokens = (b * block + _pick(inside, jnp.clip(v, 1e-30, 1.0))).astype(jnp.int32)
        if min_p is None:
            return finish(tokens)
        kept_norm = row_max[:, 0] + jnp.log(jnp.sum(block_sums, axis=-1))  # log sum_{v kept} exp z_v
        chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
        return TokenSample(tokens, chosen - kept_norm, untruncated(tokens))

    sorted_desc = True  # TopK output: top-p is a cumsum; the raw small vocabulary needs the pairwise mask
    if k < vocab:
        candidates, candidate_ids = top_k_logits(z, k, use_kernel=use_kernels)
    elif vocab <= _PAIRWISE_MAX:
        candidates, candidate_ids, sorted_desc = z, jax.lax.broadcasted_iota(jnp.int32, z.shape, 1), False
    else:  # top-p over a large vocabulary without top-k: full sort (slow path)
        candidates, candidate_ids = jax.lax.top_k(z, vocab)
    tokens, lp, _ = _sample_candidates(candidates, candidate_ids, u, top_p, use_top_p, sorted_desc=sorted_desc,
                                       min_p=min_p)
    return TokenSample(tokens, lp, untruncated(tokens))


def _sample_candidates(candidates, candidate_ids, u, top_p, use_top_p: bool, *, sorted_desc: bool, min_p=None):
    """y ~ softmax(candidates | min-p ∩ nucleus) by inverse CDF: (tokens [N] int32, log p(y | kept) [N], z_y [N]).

    candidates [N, K] float32 (descending if `sorted_desc`; they hold the row's largest logit, so
    min-p on them is min-p on the row), candidate_ids [N, K]; u [N, 1] in (0, 1]; min_p: None = off.
    """
    if min_p is not None:  # min-p (-inf entries keep their order at the end of a descending row)
        candidates = jnp.where(min_p_keep(candidates, min_p), candidates, -jnp.inf)
    if use_top_p:
        keep = top_p_keep(candidates, top_p) if sorted_desc else nucleus_keep(candidates, top_p)
        candidates = jnp.where(keep, candidates, -jnp.inf)
    weights = jnp.exp(candidates - jnp.max(candidates, axis=-1, keepdims=True))
    choice = _pick(weights, u)
    tokens = jnp.take_along_axis(candidate_ids, choice[:, None], axis=1)[:, 0].astype(jnp.int32)
    chosen = jnp.take_along_axis(candidates, choice[:, None], axis=1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(candidates, axis=-1), chosen


def allowed_tokens(logits: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0, min_p=0.0) -> jax.Array:
    """The support of the sampling distribution: mask[n, v] = 1 if v may be drawn. [N, V] bool.

    A reference (full sort) for tests and debugging, not used by the sampler.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    z = jnp.where(min_p_keep(z, min_p), z, -jnp.inf)
    order = jnp.argsort(-z, axis=-1)
    sorted_z = jnp.take_along_axis(z, order, axis=-1)
    keep_sorted = sorted_z > -jnp.inf
    if top_k > 0:
        kth = sorted_z[:, min(top_k, z.shape[-1]) - 1:min(top_k, z.shape[-1])]
        keep_sorted = keep_sorted & (sorted_z >= kth)
        sorted_z = jnp.where(keep_sorted, sorted_z, -jnp.inf)
    probs = jax.nn.softmax(sorted_z, axis=-1)
    keep_sorted = keep_sorted & ((jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1.0))
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)
