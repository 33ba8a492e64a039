"""Train-step throughput and model FLOPs utilisation (MFU) against the matmul peak measured in
the same run.

    .venv/bin/python benchmarks/train_step.py [--sizes demo,100m] [--rows 16] [--seq 256]

MFU = (6 * N_matmul_params + 12 * layers * seq * hidden_attn) * tokens / time / peak, the
PaLM-style model-FLOPs count of forward + backward; the peak is a bf16 x bf16 -> f32 matmul
of square sizes 1024-4096 (the best of them), timed here, now, before and after each size.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.core import LITE_PPO  # noqa: E402
from jaxrl4llm.models import ModelConfig, init_model, score_tokens  # noqa: E402
from jaxrl4llm.plan.chips import cpu_matmul_peak  # noqa: E402
from jaxrl4llm.train.step import TrainBatch, UpdateSettings, init_train_state, make_optimizer, make_update_fn  # noqa: E402

SIZES = {
    "demo": dict(vocab_size=128, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
    "48m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=10, num_heads=8, num_kv_heads=4, head_dim=64),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64),
}


def matmul_peak(sizes: tuple[int, ...] = (1024, 2048, 4096), reps: int = 5) -> float:
    """Best bf16 x bf16 -> f32 matmul FLOP/s over square sizes (the highest the machine shows,
    so the MFU below is a conservative figure): `plan.chips.cpu_matmul_peak`, as `plan --topology cpu`."""
    return cpu_matmul_peak(sizes, reps)


def model_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    d, f, h, kvh, dh, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    matmul_params = L * (d * h * dh * 2 + d * kvh * dh * 2 + 3 * d * f) + d * cfg.vocab_size
    attention = L * 2 * h * dh * seq  # QK^T and PV per token (causal average would halve it)
    return 6 * matmul_params + 6 * attention


def setup(name: str, rows: int, seq: int, micro: int = 1):
    """(model config, jitted Lite PPO update, initial state, batch) of the `name` model at [rows, seq]
    random tokens, every position scored; benchmarks/checkpoint.py uses it too."""
    cfg = ModelConfig(architecture="qwen3", tie_word_embeddings=True, dtype="bfloat16", param_dtype="float32", **SIZES[name])
    graphdef, params = init_model(cfg, jax.random.PRNGKey(0))
    logprob_fn = lambda p, x, y, pos, m: score_tokens(graphdef, p, x, y, positions=pos, attention_mask=m,
                                                      chunk_size=min(seq, 256))
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, seq + 1)), jnp.int32)
    ones = jnp.ones((rows, seq), jnp.float32)
    batch = TrainBatch(tok[:, :-1], tok[:, 1:], jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
                       jnp.ones((rows, seq), jnp.int32), ones, -ones, -ones, -ones,
                       jnp.asarray(rng.standard_normal(rows), jnp.float32), jnp.ones(rows), jnp.ones(rows))
    opt, sched = make_optimizer(lr=1e-6)
    update = jax.jit(make_update_fn(logprob_fn=logprob_fn, recipe=LITE_PPO, optimizer=opt, schedule=sched,
                                    settings=UpdateSettings(micro_batches=micro)), donate_argnums=(0,))
    return cfg, update, init_train_state(params, opt), batch


def bench(name: str, rows: int, seq: int, micro: int, reps: int) -> dict:
    cfg, update, state, batch = setup(name, rows, seq, micro)
    t = time.perf_counter()
    state, m, _ = update(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state, m, _ = update(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step = float(np.median(times))
    tokens = rows * seq
    flops = model_flops_per_token(cfg, seq) * tokens
    return dict(size=name, params_m=cfg.num_params / 1e6, tokens=tokens, step_s=step, compile_s=compile_s,
                tokens_per_s=tokens / step, flops_per_s=flops / step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="demo,100m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    peak = matmul_peak()
    print(f"measured matmul peak (bf16 x bf16 -> f32, best of 1024^3/2048^3/4096^3): {peak / 1e12:.3f} TFLOP/s")
    for name in args.sizes.split(","):
        r = bench(name, args.rows, args.seq, args.micro, args.reps)
        peak_now = matmul_peak()  # re-measure beside each size: the machine is noisy
        mfu = r["flops_per_s"] / max(peak, peak_now)
        print(f"{name:>5}: {r['params_m']:.1f}M params, {r['tokens']} tokens/step, step {r['step_s']:.3f}s "
              f"(compile {r['compile_s']:.1f}s), {r['tokens_per_s']:.0f} tokens/s, "
              f"{r['flops_per_s'] / 1e12:.3f} TFLOP/s model, MFU {100 * mfu:.1f}% of {max(peak, peak_now) / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()
