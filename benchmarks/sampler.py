"""Sampler throughput: jaxrl4llm.sampling.generate vs transformers generate (PyTorch CPU), plus the decode roofline.

    python benchmarks/sampler.py [--sizes demo,48m,100m] [--prompts 8] [--samples 8] [--prompt-len 64]
                                 [--new-tokens 128] [--repeats 2] [--dtype bfloat16] [--cpu-kernels auto]

For every model size (Qwen3 configs, random weights, identical in both frameworks) and for
greedy and sampled decoding (temperature 0.99, top_p 0.99, top_k 100) it prints generated
tokens/s of ours and of transformers on the same prompts, batch, lengths and dtype, and
their ratio. No EOS is set, so both generate exactly P*G*R tokens.

Roofline of one decode step (N = P*G rows, prompt KV shared by the G rows of a prompt,
generated KV read up to the filled length, averaged over the R steps):

    bytes = matmul weights + prompt KV (P rows) + generated KV (N rows x R/2 slots)
    flops = 2 N (matmul params) + 4 N H Dh (T + R/2)
    t_roof = max(bytes / copy bandwidth, flops / matmul peak)      (both measured in this run)
    roofline use = t_roof / measured decode-step time

transformers + torch are benchmark-time oracles only (never imported by jaxrl4llm).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl4llm.models import load_pretrained  # noqa: E402
from jaxrl4llm.sampling import generate  # noqa: E402

SIZES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
    "demo": (128, 2, 4, 2, 32, 384, 100),
    "48m": (512, 10, 8, 4, 64, 1536, 32000),
    "100m": (768, 12, 12, 4, 64, 2048, 32000),
}
SAMPLED = dict(temperature=0.99, top_p=0.99, top_k=100)


def best_time(fn, repeats: int) -> float:
    """min over `repeats` calls of the wall time of fn() (fn blocks until its result is ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ---------------------------------------------------------------------------- machine peaks
def measure_copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of the best streaming copy on this machine (read + write counted): the max of
    numpy copyto into a preallocated buffer and a jitted bf16 read-reduce (read only)."""
    a = np.ones(megabytes * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    copy = 2 * a.nbytes / best_time(lambda: np.copyto(b, a), repeats)
    x = jnp.ones((megabytes * 2**20 // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    f(x).block_until_ready()
    read = x.nbytes / best_time(lambda: f(x).block_until_ready(), repeats)
    return max(copy, read)


def measure_matmul_peak(repeats: int = 5) -> float:
    """FLOP/s of the best bf16 x bf16 -> f32 matmul (the model's precision) over a few square sizes:
    XLA's dot, and our CPU matmul kernel where it is available (the sampler's fastest matmul)."""
    from jaxrl4llm.kernels.matmul import matmul, pack_weight
    from jaxrl4llm.kernels.native import bf16_pairs, load_kernels

    # (prepare the right operand, product): XLA's dot on W [N, K]; the kernel on W packed
    products = [(lambda w: w, jax.jit(lambda a, w: jnp.einsum("ij,kj->ik", a, w, preferred_element_type=jnp.float32)))]
    if jax.default_backend() == "cpu" and load_kernels() and bf16_pairs():
        products.append((pack_weight, jax.jit(matmul)))
    best = 0.0
    for n in (1024, 2048):
        a = jnp.ones((n, n), jnp.bfloat16)
        for prepare, f in products:
            b = jax.block_until_ready(prepare(a))
            f(a, b).block_until_ready()
            best = max(best, 2 * n**3 / best_time(lambda: f(a, b).block_until_ready(), repeats))
    return best


# ---------------------------------------------------------------------------- models
def make_hf_model(size: str, dtype: str, folder: str):
    """A random Qwen3 of `size` in transformers (torch, `dtype`), saved to `folder`."""
    import torch
    import transformers

    hidden, layers, heads, kv_heads, head_dim, inter, vocab = SIZES[size]
    hf_config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype)).eval()
    model.save_pretrained(folder)
    return model


def run_transformers(model, prompts: np.ndarray, samples: int, new_tokens: int, sampled: bool, repeats: int,
                     warm_up: bool = True) -> float:
    """Seconds for transformers generate over the P*G expanded rows (best of `repeats`)."""
    import torch

    ids = torch.tensor(np.repeat(prompts, samples, axis=0), dtype=torch.long)
    mask = torch.ones_like(ids)
    options = dict(do_sample=True, **SAMPLED) if sampled else dict(do_sample=False)

    def call(n=new_tokens):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0, **options)
        assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape

    if warm_up:
        call(2)
    return best_time(call, repeats)


def transformers_worker(conn, size: str, dtype: str, folder: str) -> None:
    """Child process: builds and saves the HF model, then times `generate` on request.

    torch runs only here, so its thread pool never shares a process with XLA's: each
    framework is timed in its own process, the two interleaved on the same machine."""
    model = make_hf_model(size, dtype, folder)
    conn.send("ready")
    warmed = set()
    while (request := conn.recv()) is not None:
        conn.send(run_transformers(model, *request, repeats=1, warm_up=request[1:] not in warmed))
        warmed.add(request[1:])


class TransformersPeer:
    """Handle on a `transformers_worker` process (a context manager)."""

    def __init__(self, size: str, dtype: str, folder: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=transformers_worker, args=(child, size, dtype, folder), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the transformers worker failed to start")

    def time_generate(self, prompts, samples: int, new_tokens: int, sampled: bool) -> float:
        self.conn.send((prompts, samples, new_tokens, sampled))
        return self.conn.recv()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.conn.send(None)
        self.proc.join(timeout=60)


CPU_KERNELS = {"auto": None, "on": True, "off": False}  # --cpu-kernels -> generate(cpu_kernels=...)


def ours_call(graphdef, state, prompts: np.ndarray, samples: int, new_tokens: int, sampled: bool,
              cpu_kernels: bool | None = None):
    """A function that runs our `generate` once on these prompts and blocks until it is done."""
    options = dict(SAMPLED if sampled else dict(greedy=True), cpu_kernels=cpu_kernels)
    prompt_list = [row.tolist() for row in prompts]

    def call(seed=0):
        rollout = generate(graphdef, state, prompt_list, num_samples=samples, max_new_tokens=new_tokens,
                           eos_token_ids=[], pad_token_id=0, rng=jax.random.key(seed), **options)
        jax.block_until_ready(rollout)
        assert rollout.response_tokens.shape == (len(prompt_list) * samples, new_tokens)
        assert int(rollout.lengths.min()) == new_tokens

    return call


# ---------------------------------------------------------------------------- roofline
def decode_step_cost(config, num_prompts: int, samples: int, prompt_len: int, new_tokens: int,
                     dtype_bytes: int) -> tuple[float, float]:
    """(bytes, flops) of one average decode step, see module docstring."""
    c = config
    rows = num_prompts * samples
    layer_matmul = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_layers * layer_matmul + c.vocab_size * c.hidden_size
    kv_per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes
    avg_generated = new_tokens / 2
    bytes_ = matmul_params * dtype_bytes + kv_per_slot * (num_prompts * prompt_len + rows * avg_generated)
    flops = 2 * rows * matmul_params + 4 * rows * c.num_layers * c.num_heads * c.head_dim * (prompt_len + avg_generated)
    return bytes_, flops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="demo,48m,100m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls of each framework, interleaved (ours, theirs, ours, ...); the best of each is kept")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--cpu-kernels", default="auto", choices=tuple(CPU_KERNELS),
                        help="our matmuls, decode attention and top-k: C++ CPU kernels (auto/on) or XLA ops only (off)")
    args = parser.parse_args(argv)

    peaks = {"bandwidth": measure_copy_bandwidth(), "peak": measure_matmul_peak()}
    print(f"machine: copy bandwidth {peaks['bandwidth'] / 1e9:.1f} GB/s, bf16 matmul peak {peaks['peak'] / 1e12:.2f} "
          f"TFLOP/s ({os.cpu_count()} cpus, jax {jax.__version__})")
    rng = np.random.default_rng(0)
    print(f"batch: {args.prompts} prompts x {args.samples} samples, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, {args.dtype}, CPU kernels {args.cpu_kernels}")
    header = (f"{'size':>6} {'params':>7} {'mode':>8} | {'ours tok/s':>10} {'hf tok/s':>9} {'ratio':>6} | "
              f"{'step ms':>8} {'roof ms':>8} {'roof use':>8} {'MB/step':>8} {'GFLOP/step':>10} | {'compile s':>9}")
    print(header)
    print("-" * len(header))
    footer = []
    for size in args.sizes.split(","):
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            peer = None if args.skip_transformers else stack.enter_context(TransformersPeer(size, args.dtype, folder))
            if peer is None:
                make_hf_model(size, args.dtype, folder)  # the same random weights, torch in this process
            model = load_pretrained(folder, dtype=args.dtype, param_dtype=args.dtype)
            config, (graphdef, state) = model.config, nnx.split(model)
            prompts = rng.integers(1, config.vocab_size, (args.prompts, args.prompt_len))
            # the machine is shared: keep the best peaks seen in this run (a conservative roofline)
            peaks = {"bandwidth": max(peaks["bandwidth"], measure_copy_bandwidth()),
                     "peak": max(peaks["peak"], measure_matmul_peak())}
            for mode in args.modes.split(","):
                print(measure_mode(args, size, mode, config, graphdef, state, prompts, peer, peaks), flush=True)
        footer.append(f"{size}: roofline from copy bandwidth {peaks['bandwidth'] / 1e9:.1f} GB/s, "
                      f"matmul peak {peaks['peak'] / 1e12:.2f} TFLOP/s")
    print("\n".join(footer))


def measure_mode(args, size, mode, config, graphdef, state, prompts, peer, peaks) -> str:
    """One table row: ours and transformers (interleaved, equal numbers of timed calls, so both
    see the same machine load; best of each), the decode step time and its roofline use."""
    sampled = mode == "sampled"
    call = ours_call(graphdef, state, prompts, args.samples, args.new_tokens, sampled, CPU_KERNELS[args.cpu_kernels])
    first = best_time(call, 1)  # compile + first run
    ours, hf = float("inf"), float("inf")
    for _ in range(args.repeats):
        ours = min(ours, best_time(call, 1))
        if peer is not None:
            hf = min(hf, peer.time_generate(prompts, args.samples, args.new_tokens, sampled))
    hf = float("nan") if peer is None else hf
    prefill = ours_call(graphdef, state, prompts, args.samples, 1, sampled, CPU_KERNELS[args.cpu_kernels])
    prefill()
    prefill_only = best_time(prefill, args.repeats)
    step = (ours - prefill_only) / (args.new_tokens - 1)
    bytes_, flops = decode_step_cost(config, args.prompts, args.samples, args.prompt_len, args.new_tokens,
                                     2 if args.dtype == "bfloat16" else 4)
    roof = max(bytes_ / peaks["bandwidth"], flops / peaks["peak"])
    tokens = args.prompts * args.samples * args.new_tokens
    return (f"{size:>6} {config.num_params / 1e6:>6.1f}M {mode:>8} | {tokens / ours:>10.0f} {tokens / hf:>9.0f} "
            f"{hf / ours:>6.2f} | {step * 1e3:>8.2f} {roof * 1e3:>8.2f} {roof / step:>8.2f} "
            f"{bytes_ / 1e6:>8.1f} {flops / 1e9:>10.2f} | {first - ours:>9.1f}")


if __name__ == "__main__":
    main()
