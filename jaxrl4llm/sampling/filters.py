"""Next-token sampling: temperature, top-k, top-p (nucleus), greedy, and the log-probs of the choice.

    z = logits / T;  keep = top-k(z) ∩ nucleus_p(softmax(z));  y ~ softmax(z | keep)

Order as in transformers and vLLM: temperature, then top-k, then top-p on what top-k kept.
Two log-probs come back for every chosen token y:

    logprob             = log softmax(z | keep)[y]   (the distribution y was drawn from)
    logprob_untruncated = log softmax(z)[y]          (temperature only: what a trainer's
                                                      teacher-forced forward recomputes)

All functions are pure and jit-able; `top_k` and `greedy` are static (they fix shapes and
branches), `temperature` and `top_p` may be traced.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TokenSample(NamedTuple):
    """tokens [N] int32; logprob, logprob_untruncated [N] float32 (see module docstring)."""

    tokens: jax.Array
    logprob: jax.Array
    logprob_untruncated: jax.Array


def top_p_keep(sorted_logits: jax.Array, top_p) -> jax.Array:
    """keep[i] = sum_{j<i} p_j < top_p, p = softmax(sorted_logits): the nucleus of a descending row.

    The most likely token is always kept; top_p >= 1 keeps every token (no float round-off
    dropping the tail).

    Args: sorted_logits [..., K] sorted descending (entries may be -inf); top_p scalar in (0, 1].
    Returns: [..., K] bool.
    """
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return (mass_before < top_p) | (top_p >= 1.0)


def first_argmax(z: jax.Array) -> jax.Array:
    """argmax over the last axis (lowest index on ties) as two plain reductions. [N, V] -> [N] int32.

    (XLA:CPU's variadic argmax reduction is several times slower than max + min.)
    """
    vocab = z.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    best = jnp.max(z, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(z >= best, iota, vocab), axis=-1), vocab - 1)


def _blocks(x: jax.Array, block: int, fill) -> jax.Array:
    """[N, V] -> [N, ceil(V / block), block], the tail padded with `fill`."""
    n, v = x.shape
    pad = -v % block
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(n, (v + pad) // block, block)


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    """cumsum over the last (short) axis as a matmul with an upper-triangular ones matrix (fast on CPU)."""
    m = x.shape[-1]
    upper = jnp.triu(jnp.ones((m, m), x.dtype))
    return jnp.einsum("...i,ij->...j", x, upper, precision=jax.lax.Precision.HIGHEST)


def inverse_cdf_sample(z: jax.Array, key: jax.Array) -> jax.Array:
    """y ~ softmax(z) per row by inverse CDF: y = min{i : sum_{j<=i} p_j >= u * sum_j p_j}, u ~ U(0, 1].

    Two levels (block sums, then the chosen block) so no [N, V] cumsum or [N, V] random
    draw is needed: one uniform per row and a few passes over the logits.
    Args: z [N, V] float32 (entries may be -inf); key. Returns [N] int32 (never a p = 0 token).
    """
    n, vocab = z.shape
    block = max(8, 1 << int(np.ceil(np.log2(np.sqrt(vocab)))))
    probs = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    blocks = _blocks(probs, block, 0.0)  # [N, B, c]
    block_sums = jnp.sum(blocks, axis=-1)  # [N, B]
    cum_blocks = _inclusive_cumsum(block_sums)
    x = (1.0 - jax.random.uniform(key, (n, 1), jnp.float32)) * cum_blocks[:, -1:]
    num_blocks = blocks.shape[1]
    nonempty = jnp.max(jnp.where(block_sums > 0, jnp.arange(num_blocks), 0), axis=-1)
    b = jnp.minimum(jnp.sum(cum_blocks < x, axis=-1), nonempty)  # [N]
    within = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [N, c]
    before = jnp.take_along_axis(cum_blocks - block_sums, b[:, None], axis=1)
    cum_within = _inclusive_cumsum(within)
    last = jnp.max(jnp.where(within > 0, jnp.arange(block), 0), axis=-1)
    i = jnp.minimum(jnp.sum(cum_within < x - before, axis=-1), last)
    return (b * block + i).astype(jnp.int32)


def top_k_logits(z: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row, descending, and their indices: ([N, k], [N, k] int32).

    Two levels for large V: the k largest lie in the k blocks with the largest maxima, so
    TopK runs over the block maxima and then over k blocks, not over all V entries.
    """
    n, vocab = z.shape
    block = max(8, 1 << int(np.round(np.log2(np.sqrt(vocab / k))))) if vocab >= 16 * k else vocab
    if block >= vocab or -(-vocab // block) <= k:
        values, ids = jax.lax.top_k(z, k)
        return values, ids.astype(jnp.int32)
    blocks = _blocks(z, block, -jnp.inf)  # [N, B, c]
    _, best_blocks = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [N, k]
    candidates = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1).reshape(n, k * block)
    values, pos = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best_blocks, pos // block, axis=1) * block + pos % block
    return values, ids.astype(jnp.int32)


def sample_tokens(logits: jax.Array, key: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0,
                  use_top_p: bool = False, greedy: bool = False) -> TokenSample:
    """y ~ softmax(z | top-k ∩ top-p), z = logits / temperature (greedy: y = argmax z).

    Args:
      logits: [N, V] float32.
      key: PRNG key for this step.
      temperature: scalar > 0 (ignored for the choice when greedy, still used for the log-probs).
      top_k: static; 0 = off, else keep the k largest logits.
      top_p: scalar in (0, 1]; applied only when `use_top_p` (static) is True.
      greedy: static; take the argmax (its `logprob` is then the untruncated one).
    Returns: TokenSample of [N] arrays.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    log_norm = jax.nn.logsumexp(z, axis=-1)
    untruncated = lambda tokens: jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - log_norm
    vocab = z.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else (vocab if use_top_p else 0)
    if greedy or k == 0:  # argmax, or plain temperature sampling over the whole vocabulary
        tokens = first_argmax(z) if greedy else inverse_cdf_sample(z, key)
        lp = untruncated(tokens)
        return TokenSample(tokens, lp, lp)

    candidates, candidate_ids = top_k_logits(z, k) if k < vocab else jax.lax.top_k(z, k)  # [N, k] descending
    if use_top_p:
        candidates = jnp.where(top_p_keep(candidates, top_p), candidates, -jnp.inf)
    choice = jax.random.categorical(key, candidates, axis=-1)
    tokens = jnp.take_along_axis(candidate_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    chosen = jnp.take_along_axis(candidates, choice[:, None], axis=-1)[:, 0]
    lp = chosen - jax.nn.logsumexp(candidates, axis=-1)
    return TokenSample(tokens, lp, untruncated(tokens))


def allowed_tokens(logits: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
    """The support of the sampling distribution: mask[n, v] = 1 if v may be drawn. [N, V] bool.

    A reference (full sort, host-friendly) for tests and debugging, not used by the sampler.
    Ties at the k-th value are all allowed here (a superset of what `sample_tokens` keeps).
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    order = jnp.argsort(-z, axis=-1)
    sorted_z = jnp.take_along_axis(z, order, axis=-1)
    keep_sorted = jnp.ones_like(sorted_z, dtype=bool)
    if top_k > 0:
        kth = sorted_z[:, min(top_k, z.shape[-1]) - 1:min(top_k, z.shape[-1])]
        keep_sorted = sorted_z >= kth
        sorted_z = jnp.where(keep_sorted, sorted_z, -jnp.inf)
    keep_sorted = keep_sorted & top_p_keep(sorted_z, top_p)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)
