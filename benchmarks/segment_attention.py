"""One attention layer's forward + backward on this CPU: the block-causal "xla" backend of
`segment_causal_attention` (segment ids, flash attention in XLA loops) against today's dense masked
attention (`attention.dot_product_attention` on a [B, T, T] mask, in query chunks of 1024), same run.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/segment_attention.py [--rows 2] [--lengths 1024,2048,4096]
        [--blocks 256,512,1024] [--segment-tokens 256] [--reps 3]

Heads as vs_trl.py's 48M Qwen3 (H 8, KVH 4, Dh 64), bf16 matmul inputs. The loss is sum(out * w)
and its gradient with respect to q, k, v. Per row length: the median wall seconds of each side,
the ratio dense / block-causal (> 1: the new path is faster), and XLA's temporaries. Rows are
packed with 3 sequences (T/2, T/4, T/4) or, with --segment-tokens, with sequences of that many
tokens: the block-causal path then also skips the key blocks before each query block's sequences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.models.layers.attention import causal_padding_mask, dot_product_attention  # noqa: E402
from jaxrl4llm.models.layers.segment_attention import segment_causal_attention  # noqa: E402

H, KVH, DH = 8, 4, 64


def temp_mib(fn, args) -> float:
    """XLA's temporary bytes of the compiled program, MiB."""
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def median_seconds(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--blocks", default="128,256")
    ap.add_argument("--segment-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dtype = jnp.bfloat16
    layout = f"sequences of {args.segment_tokens} tokens" if args.segment_tokens else "3 sequences (T/2, T/4, T/4)"
    print(f"rows {args.rows} packed with {layout}, H {H}, KVH {KVH}, Dh {DH}, bf16 matmuls; seconds of forward + "
          f"backward (median of {args.reps})")
    for t in (int(x) for x in args.lengths.split(",")):
        rng = np.random.default_rng(0)
        q, w = (jnp.asarray(rng.standard_normal((args.rows, t, H, DH)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((args.rows, t, KVH, DH)), jnp.float32) for _ in range(2))
        lengths = [t // 2, t // 4, t - t // 2 - t // 4] if not args.segment_tokens else \
            [args.segment_tokens] * (t // args.segment_tokens) + [t % args.segment_tokens]
        ids = jnp.asarray(np.tile(np.repeat(np.arange(1, len(lengths) + 1), lengths), (args.rows, 1)))

        def dense(q, k, v, ids):
            mask = causal_padding_mask(jnp.ones_like(ids)) & (ids[:, :, None] == ids[:, None, :])
            return dot_product_attention(q, k, v, mask, dtype, query_chunk=1024)

        grad = lambda attention: jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, ids) * w), (0, 1, 2)))
        base = median_seconds(grad(dense), (q, k, v), args.reps)
        line = f"T {t:5d}: dense (query chunks of 1024) {base:.3f} s, {temp_mib(grad(dense), (q, k, v)):.0f} MiB"
        for block in (int(x) for x in args.blocks.split(",")):
            attention = lambda q, k, v, ids, block=block: segment_causal_attention(q, k, v, ids, dtype=dtype,
                                                                                   impl="xla", block=block)
            ours = median_seconds(grad(attention), (q, k, v), args.reps)
            mib = temp_mib(grad(attention), (q, k, v))
            line += f" | block-causal {block}: {ours:.3f} s ({base / ours:.2f}x), {mib:.0f} MiB"
        print(line, flush=True)


if __name__ == "__main__":
    main()
