"""Sampler throughput: jaxrl4llm.sampling.generate vs transformers generate (PyTorch CPU), plus the decode roofline.

    python benchmarks/sampler.py [--sizes demo,48m,100m] [--prompts 8] [--samples 8] [--prompt-len 64]
                                 [--new-tokens 128] [--repeats 2] [--dtype bfloat16] [--cpu-kernels auto]
                                 [--engine static]
    python benchmarks/sampler.py --lengths lognormal:mean=256,sigma=0.8 --max-new-tokens 1024 [--sizes 48m]
                                 [--prompts 8] [--samples 8] [--slots 16]

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

Length-distribution mode (`--lengths`): the continuous engine against the static one at a
distribution of response lengths. Row n's length L_n is drawn from the distribution (lognormal
with that mean: mu = ln(mean) - sigma^2 / 2; rounded, clipped to [1, max_new_tokens]) and forced
through `generate(row_max_new_tokens=L)` with no EOS: every row stops exactly at L_n in both
engines. It prints tokens/s (sum of L_n over the wall time) of: static with all rows at once,
static in chunks of slots / G prompts (the same rows in flight as the continuous engine) and
continuous on `--slots` slots, their ratios, and useful row-steps / all row-steps of each
(decode steps only: static runs max L_n - 1 steps over every row of a call; the continuous
engine's steps are counted by replaying its schedule on the host, `continuous_steps`).

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
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),  # configs/models/qwen3_0.6b_base.yaml's shapes
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
def make_hf_model(size: str | None, dtype: str, folder: str, device: str = "cpu"):
    """A random Qwen3 of `size` (a name of SIZES) in transformers (torch, `dtype`, on `device`), saved
    to `folder`; size None: the model already in `folder` (e.g. ours, written by `Policy.export`)."""
    import torch
    import transformers

    if size is None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval().to(device)
    hidden, layers, heads, kv_heads, head_dim, inter, vocab = SIZES[size]
    hf_config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype)).eval()
    model.save_pretrained(folder)
    return model.to(device)


def run_transformers(model, prompts: np.ndarray, samples: int, new_tokens: int, sampled: bool, repeats: int,
                     warm_up: bool = True) -> float:
    """Seconds for transformers generate over the P*G expanded rows (best of `repeats`)."""
    import torch

    ids = torch.tensor(np.repeat(prompts, samples, axis=0), dtype=torch.long, device=model.device)
    mask = torch.ones_like(ids)
    options = dict(do_sample=True, **SAMPLED) if sampled else dict(do_sample=False)

    def call(n=new_tokens):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0, **options)
        assert out.shape == (ids.shape[0], ids.shape[1] + n), out.shape
        if out.is_cuda:
            torch.cuda.synchronize()

    if warm_up:
        call(2)
    return best_time(call, repeats)


def transformers_worker(conn, size, dtype: str, folder: str, device: str = "cpu") -> None:
    """Child process: builds and saves the HF model (on `device`), then times `generate` on request.

    torch runs only here, so its thread pool (and on a GPU its memory pool) never shares a
    process with XLA's: each framework is timed in its own process, the two interleaved on the
    same machine."""
    model = make_hf_model(size, dtype, folder, device)
    conn.send("ready")
    warmed = set()
    while (request := conn.recv()) is not None:
        conn.send(run_transformers(model, *request, repeats=1, warm_up=request[1:] not in warmed))
        warmed.add(request[1:])


class TransformersPeer:
    """Handle on a `transformers_worker` process (a context manager)."""

    def __init__(self, size, dtype: str, folder: str, device: str = "cpu"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=transformers_worker, args=(child, size, dtype, folder, device), daemon=True)
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
              cpu_kernels: bool | None = None, engine: str = "static"):
    """A function that runs our `generate` once on these prompts and blocks until it is done."""
    options = dict(SAMPLED if sampled else dict(greedy=True), cpu_kernels=cpu_kernels, engine=engine)
    prompt_list = [row.tolist() for row in prompts]

    def call(seed=0):
        rollout = generate(graphdef, state, prompt_list, num_samples=samples, max_new_tokens=new_tokens,
                           eos_token_ids=[], pad_token_id=0, rng=jax.random.key(seed), **options)
        jax.block_until_ready(rollout)
        assert rollout.response_tokens.shape == (len(prompt_list) * samples, new_tokens)
        assert int(rollout.lengths.min()) == new_tokens

    return call


# ---------------------------------------------------------------------------- roofline
def decode_matmul_params(config) -> int:
    """Parameters a decode step multiplies by: q, k, v, o and the MLP of every layer, and the LM head."""
    c = config
    layer = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * layer + c.vocab_size * c.hidden_size


def decode_step_cost(config, num_prompts: int, samples: int, prompt_len: int, new_tokens: int,
                     dtype_bytes: int) -> tuple[float, float]:
    """(bytes, flops) of one average decode step, see module docstring."""
    c = config
    rows = num_prompts * samples
    matmul_params = decode_matmul_params(c)
    kv_per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes
    avg_generated = new_tokens / 2
    bytes_ = matmul_params * dtype_bytes + kv_per_slot * (num_prompts * prompt_len + rows * avg_generated)
    flops = 2 * rows * matmul_params + 4 * rows * c.num_layers * c.num_heads * c.head_dim * (prompt_len + avg_generated)
    return bytes_, flops


def ragged_decode_bytes(config, prompt_lens, lengths, steps: int, dtype_bytes: int) -> float:
    """HBM bytes a decode of ragged rows must read at least: the matmul weights once per decode step
    (`steps` of them) and, per generated token, the live KV of its row (its prompt and the tokens
    before it; each row reads its own prompt's KV, as the paged kernel does):

        bytes = steps * weights + kv_per_token * sum_n sum_{t < L_n} (prompt_n + t)

    prompt_lens, lengths: [N] real prompt tokens and generated tokens of each row."""
    c = config
    weights = decode_matmul_params(c) * dtype_bytes
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes
    p, n = np.asarray(prompt_lens, np.float64), np.asarray(lengths, np.float64)
    return steps * weights + kv_per_token * float(np.sum(p * n + n * (n - 1) / 2))


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
    parser.add_argument("--engine", default="static", choices=("static", "continuous"),
                        help="full-length table: our engine (every row runs all steps, so no refill happens)")
    parser.add_argument("--lengths", default=None,
                        help="length-distribution mode: lognormal:mean=M,sigma=S (continuous vs static)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="length-distribution mode: R")
    parser.add_argument("--slots", type=int, default=16, help="length-distribution mode: continuous slots")
    parser.add_argument("--engines", default="all,chunks,continuous",
                        help="length-distribution mode: which of all (static, all rows), chunks, continuous")
    args = parser.parse_args(argv)
    if args.lengths:
        return main_lengths(args)

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
    call = ours_call(graphdef, state, prompts, args.samples, args.new_tokens, sampled, CPU_KERNELS[args.cpu_kernels],
                     args.engine)
    first = best_time(call, 1)  # compile + first run
    ours, hf = float("inf"), float("inf")
    for _ in range(args.repeats):
        ours = min(ours, best_time(call, 1))
        if peer is not None:
            hf = min(hf, peer.time_generate(prompts, args.samples, args.new_tokens, sampled))
    hf = float("nan") if peer is None else hf
    prefill = ours_call(graphdef, state, prompts, args.samples, 1, sampled, CPU_KERNELS[args.cpu_kernels], args.engine)
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


# ---------------------------------------------------------------------------- length distribution
def draw_lengths(spec: str, rows: int, max_new_tokens: int, seed: int = 0) -> np.ndarray:
    """`lognormal:mean=M,sigma=S` -> [rows] int lengths ~ exp(N(ln M - S^2 / 2, S^2)), rounded, in [1, R]."""
    kind, _, params = spec.partition(":")
    values = {k: float(v) for k, v in (p.split("=") for p in params.split(","))}
    if kind != "lognormal" or set(values) != {"mean", "sigma"}:
        raise SystemExit(f"--lengths: expected lognormal:mean=M,sigma=S, got {spec!r}")
    mu = np.log(values["mean"]) - values["sigma"] ** 2 / 2
    draws = np.random.default_rng(seed).lognormal(mu, values["sigma"], rows)
    return np.clip(np.round(draws), 1, max_new_tokens).astype(np.int32)


def continuous_steps(lengths: np.ndarray, samples: int, slots: int, burst: int) -> int:
    """Decode steps of `sampling.continuous` on one shard, replayed on the host: at every refill
    finished slots are freed and take the next waiting rows (in order); then up to `burst` steps
    run while a slot is live; a row of length L needs L - 1 steps after its prefill."""
    remaining = [int(n) - 1 for n in lengths]  # decode steps each row still needs
    live: list[int] = []  # rows in slots
    next_row, steps = 0, 0
    while live or next_row < len(lengths):
        live = [n for n in live if remaining[n] > 0]
        while next_row < len(lengths) and len(live) < slots:
            live.append(next_row)
            next_row += 1
        for _ in range(burst):
            if not any(remaining[n] > 0 for n in live):
                break
            steps += 1
            for n in live:
                remaining[n] = max(remaining[n] - 1, 0)
    return steps


def main_lengths(args) -> None:
    """Length-distribution mode (module docstring): one table, three engines, the same rows."""
    from jaxrl4llm.sampling.continuous import BURST

    size = args.sizes.split(",")[0]
    r, g, p = args.max_new_tokens, args.samples, args.prompts
    rows = p * g
    lengths = draw_lengths(args.lengths, rows, r)
    useful = int(np.sum(lengths - 1))
    chunk = max(args.slots // g, 1)
    print(f"{size}, {p} prompts x {g} samples ({rows} rows), {args.prompt_len}-token prompts, R = {r}, {args.dtype}; "
          f"lengths {args.lengths}: mean {lengths.mean():.0f}, p50 {np.median(lengths):.0f}, "
          f"p95 {np.percentile(lengths, 95):.0f}, max {lengths.max()}")
    with tempfile.TemporaryDirectory() as folder:
        make_hf_model(size, args.dtype, folder)
        model = load_pretrained(folder, dtype=args.dtype, param_dtype=args.dtype)
    graphdef, state = nnx.split(model)
    prompts = [row.tolist() for row in np.random.default_rng(0).integers(1, model.config.vocab_size,
                                                                          (p, args.prompt_len))]
    static_all = rows * (int(lengths.max()) - 1)
    static_chunks = sum(min(chunk, p - s) * g * (int(lengths[s * g:(s + chunk) * g].max()) - 1)
                        for s in range(0, p, chunk))
    engines = {
        "static, all rows": (dict(engine="static"), static_all),
        f"static, chunks of {chunk * g} rows": (dict(engine="static", prompts_per_chunk=chunk), static_chunks),
        f"continuous, {args.slots} slots": (dict(engine="continuous", slots=args.slots),
                                            args.slots * continuous_steps(lengths, g, args.slots, BURST)),
    }
    chosen = args.engines.split(",")
    engines = {name: value for (name, value), kind in zip(engines.items(), ("all", "chunks", "continuous"))
               if kind in chosen}
    results = {}
    reference = None
    for name, (options, row_steps) in engines.items():
        def call():
            out = generate(graphdef, state, prompts, num_samples=g, max_new_tokens=r, eos_token_ids=[], pad_token_id=0,
                           rng=jax.random.key(0), row_max_new_tokens=lengths, cpu_kernels=CPU_KERNELS[args.cpu_kernels],
                           **SAMPLED, **options)
            return jax.block_until_ready(out)

        first = time.perf_counter()
        out = call()
        first = time.perf_counter() - first
        np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
        if reference is None:
            reference = np.asarray(out.response_tokens)
        same = float(np.mean(np.asarray(out.response_tokens) == reference))
        seconds = best_time(call, args.repeats)
        results[name] = (int(lengths.sum()) / seconds, useful / row_steps, seconds, first - seconds, same)
        print(f"  {name}: {seconds:.1f} s, {int(lengths.sum()) / seconds:.0f} tok/s", flush=True)
    first_name = next(iter(results))
    base = results.get("static, all rows", results[first_name])[0]
    chunked = results.get(f"static, chunks of {chunk * g} rows", results[first_name])[0]
    print(f"{'engine':>28} | {'tok/s':>8} {'x static':>8} {'x chunks':>8} | {'useful/all row-steps':>20} | "
          f"{'s':>6} {'compile s':>9} {'same tokens':>11}")
    for name, (tps, use, seconds, compile_s, same) in results.items():
        print(f"{name:>28} | {tps:>8.0f} {tps / base:>8.2f} {tps / chunked:>8.2f} | {use:>20.2f} | {seconds:>6.1f} "
              f"{compile_s:>9.1f} {same:>11.3f}")


if __name__ == "__main__":
    main()
