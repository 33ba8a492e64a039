"""Forward and forward+backward tokens/s of a ~100M-parameter Qwen3 on this CPU: jaxrl4llm vs
transformers (PyTorch CPU) on the same weights and batch.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/forward.py [--batch 4 --seq 256 --iters 3]

jaxrl4llm runs with bf16 matmul inputs and float32 accumulation (the default dtype) and float32
master params; PyTorch runs float32 and bfloat16. Forward+backward is the gradient of the
summed next-token log-probs (ours: chunked `score_tokens`; torch: log_softmax of logits).
The ratio is ours / best PyTorch figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from jaxrl4llm.models import abstract_model, forward, load_pretrained, positions_from_mask, score_tokens

QWEN3_100M = dict(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, max_position_embeddings=4096)


def _time(fn, iters: int) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) over `iters` calls after one warm-up call.

    The CPU figure (all threads of this process) is robust to other jobs sharing the machine.
    """
    fn()  # compile / warm up
    wall, cpu = float("inf"), float("inf")
    for _ in range(iters):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    b, t = args.batch, args.seq
    n_tokens = b * t

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3_100M)).float().eval()
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder)
    ours_model = load_pretrained(folder, dtype="bfloat16")
    config, (graphdef, params) = ours_model.config, nnx.split(ours_model)
    print(f"Qwen3 {config.num_params / 1e6:.0f}M params, batch {b} x {t} tokens, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads)")

    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, config.vocab_size, (b, t)).astype(np.int32)
    tokens = jnp.asarray(tokens_np)
    mask = jnp.ones((b, t), jnp.int32)
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(p):
        logp, _ = score_tokens(graphdef, p, tokens, targets, positions=positions, attention_mask=mask, chunk_size=128)
        return jnp.sum(logp)

    grad_fn = jax.jit(jax.grad(loss))
    print(f"{'':22s} {'forward tok/s':>14s} {'fwd+bwd tok/s':>14s}   (per CPU-second: forward, fwd+bwd)",
          flush=True)

    def report(name, f, fb):
        fb = fb or (float("nan"), float("nan"))
        print(f"{name:22s} {n_tokens / f[0]:14.0f} {n_tokens / fb[0]:14.0f}   ({n_tokens / f[1]:.0f}, "
              f"{n_tokens / fb[1]:.0f})", flush=True)

    ours = {}
    # the compute dtype lives in the module (graphdef); the float32 master params are shared
    f32_graphdef, _ = abstract_model(config.replace(dtype="float32"))
    for name, gdef in (("jaxrl4llm bf16->f32", graphdef), ("jaxrl4llm f32", f32_graphdef)):
        fwd = lambda gdef=gdef: forward(gdef, params, tokens, positions=positions, attention_mask=mask).block_until_ready()
        f = _time(fwd, args.iters)
        fb = _time(lambda: jax.block_until_ready(grad_fn(params)), args.iters) if gdef is graphdef else None
        ours[name] = (f, fb)
        report(name, f, fb)

    theirs = {}
    ids = torch.tensor(tokens_np, dtype=torch.long)
    tgt = torch.roll(ids, -1, dims=1)
    for name, dtype in (("transformers f32", torch.float32), ("transformers bf16", torch.bfloat16)):
        m = model.to(dtype)

        def fwd():
            with torch.no_grad():
                m(ids).logits

        def fwd_bwd():
            m.zero_grad(set_to_none=True)
            logp = torch.log_softmax(m(ids).logits.float(), -1).gather(-1, tgt[..., None])
            logp.sum().backward()

        theirs[name] = (_time(fwd, args.iters), _time(fwd_bwd, args.iters))
        report(name, *theirs[name])

    for k, label in ((0, "wall"), (1, "CPU time")):
        best_f = min(f[k] for f, _ in theirs.values())
        best_fb = min(fb[k] for _, fb in theirs.values())
        f, fb = ours["jaxrl4llm bf16->f32"]
        print(f"ratio jaxrl4llm (bf16->f32) / best transformers ({label}): forward {best_f / f[k]:.2f}x, "
              f"forward+backward {best_fb / fb[k]:.2f}x")


if __name__ == "__main__":
    main()
