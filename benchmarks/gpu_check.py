"""One call measures a GPU: kernels on the chip, the paged attention's fastest configuration, a train
step and a rollout under it with their profiles, plan's prediction, decode against its limit and a
peer, exact numerics end to end, the MoE expert layer and tool calls, in at most 9 minutes, into one
folder.

    scripts/gpu_check --fetch-wheels        # here (internet): the wheels the GPU host lacks -> .gpu_wheels/
    scripts/gpu_check OUT_DIR               # on the GPU host: every default phase, at most 9 minutes
    scripts/gpu_check --dry-run OUT_DIR     # on a CPU: every phase at toy sizes (Pallas' interpreter)

Phases run in the order of PHASES (the table below: budgets in seconds on the GPU and on the dry
run), each in its own process under its budget: a phase that fails or runs out of time is reported
(its exception in the table, its traceback in the log) and the next one runs. The attention phase
writes its fastest configuration to the work folder (ATTENTION_CHOICE); the later phases that decode
read it before they trace. `plan` compiles on the CPU (JAX_PLATFORMS=cpu) in the background from its
place in the order, while the GPU phases run, and is collected after the step phases.

The whole run stops at TOTAL_SECONDS: a late phase gets what is left of it. OUT_DIR receives
gpu_check.md (the table), gpu_check.json (every figure), gpu_check.log (every phase's output), and
pytest_gpu.log when the tests phase runs (autotune_default.textproto when launches runs): one folder
level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the sibling benchmarks (plan_accuracy, sampler, train_step)
sys.path.insert(0, str(REPO))  # this tree's jaxrl4llm, not an installed one


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    gpu_seconds: int
    dry_seconds: int
    what: str
    collect_after: str | None = None  # a background phase: started at its place, collected after this phase
    optional: bool = False  # run only when --phases names it


# The phases, in order (most valuable first), with their time budgets in seconds. The default phases
# measure everything in one call within TOTAL_SECONDS (9 minutes on the GPU): the attention phase picks
# the paged attention's fastest configuration and writes it to ATTENTION_CHOICE, which every later phase
# that decodes (and plan) reads before anything traces; the step phases profile what they timed (the
# first model's rollout, the last model's log-prob pass and update), so no phase compiles a program
# another one already ran. The GPU budgets are set from the phases' times on the H100 and H200 runs
# (docs/results/gpu.md) with what the one-call run must leave out: two processes and three compiles.
PHASES = (
    #     name       GPU  dry  what
    Phase("setup",    15,  60, "probe the host's Python for WHEELS; install the missing ones from .gpu_wheels/"),
    Phase("peaks",    25,  60, "the chip's bf16 matmul rate, copy bandwidth (plan.chips.measured_peaks) and read "
                               "bandwidth (a bf16 sum over 4 GiB: plan.chips.read_bandwidth)"),
    Phase("kernels",  40, 120, "Triton paged attention, Pallas flash attention forward + backward vs the XLA path "
                               "and a float64 reference (bf16, Qwen3 heads): errors, pass/fail, times"),
    Phase("attention", 55, 240, "the Triton paged attention alone at the first step model's rollout's kv lengths "
                                "every ATTENTION_STRIDE decode steps, under each layout/block/split/warps/split rule/"
                                "store of ATTENTION_CONFIGS: the rollout's attention seconds each predicts, its output "
                                "against the default's; the fastest goes to ATTENTION_CHOICE for the later phases"),
    Phase("plan",    330, 240, "`jaxrl4llm plan --json` of the step phases' runs (h100:1; cpu on the dry run) "
                               "priced at the measured peaks, with the attention phase's choice, beside the measured "
                               "times (compiles on the CPU while the next phases run)", collect_after="step"),
    Phase("step",    105, 240, "one phase per model of MODELS (step:<model>, random weights), under the attention "
                               "phase's choice: a rollout of P x G rows at forced lognormal lengths, the log-prob "
                               "pass and the update, timed after compile; then under jax.profiler the first model's "
                               "rollout and the last model's log-prob pass and update (trace_summary)"),
    Phase("decode",   45,  90, "the rollout's tokens/s vs the HBM roofline (the measured read bandwidth) and vs "
                               "transformers' generate on the same weights"),
    Phase("agreement", 50, 240, "model.numerics=exact end to end on the chip (benchmarks/numerics.py, a random "
                                "Qwen3-shaped model, bf16): the sampler's log-prob of every token against the "
                                "trainer's recompute (exact: 0 differing), rollout and update tokens/s against default "
                                "numerics"),
    Phase("moe",      35, 120, "the expert layer of Qwen3-30B-A3B (MOE_SHAPES: hidden 2048, width 768, 128 experts, "
                               "top 8, bf16 matmuls) at three token counts, forward and forward + backward of "
                               "expert_ffn's ragged_dot form against dense_capacity (benchmarks/moe_forms.py): seconds, "
                               "XLA's FLOPs, TFLOP/s on the useful FLOPs, time over dense_capacity's, and whether "
                               "ragged_dot runs as a grouped matmul or a dense expansion over all experts"),
    Phase("tools",    45, 120, "rollouts with tool calls against rollouts without (benchmarks/tool_rollout.py's "
                               "plain, segments and tools arms; TOOLS: Qwen3-0.6B's shapes, random weights, bf16, a "
                               "stand-in tool of 20 ms and of 200 ms): tokens/s, time vs plain, decode steps, "
                               "segments, calls a row, tool seconds hidden, parked share"),
    Phase("baseline", 45, 240, "optional (`--phases baseline`, with attention and step): the first step model's "
                               "rollout under the default attention configuration, beside the step phase's under the "
                               "chosen one: what the choice gained end to end; nothing to run when the default is the "
                               "fastest", optional=True),
    Phase("tests",    50,  90, "optional (`--phases tests`): pytest -m gpu on the kernel tests (collection only on "
                               "the dry run)", optional=True),
    Phase("demo",    175, 600, "optional (`--phases demo`): `jaxrl4llm demo`, 20 RL steps (--quick on the dry run): "
                               "held-out accuracy before -> after", optional=True),
    Phase("exact",    60, 240, "optional (`--phases exact`): the Pallas kernels of model.numerics=exact "
                               "(kernels/exact_pallas.py) on the chip: each row's bits whatever its companions "
                               "(matmul, attention as a training row and as a decode step, the row kernels), "
                               "errors against XLA, times", optional=True),
    Phase("profile",  90, 240, "optional (`--phases profile`, when the step phases do not run): the first step "
                               "model's rollout once more under jax.profiler: the device's busy time, kernels and "
                               "launch calls (trace_summary)", optional=True),
    Phase("trainer", 120, 240, "optional (`--phases trainer`, when the step phases do not run): the last step "
                               "model's log-prob pass and update once more under jax.profiler: busy share and "
                               "kernels (trace_summary), beside their timed runs", optional=True),
    Phase("launches", 80, 240, "optional (`--phases launches`): the first step model's rollout under each of "
                               "LAUNCH_VARIANTS, one process each: XLA flags and decode bursts", optional=True),
)
# Later phases that decode with the attention phase's choice (ATTENTION_CHOICE), set before they trace.
READS_ATTENTION_CHOICE = frozenset({"plan", "step", "profile", "trainer", "launches", "agreement", "tools", "demo"})
ATTENTION_CHOICE = "attention_choice.json"  # in the work folder: gpu_paged_attention's constants, by name
# The launches phase's variants: (XLA_FLAGS, run overrides). On an H100 the rollout took 2 s more than
# its HBM traffic for either model, ~5.7 us for each of its ~430 kernels a decode step (docs/gpu.md):
# XLA's command buffers (CUDA graphs) are one launch for a run of kernels, but by default not across a
# while loop's trips; a longer burst runs more decode steps per trip of the refill loop. None of these
# helped on the H100 (2026-11-28, the launches table of docs/gpu.md; both together, 1.02x, is dropped).
# The projections' and MLP's GEMMs of a decode step (64 rows) ran at ~half the copy bandwidth on the
# H200 as XLA's Triton GEMM fusions (~3.8 us of fixed cost a GEMM): cublas_gemm has XLA call cuBLAS for
# them instead, cublaslt cuBLASLt, exhaustive_tiling has the autotuner try every Triton tiling. The
# default variant writes XLA's autotune results (which GEMM config each fusion got) to the output folder
# (AUTOTUNE_LOG), to read before trying flags.
LOOP_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
LAUNCH_VARIANTS = {
    "default": ("", []),
    "no_command_buffers": ("--xla_gpu_enable_command_buffer=", []),
    "command_buffers_in_loops": (LOOP_COMMAND_BUFFERS, []),
    "burst_64": ("", ["rollout.decode_burst=64"]),
    "cublas_gemm": ("--xla_gpu_enable_triton_gemm=false", []),
    "cublaslt": ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true", []),
    "exhaustive_tiling": ("--xla_gpu_exhaustive_tiling_search=true", []),
}
AUTOTUNE_LOG = "autotune_default.textproto"  # in the output folder: `--xla_gpu_dump_autotune_results_to`
# The attention phase's kernel configurations: (layout, pages a loop step reads, partitions of a slot's pages
# or None for the default rule, Triton warps, split rule, store); the first is the default. On an H100 and an
# H200 the Qwen3-0.6B rollout's paged attention took ~0.91 s (36 us a call, then per_kv_head, 4 pages a step,
# 2 partitions, 4 warps): ~4x its KV bytes at the copy bandwidth. Of 16 per_kv_head configurations on an
# H200 (2026-11-28, docs/gpu.md) 4 pages, 4 partitions, 8 warps was the fastest (1.22x), now the default.
# Not yet run on a chip: the per_slot layout (every kv head of a slot in one program: no padded query
# rows, 8x fewer programs and partials at 16:8), the "length" split rule (a row's partitions sized by its
# own live pages) and the "live" store (partials written only for non-empty partitions and real rows:
# the per_kv_head layout wrote 16.8 MB of float32 partials a call at 16:8, 2 real rows of each 16, beside
# the ~19 MB of keys and values it read). A row's kv lengths every ATTENTION_STRIDE decode steps stand for
# the steps between.
ATTENTION_CONFIGS = (("per_kv_head", 4, None, 8, "table", "all"), ("per_kv_head", 4, None, 8, "table", "live"),
                     ("per_kv_head", 4, None, 8, "length", "all"), ("per_kv_head", 4, None, 8, "length", "live"),
                     ("per_kv_head", 4, 8, 8, "length", "live"), ("per_kv_head", 2, 8, 4, "length", "live"),
                     ("per_kv_head", 8, 2, 8, "table", "all"),
                     ("per_slot", 1, None, 4, "table", "all"), ("per_slot", 1, 2, 4, "table", "all"),
                     ("per_slot", 1, 4, 4, "table", "all"), ("per_slot", 1, 8, 4, "table", "all"),
                     ("per_slot", 1, 4, 4, "length", "live"), ("per_slot", 1, 8, 4, "length", "live"),
                     ("per_slot", 2, 4, 8, "length", "live"), ("per_slot", 1, 4, 8, "table", "live"),
                     ("per_slot", 1, 8, 8, "length", "all"))
ATTENTION_DRY_CONFIGS = (ATTENTION_CONFIGS[0], ("per_kv_head", 1, 8, 4, "length", "live"),
                         ("per_slot", 1, None, 4, "table", "all"), ("per_slot", 2, 2, 4, "length", "live"))
ATTENTION_STRIDE = 32
# the whole check: at most 9 minutes on the GPU; the dry run's budgets only stop a hang (a loaded CPU is slow)
TOTAL_SECONDS = {"gpu": 540, "dry": 1500}
# A phase's environment on top of the driver's. JAX takes 75% of a GPU's memory when it starts: a step
# takes more (Qwen3-1.7B's Adam state and activations), and plan checks the fit at the same share
# (compiling on the CPU beside the GPU phases); the decode phase takes none ahead (its transformers
# peer is another process on the same GPU).
STEP_MEMORY = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
PHASE_ENV = {
    "step": STEP_MEMORY,
    "launches": STEP_MEMORY,
    "profile": STEP_MEMORY,
    "trainer": STEP_MEMORY,
    "attention": STEP_MEMORY,
    "baseline": STEP_MEMORY,
    "moe": STEP_MEMORY,
    "plan": {"JAX_PLATFORMS": "cpu", **STEP_MEMORY},
    "decode": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}

# The models of the step phases, random weights: Qwen3's shapes from their configs; the dry run's toy
# model is train_step.py's "demo" size with a vocabulary that holds the demo's character tokenizer.
MODELS = {
    "gpu": {"qwen3-0.6b": "configs/models/qwen3_0.6b_base.yaml", "qwen3-1.7b": "configs/models/qwen3_1.7b_base.yaml"},
    "dry": {"demo": "demo"},
}
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def model_fields(mode: str, model: str) -> dict:
    """The ModelConfig size fields of `model` of MODELS[mode] (its config file's `model` section)."""
    source = MODELS[mode][model]
    if source == "demo":
        from train_step import SIZES

        return SIZES["demo"]
    import yaml

    section = yaml.safe_load((REPO / source).read_text())["model"]
    return {k: section[k] for k in SIZE_FIELDS}


# The rollout: P prompts x G samples, response lengths forced (no EOS) from a lognormal of this mean
# and sigma, clipped to R new tokens (benchmarks/sampler.py's --lengths mode).
WORKLOAD = {
    "gpu": dict(prompts=8, samples=8, max_new_tokens=1024, mean=256, sigma=0.8, mini_batches=2, reps=2),
    "dry": dict(prompts=2, samples=2, max_new_tokens=16, mean=8, sigma=0.8, mini_batches=2, reps=1),
}
# Kernel shapes: Qwen3's head_dim 128, GQA 16:8 and 32:8 (query:kv heads), 16-token pages, ragged lengths.
KERNEL_SHAPES = {
    "gpu": dict(head_dim=128, heads=((16, 8), (32, 8)), page=16, slots=16, pages_per_slot=80, batch=2, seq=1024,
                reps=5),
    "dry": dict(head_dim=128, heads=((8, 2),), page=16, slots=3, pages_per_slot=4, batch=1, seq=64, reps=1),
}
# bf16 tolerances on the relative error ||out - ref|| / ||ref|| against the float64 reference (bf16 has
# 8 bits of mantissa: one rounding is 2^-9 = 2e-3 relative; the kernels round inputs, probabilities and
# (backward) gradients to bf16).
TOLERANCE = {"paged": 1e-2, "flash forward": 1e-2, "flash backward": 3e-2}
PLAN_TOPOLOGY = {"gpu": "h100:1", "dry": "cpu"}


def plan_topology(mode: str, device: str = "") -> str:
    """The topology plan compiles for: PLAN_TOPOLOGY[mode], or one H200 when the chip is one."""
    return "h200:1" if mode == "gpu" and "h200" in device.lower() else PLAN_TOPOLOGY[mode]


def plan_flags(peaks: dict | None) -> list[str]:
    """The extra flags of `jaxrl4llm plan` (the one place they are passed): price at the chip's matmul
    rate and copy bandwidth measured by the peaks phase (plan runs on the CPU, so `--peak measured`
    would measure the CPU); none (the datasheet's) when the peaks phase did not run."""
    if not peaks:
        return []
    return ["--peak-flops", f"{peaks['peak_flops']:.6g}", "--hbm-bandwidth", f"{peaks['hbm_bandwidth']:.6g}"]


# What the GPU host lacks, pinned to versions that work with each other and with the host's packages
# (datasets 5.2 takes dill < 0.4.2 and multiprocess < 0.70.20; sympy's LaTeX parser needs antlr 4.11).
# import name -> pip requirement. Pure-Python wheels (py3-none-any; multiprocess ships py312 ones).
WHEELS = {
    "dill": "dill==0.4.1",
    "multiprocess": "multiprocess==0.70.19",
    "antlr4": "antlr4-python3-runtime==4.11.1",
    "tensorboardX": "tensorboardX==2.6.5",
    "datasets": "datasets==5.2.0",
}
WHEEL_DIR = REPO / ".gpu_wheels"
OUT_FILES = ("gpu_check.md", "gpu_check.json", "gpu_check.log", "pytest_gpu.log")


# ---------------------------------------------------------------------------- helpers (in a phase)
def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of `reps` calls of fn() (it must block: `jax.block_until_ready` inside)."""
    from plan_accuracy import median_seconds as timed

    return timed(fn, reps)


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    return {"device": f"{d.platform}: {d.device_kind}", "devices": jax.device_count(), "jax": jax.__version__}


def rel_error(got, want) -> tuple[float, float]:
    """(max |got - want|, ||got - want|| / ||want||) in float64."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want))), float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def forced_lengths(mode: str):
    """[P * G] response lengths of the workload (lognormal, clipped to [1, R]): the same in every phase."""
    from sampler import draw_lengths

    w = WORKLOAD[mode]
    return draw_lengths(f"lognormal:mean={w['mean']},sigma={w['sigma']}", w["prompts"] * w["samples"],
                        w["max_new_tokens"], seed=0)


def step_overrides(mode: str, model: str, root: Path) -> list[str]:
    """The run of a step phase (plan_accuracy's run on the study's recipe) for `model` of MODELS[mode]."""
    from plan_accuracy import run_overrides

    w = WORKLOAD[mode]
    rows = w["prompts"] * w["samples"]
    return run_overrides(root, model_fields(mode, model), prompts=w["prompts"], samples=w["samples"],
                         response=w["max_new_tokens"], mini_batches=w["mini_batches"]) + [
        f"rollout.slots={rows}",  # every row in a slot at once: the step, decode and plan phases alike
        "model.remat=true",  # as the study's model configs (configs/models/*.yaml)
        "trainer.compile_cache=false"]


# ---------------------------------------------------------------------------- phase: peaks
READ_MIB = {"gpu": 4096, "dry": 64}  # the read-bandwidth pass's array: 4 GiB past any cache on the chip


def phase_peaks(mode: str, work: Path, log) -> dict:
    """The default device's bf16 matmul FLOP/s and copy bandwidth (bytes read + written per second),
    as `plan --peak measured` measures them (`plan.chips.measured_peaks`), the datasheet's, and its
    read bandwidth (`plan.chips.read_bandwidth`: bytes read per second by a bf16 sum over
    READ_MIB[mode] MiB), which the decode phase's roofline divides by."""
    from jaxrl4llm.plan.chips import measured_peaks, read_bandwidth
    from jaxrl4llm.plan.programs import chip_spec

    import jax

    topology = plan_topology(mode, jax.devices()[0].device_kind)
    sheet = chip_spec(topology)
    chip = sheet if topology == "cpu" else measured_peaks(sheet)  # plan's "cpu" chip is measured already
    read = read_bandwidth(jax.devices()[0], READ_MIB[mode])
    log(f"  bf16 matmul {chip.peak_flops / 1e12:.3g} TFLOP/s ({sheet.peak_flops / 1e12:.3g} on the datasheet), "
        f"copy {chip.hbm_bandwidth / 1e9:.3g} GB/s ({sheet.hbm_bandwidth / 1e9:.3g}), read {read / 1e9:.3g} GB/s")
    return {"peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth, "read_bandwidth": read,
            "datasheet_peak_flops": sheet.peak_flops, "datasheet_hbm_bandwidth": sheet.hbm_bandwidth,
            "source": chip.peak_source}


# ---------------------------------------------------------------------------- phase: kernels
def paged_case(rng, shapes: dict, heads: tuple[int, int]):
    """A pool [1, pages, page, 2 KVH, Dh] bf16, q [1, S, KVH, H/KVH, Dh], a page table [1, S, W] of
    scattered pages, ragged lengths [1, S] (slot 0 idle) and the per-page counts of the XLA path."""
    import jax.numpy as jnp
    import numpy as np

    h, kvh = heads
    s, w, page, dh = shapes["slots"], shapes["pages_per_slot"], shapes["page"], shapes["head_dim"]
    pages = s * w + 1
    pool = jnp.asarray(rng.normal(size=(1, pages, page, 2 * kvh, dh)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(1, s, kvh, h // kvh, dh)), jnp.float32)
    lengths = np.concatenate([[0], rng.integers(1, w * page + 1, size=s - 1)])[None].astype(np.int32)
    table = (1 + rng.permutation(s * w).reshape(1, s, w)).astype(np.int32)
    counts = np.clip(lengths[..., None] - np.arange(w) * page, 0, page).astype(np.int32)
    return q, pool, table, lengths, counts


def paged_variants(group: int, kv_heads: int) -> list[tuple[str, str, str, str]]:
    """(row name, layout, split rule, store) of the paged attention kernel that the kernels phase checks
    against the float64 reference at these heads: each layout that runs them (`kernel_layout`), the
    default first, with the default split rule and store ("paged" / "paged per_slot"), then each with the
    other split rule and store ("... length/live": partitions by a row's own length, masked stores)."""
    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    ordered = [gpa.LAYOUT, *(name for name in gpa.LAYOUTS if name != gpa.LAYOUT)]
    layouts = [name for name in ordered if gpa.kernel_layout(kv_heads, group, name) == name]
    other = (next(r for r in gpa.SPLIT_RULES if r != gpa.SPLIT_RULE), next(s for s in gpa.STORES if s != gpa.STORE))
    named = lambda layout: "paged" if layout == gpa.LAYOUT else f"paged {layout}"
    return [(named(layout), layout, gpa.SPLIT_RULE, gpa.STORE) for layout in layouts] + \
        [(f"{named(layout)} {other[0]}/{other[1]}", layout, *other) for layout in layouts]


def segment_case(rng, shapes: dict, heads: tuple[int, int]):
    """q [B, T, H, Dh], k, v [B, T, KVH, Dh] bf16, packed segment ids [B, T] (ragged sequences
    1, 2, ..., 0 on the trailing padding) and a cotangent [B, T, H, Dh] float32."""
    import jax.numpy as jnp
    import numpy as np

    h, kvh = heads
    b, t, dh = shapes["batch"], shapes["seq"], shapes["head_dim"]
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, seg = 0, 1
        while pos < t - t // 8:  # the last eighth (at least) is padding
            n = int(rng.integers(1, max(2, t // 3)))
            ids[row, pos:min(pos + n, t - t // 8)] = seg
            pos, seg = pos + n, seg + 1
    x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
    return x(b, t, h, dh), x(b, t, kvh, dh), x(b, t, kvh, dh), jnp.asarray(ids), jnp.asarray(
        rng.normal(size=(b, t, h, dh)), jnp.float32)


def segment_reference(q, k, v, ids, d_out):
    """float64 out, dq, dk, dv of causal attention within segments (a token sees the tokens of its
    segment at or before it), the gradients of sum(out * d_out): `tests.gpu_kernels.
    segment_attention_reference` in BLAS matmuls a row at a time (its einsums take minutes at T 1024):
        P = softmax(Q K^T / sqrt(Dh)), dS = P (dO V^T - rowsum(dO O)), dQ = dS K / sqrt(Dh),
        dK = dS^T Q / sqrt(Dh), dV = P^T dO   (dK, dV summed over the query heads of a kv head)."""
    import numpy as np

    f = lambda a: np.asarray(a, np.float64)
    q, k, v, d_out, ids = f(q), f(k), f(v), f(d_out), np.asarray(ids)
    b, t, h, dh = q.shape
    g = h // k.shape[2]
    scale = dh**-0.5
    outs = [np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(b):
        qh, do = q[i].transpose(1, 0, 2), d_out[i].transpose(1, 0, 2)  # [H, T, Dh]
        kh, vh = (np.repeat(x[i], g, axis=1).transpose(1, 0, 2) for x in (k, v))
        mask = causal & (ids[i][:, None] == ids[i][None, :])
        s = np.where(mask, qh @ kh.transpose(0, 2, 1) * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = p @ vh
        ds = p * (do @ vh.transpose(0, 2, 1) - np.sum(do * o, -1, keepdims=True))
        dq, dk, dv = ds @ kh * scale, ds.transpose(0, 2, 1) @ qh * scale, p.transpose(0, 2, 1) @ do
        outs[0][i], outs[1][i] = o.transpose(1, 0, 2), dq.transpose(1, 0, 2)
        outs[2][i] = dk.transpose(1, 0, 2).reshape(t, -1, g, dh).sum(2)
        outs[3][i] = dv.transpose(1, 0, 2).reshape(t, -1, g, dh).sum(2)
    return outs


def phase_kernels(mode: str, work: Path, log, partial=lambda figures: None) -> dict:
    """The Triton paged attention and the Pallas flash attention (forward and backward) against the
    XLA path and the float64 reference, at Qwen3's head shapes: errors, pass/fail, kernel vs XLA time."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl4llm.models.layers.segment_attention import segment_causal_attention
    from jaxrl4llm.sampling import gpu_paged_attention as gpa
    from jaxrl4llm.sampling.paged_cache import paged_attention
    from tests.gpu_kernels import paged_attention_reference

    shapes = KERNEL_SHAPES[mode]
    interpret = jax.default_backend() == "cpu"  # Pallas' interpreter where there is no GPU
    rng = np.random.default_rng(0)
    figures, failed = {}, []

    def check(name: str, kind: str, got, want, xla=None) -> dict:
        abs_err, rel = rel_error(got, want)
        row = {"max_abs": abs_err, "rel": rel, "tolerance": TOLERANCE[kind], "pass": rel <= TOLERANCE[kind]}
        if xla is not None:
            row["xla_max_abs"], row["xla_rel"] = rel_error(xla, want)
        if not row["pass"]:
            failed.append(name)
        log(f"  {name}: max abs {abs_err:.3g}, rel {rel:.3g} (tolerance {TOLERANCE[kind]:g})"
            + (f"; XLA path rel {row['xla_rel']:.3g}" if xla is not None else ""))
        return row

    for h, kvh in shapes["heads"]:
        tag = f"{h}:{kvh}"
        # -- paged attention (decode): the kernel in each layout (the default's row is "paged h:kvh") and
        # the XLA path on the same pool
        q, pool, table, lengths, counts = paged_case(rng, shapes, (h, kvh))
        chunk = max(c for c in (1, 2, 4, 8) if shapes["pages_per_slot"] % c == 0)
        xla = jax.jit(lambda q, pool, table, counts: paged_attention(
            q, pool, table, counts, jnp.int32(shapes["pages_per_slot"] // chunk), pages_per_chunk=chunk,
            dtype=jnp.bfloat16))
        live = lambda x: np.asarray(x)[0, 1:]  # slot 0 is idle: the XLA path gives it a mean of V, unused
        # the reference reads q as the kernel does: rounded to the pool's dtype
        ref = paged_attention_reference(q[0].astype(pool.dtype), pool[0], table[0], lengths[0])[None]
        xla_path = {}  # its output and time, measured once for every layout's row
        for variant, layout, split_rule, store in paged_variants(h // kvh, kvh):
            name = f"{variant} {tag}"
            try:
                kernel = jax.jit(functools.partial(gpa.gpu_paged_attention, layout=layout, split_rule=split_rule,
                                                   store=store, interpret=interpret))
                got = jax.block_until_ready(kernel(q, pool, table, lengths))
                if not xla_path:
                    xla_path["out"] = jax.block_until_ready(xla(q, pool, table, counts))
                    xla_path["ms"] = 1e3 * median_seconds(lambda: jax.block_until_ready(xla(q, pool, table, counts)),
                                                          shapes["reps"])
                row = check(name, "paged", live(got), live(ref), live(xla_path["out"]))
                row["idle_slot_zero"] = bool(np.all(np.asarray(got)[0, 0] == 0))
                row["kernel_ms"] = 1e3 * median_seconds(
                    lambda: jax.block_until_ready(kernel(q, pool, table, lengths)), shapes["reps"])
                row["xla_ms"] = xla_path["ms"]
                figures[name] = row
            except Exception as e:  # noqa: BLE001 - a kernel that raises on the chip is reported; the next runs
                failed.append(name)
                figures[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                log(traceback.format_exc(limit=6))
        # -- flash attention (training): forward and backward, pallas_gpu and the XLA path
        try:
            q, k, v, ids, d_out = segment_case(rng, shapes, (h, kvh))
            ref = segment_reference(q, k, v, ids, d_out)
            fwd, grads = {}, {}
            for impl in ("pallas_gpu", "xla"):
                attend = functools.partial(segment_causal_attention, dtype=jnp.bfloat16, impl=impl)
                fwd[impl] = jax.jit(attend)
                grads[impl] = jax.jit(jax.grad(lambda q, k, v, ids, d, attend=attend: jnp.sum(attend(q, k, v, ids) * d),
                                               argnums=(0, 1, 2)))
            outs = {impl: jax.block_until_ready(fwd[impl](q, k, v, ids)) for impl in fwd}
            row = check(f"flash forward {tag}", "flash forward", outs["pallas_gpu"], ref[0], outs["xla"])
            row["kernel_ms"] = 1e3 * median_seconds(lambda: jax.block_until_ready(fwd["pallas_gpu"](q, k, v, ids)),
                                                    shapes["reps"])
            row["xla_ms"] = 1e3 * median_seconds(lambda: jax.block_until_ready(fwd["xla"](q, k, v, ids)),
                                                 shapes["reps"])
            figures[f"flash forward {tag}"] = row
            gs = {impl: jax.block_until_ready(grads[impl](q, k, v, ids, d_out)) for impl in grads}
            flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in t])
            row = check(f"flash backward {tag}", "flash backward", flat(gs["pallas_gpu"]), flat(ref[1:]),
                        flat(gs["xla"]))
            for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
                row[f"{name}_rel"] = rel_error(gs["pallas_gpu"][i], ref[1 + i])[1]
            row["kernel_ms"] = 1e3 * median_seconds(
                lambda: jax.block_until_ready(grads["pallas_gpu"](q, k, v, ids, d_out)), shapes["reps"])
            row["xla_ms"] = 1e3 * median_seconds(lambda: jax.block_until_ready(grads["xla"](q, k, v, ids, d_out)),
                                                 shapes["reps"])
            figures[f"flash backward {tag}"] = row
        except Exception as e:  # noqa: BLE001
            failed.append(f"flash {tag}")
            figures[f"flash {tag}"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(traceback.format_exc(limit=6))
        partial(figures)
    figures["interpret"] = interpret
    if failed:
        raise PhaseFailed(f"failed: {', '.join(failed)}", figures)
    return figures


# ---------------------------------------------------------------------------- phase: step
@dataclasses.dataclass
class TimedRollout:
    """A step phase's run set up as `jaxrl4llm train` sets it up, and its rollout timed after compile."""

    run: object  # train.loop's Run
    state: object  # the train state
    policy: object  # run.policy with the state
    out: object  # the rollout (sampling's output)
    prompts: list  # [P] prompt token ids
    lengths: object  # [P * G] forced response lengths
    setup_s: float
    first_s: float  # the first rollout, its compile included
    rollout_s: float  # the median of WORKLOAD's reps after it
    rollout: object  # the timed call (compiled): another rollout


def timed_rollout(mode: str, work: Path, log, model: str, extra_overrides=()) -> TimedRollout:
    """Set up `model`'s run (random weights; `extra_overrides` on top of `step_overrides`) and time its
    rollout of WORKLOAD's prompts x samples at the forced lengths, with no EOS."""
    import jax
    import numpy as np

    from jaxrl4llm.sampling import generate
    from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.loop import setup_run
    from plan_accuracy import CONFIG_FILES, one_device_mesh

    w = WORKLOAD[mode]
    cfg = load_config(CONFIG_FILES, step_overrides(mode, model, work / "run") + list(extra_overrides))
    t0 = time.perf_counter()
    run, state = setup_run(cfg, one_device_mesh(), log)
    setup_s = time.perf_counter() - t0
    prompts = [run.train_set.token_ids[i] for i in range(w["prompts"])]
    lengths = forced_lengths(mode)
    policy = run.policy.with_state(state)
    r = cfg.rollout

    def rollout():  # Policy.generate's call, with the forced per-row lengths and no EOS
        out = generate(policy.graphdef, policy.state, prompts, num_samples=w["samples"],
                       max_new_tokens=w["max_new_tokens"], temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                       eos_token_ids=[], pad_token_id=policy.pad_token_id, rng=jax.random.key(0),
                       mesh=policy.sampler_mesh, cpu_kernels=policy.cpu_kernels, engine=policy.engine,
                       slots=w["prompts"] * w["samples"], decode_burst=policy.decode_burst,
                       prompt_buckets=(bucket(max(map(len, prompts)), PROMPT_BUCKETS),), row_max_new_tokens=lengths)
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    out = rollout()
    first = time.perf_counter() - t0
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
    t_rollout = median_seconds(rollout, w["reps"])
    log(f"  rollout {t_rollout:.3f} s ({first:.1f} s with its compile)")
    return TimedRollout(run, state, policy, out, prompts, lengths, setup_s, first, t_rollout, rollout)


def phase_step(mode: str, work: Path, log, model: str, partial=lambda figures: None) -> dict:
    """A Lite PPO step of `model` (random weights) as `jaxrl4llm train` sets it up (plan_accuracy's
    run): the rollout at forced lengths, the log-prob pass and the update, each timed after its compile."""
    import numpy as np

    from plan_accuracy import PROGRAMS, time_update_programs

    from plan_accuracy import update_batch

    w = WORKLOAD[mode]
    models = list(MODELS[mode])
    timed = timed_rollout(mode, work, log, model)
    lengths = timed.lengths
    figures = {"model": model, "rollout_s": timed.rollout_s, "rollout_first_s": timed.first_s}
    partial(figures)
    export = ""
    if model == models[0]:  # the decode phase's transformers peer loads these weights, and the rollout's profile
        export = str(timed.policy.export(work / "hf"))  # runs them, before the update donates (deletes) them
        record_profile(figures, "profile", lambda: profile_rollout(timed, work, log), log)
    t_logprob, t_update, state = time_update_programs(timed.run, timed.state, timed.out, w["reps"] + 1)
    log(f"  log-prob pass {t_logprob:.3f} s, update {t_update:.3f} s")
    figures.update({
        "export": export, "prompt_lens": [len(p) for p in timed.prompts],
        "params_m": timed.run.policy.config.num_params / 1e6, "rows": len(lengths),
        "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
        "prompt_tokens": float(np.asarray(timed.out.prompt_mask).sum(-1).mean()), "setup_s": timed.setup_s,
        "measured": dict(zip(PROGRAMS, (timed.rollout_s, t_logprob, t_update))),
        "step_s": timed.rollout_s + t_logprob + t_update,
        "rollout_tokens_per_s": float(lengths.sum()) / timed.rollout_s})
    if model == models[-1]:  # the trainer's profile, of the programs just compiled and timed
        partial(figures)  # the timed step survives a profile that runs out of time
        record_profile(figures, "trainer_profile", lambda: profile_trainer(
            timed.run, state, update_batch(timed.run, state, timed.out), work, log), log)
    return figures


def record_profile(figures: dict, name: str, profile, log) -> None:
    """figures[name] = profile(), or figures[name + "_error"] = its exception: a step's timed figures
    stand whatever its profile does."""
    try:
        figures[name] = profile()
    except Exception as e:  # noqa: BLE001 - reported as a figure; the step's own figures stand
        figures[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(traceback.format_exc(limit=6))


# ---------------------------------------------------------------------------- phase: launches (optional)
def phase_launches(mode: str, work: Path, log, variant: str) -> dict:
    """The first step model's rollout under LAUNCH_VARIANTS[variant] (its XLA_FLAGS are set by the driver,
    before this process starts JAX): seconds and generated tokens/s."""
    overrides = LAUNCH_VARIANTS[variant][1]
    model = next(iter(MODELS[mode]))
    timed = timed_rollout(mode, work, log, model, overrides)
    figures = {"model": model, "xla_flags": os.environ.get("XLA_FLAGS", ""), "overrides": overrides,
               "rollout_s": timed.rollout_s, "rollout_first_s": timed.first_s,
               "tokens_per_s": float(timed.lengths.sum()) / timed.rollout_s}
    dump = re.search(r"--xla_gpu_dump_autotune_results_to=(\S+)", figures["xla_flags"])
    if dump:  # the default variant: XLA wrote its autotune results there (a GPU's compile; none on a CPU)
        figures["autotune_log"] = Path(dump.group(1)).name if Path(dump.group(1)).exists() else None
    return figures


# ---------------------------------------------------------------------------- phase: profile (optional)
def trace_summary(trace_dir: Path, top: int = 12) -> dict:
    """What a jax.profiler trace (its .xplane.pb) says of the device: its kernels (the GPU's stream lines;
    on a CPU the XLA client's threads), their busy time (the union of their intervals) against the span
    from the first to the last, the host's kernel-launch calls, and the `top` kernels by total time
    (names with their numeric suffix dropped: `loop_fusion_12` -> `loop_fusion`)."""
    import re

    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        raise PhaseFailed(f"jax.profiler wrote no .xplane.pb under {trace_dir}", {})
    data = ProfileData.from_file(str(files[-1]))
    planes = list(data.planes)
    gpu = [pl_ for pl_ in planes if pl_.name.startswith("/device:GPU")]
    if gpu:
        source, lines = "GPU streams", [ln for pl_ in gpu for ln in pl_.lines if ln.name.startswith("Stream")]
    else:
        source, lines = "CPU XLA threads", [ln for pl_ in planes if pl_.name == "/host:CPU" for ln in pl_.lines
                                            if ln.name.startswith("tf_XLA") and "Eigen" not in ln.name]
        # (the thread that runs the ops: tf_XLAPjRtCpuClient on jax 0.10, tf_XLAExecute on 0.12)
    events = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name) for ln in lines for e in ln.events
                    if not e.name.startswith("end: "))
    busy, reach = 0.0, -math.inf
    for start, end, _ in events:  # the union of the intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = (events[-1][1] - events[0][0]) if events else 0.0
    by_name: dict = {}
    for start, end, name in events:
        key = re.sub(r"([._]\d+)+$", "", name)
        count, total = by_name.get(key, (0, 0.0))
        by_name[key] = (count + 1, total + end - start)
    launch = [e.duration_ns for pl_ in planes if not pl_.name.startswith("/device") for ln in pl_.lines for e in ln.events
              if re.match(r"cu(da)?(LaunchKernel|GraphLaunch|LaunchKernelEx)", e.name)]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"source": source, "lines": sorted({f"{pl_.name}: {ln.name}" for pl_ in (gpu or planes) for ln in pl_.lines})[:40],
            "kernels": len(events), "busy_s": busy / 1e9, "span_s": span / 1e9,
            "busy_share": busy / span if span else 0.0, "launch_calls": len(launch), "launch_api_s": sum(launch) / 1e9,
            "top": [{"name": k, "count": c, "total_ms": t / 1e6, "mean_us": t / c / 1e3} for k, (c, t) in ranked]}


def profile_rollout(timed: TimedRollout, work: Path, log) -> dict:
    """A compiled rollout (`timed_rollout`) once more under jax.profiler.trace: is the decode step busy on
    the device (with which kernels) or idle between them? `trace_summary`, the traced and untraced
    seconds and the longest row."""
    import jax

    t0 = time.perf_counter()
    with jax.profiler.trace(str(work / "trace")):
        timed.rollout()
    traced_s = time.perf_counter() - t0
    summary = trace_summary(work / "trace")
    log(f"  traced rollout {traced_s:.3f} s: {summary['kernels']} kernels, busy {summary['busy_s']:.3f} s of "
        f"{summary['span_s']:.3f} s")
    return {"rollout_s": timed.rollout_s, "traced_s": traced_s, "longest_row": int(timed.lengths.max()), **summary}


def profile_trainer(run, state, batch, work: Path, log, reps: int = 0) -> dict:
    """The log-prob pass (when the run has one) and the update on `batch`, each under
    jax.profiler.trace after a call that compiles it (and, reps > 0, the median of `reps` timed calls):
    where a trainer program's device time goes (busy share, kernels by total time). `state` is donated."""
    import jax

    from jaxrl4llm.train.step import join_params
    from plan_accuracy import runs_logprob_pass

    figures: dict = {}

    def profiled(name: str, call) -> None:
        t0 = time.perf_counter()
        call()  # its compile (none when it ran already)
        seconds = median_seconds(call, reps) if reps else time.perf_counter() - t0
        trace = work / f"trace_{name.replace(' ', '_')}"
        t0 = time.perf_counter()
        with jax.profiler.trace(str(trace)):
            call()
        traced_s = time.perf_counter() - t0
        summary = trace_summary(trace)
        log(f"  {name} {seconds:.3f} s, traced {traced_s:.3f} s: {summary['kernels']} kernels, busy "
            f"{summary['busy_s']:.3f} s of {summary['span_s']:.3f} s")
        figures[name] = {"seconds": seconds, "traced_s": traced_s, **summary}

    if runs_logprob_pass(run):
        params = join_params(state.params, state.frozen)
        profiled("logprob pass", lambda: jax.block_until_ready(run.logprob_pass(params, batch)[0]))
    box = {"state": state}

    def update():  # the update donates its state: each call takes the last one's
        box["state"], metrics, _ = run.update(box["state"], batch)
        return jax.block_until_ready(metrics)

    profiled("update", update)
    return figures


def phase_profile(mode: str, work: Path, log) -> dict:
    """The first step model's rollout (compiled and timed as in the step phase), then once more under
    jax.profiler.trace (`profile_rollout`): for a check without the step phases."""
    model = next(iter(MODELS[mode]))
    return {"model": model, **profile_rollout(timed_rollout(mode, work, log, model), work, log)}


# ---------------------------------------------------------------------------- phase: trainer (optional)
def phase_trainer(mode: str, work: Path, log) -> dict:
    """The last step model's log-prob pass and update (set up, compiled and timed as in the step
    phase), then each once more under jax.profiler.trace (`profile_trainer`): where a trainer program's
    device time goes, to name why the measured time runs past plan's prediction. For a check without
    the step phases."""
    from plan_accuracy import update_batch

    w = WORKLOAD[mode]
    model = list(MODELS[mode])[-1]
    timed = timed_rollout(mode, work, log, model)
    batch = update_batch(timed.run, timed.state, timed.out)
    return {"model": model, "rows": len(timed.lengths),
            **profile_trainer(timed.run, timed.state, batch, work, log, reps=w["reps"])}


# ---------------------------------------------------------------------------- phase: attention (optional)
def attention_snapshots(mode: str, page: int):
    """The first step model's rollout as its decode attention sees it: every row starts at once (one slot
    each), row n holding prompt + t + 1 tokens at decode step t < L_n and idle (0) after. Returns
    (kv_len [N, S] at t = 0, ATTENTION_STRIDE, ..., table width W in pages, the model's size fields)."""
    import numpy as np

    from jaxrl4llm.sampling.continuous import shard_sizes

    w = WORKLOAD[mode]
    fields = model_fields(mode, next(iter(MODELS[mode])))
    lengths = forced_lengths(mode)
    prompt = ATTENTION_PROMPT_TOKENS[mode]
    sizes = shard_sizes(prompts_per_shard=w["prompts"], slots_per_shard=len(lengths), samples=w["samples"],
                        prompt_len=ATTENTION_PROMPT_WIDTH[mode], max_new_tokens=w["max_new_tokens"], page_size=page)
    steps = np.arange(0, int(lengths.max()), ATTENTION_STRIDE if mode == "gpu" else 4)
    kv_len = np.where(steps[:, None] < lengths[None], prompt + steps[:, None] + 1, 0).astype(np.int32)
    return kv_len, sizes.table_pages, fields


# the rollout's prompts: 55 real tokens on average in a 64-token bucket (the step phase's demo prompts)
ATTENTION_PROMPT_TOKENS, ATTENTION_PROMPT_WIDTH = {"gpu": 55, "dry": 5}, {"gpu": 64, "dry": 8}


def phase_attention(mode: str, work: Path, log) -> dict:
    """`gpu_paged_attention` alone at the rollout's kv lengths (`attention_snapshots`), one program a
    configuration of ATTENTION_CONFIGS that runs every snapshot: the rollout's attention seconds it
    predicts (layers x ATTENTION_STRIDE x the program's time), and its output's relative error against
    the default configuration's (bf16: the partitions round probabilities apart). The fastest whose
    output agrees goes to ATTENTION_CHOICE in the check's work folder (`attention_choice`), for the later
    phases. Pallas' interpreter and four configurations on the dry run."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    page = 16
    kv_len, width, fields = attention_snapshots(mode, page)
    snaps, slots = kv_len.shape
    kvh, group, dh = fields["num_kv_heads"], fields["num_heads"] // fields["num_kv_heads"], fields["head_dim"]
    rng = np.random.default_rng(0)
    pages = slots * width + 1
    pool = jnp.asarray(rng.standard_normal((pages, page, 2 * kvh, dh)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((slots, kvh, group, dh)), jnp.float32)
    table = jnp.asarray(1 + rng.permutation(slots * width).reshape(slots, width), jnp.int32)
    stride = ATTENTION_STRIDE if mode == "gpu" else 4
    configs = ATTENTION_CONFIGS if mode == "gpu" else ATTENTION_DRY_CONFIGS
    reps = 5 if mode == "gpu" else 1
    live = jnp.asarray(kv_len > 0)
    default_config = (gpa.LAYOUT, gpa.default_pages_per_block(gpa.LAYOUT), gpa.K_SPLITS, gpa.NUM_WARPS,
                      gpa.SPLIT_RULE, gpa.STORE)
    rows, reference = [], None
    for layout, per_block, splits, warps, rule, store in configs:
        block, k, padded = gpa.kernel_blocks(width, slots, gpa.program_shape(kvh, group, layout)[0], per_block, splits)
        default = (layout, per_block, splits, warps, rule, store) == default_config
        name = f"{layout}: {block} pages/step, {k} partitions{'' if splits else ' (the rule)'}, {warps} warps, " \
               f"{rule} split, {store} stores" + (" (default)" if default else "")
        try:
            one = functools.partial(gpa.gpu_paged_attention_one_shard, layout=layout, pages_per_block=per_block,
                                    k_splits=splits, num_warps=warps, split_rule=rule, store=store,
                                    interpret=mode == "dry")
            program = jax.jit(lambda q, pool, table, kv_len: jax.lax.map(lambda n: one(q, pool, table, n), kv_len))
            out = jax.block_until_ready(program(q, pool, table, kv_len))
            seconds = median_seconds(lambda: jax.block_until_ready(program(q, pool, table, kv_len)), reps)
            out = jnp.where(live[..., None, None, None], out, 0.0)
            if reference is None:
                reference = out
            rel = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
            row = {"config": name, "layout": layout, "pages_per_block": block, "k_splits": k, "rule_splits": splits is None,
                   "num_warps": warps, "split_rule": rule, "store": store, "padded_pages": padded,
                   "program_ms": 1e3 * seconds, "rollout_attention_s": fields["num_layers"] * stride * seconds,
                   "rel_to_default": rel, "default": default}
        except Exception as e:  # noqa: BLE001 - a configuration Triton refuses is a row of the table
            row = {"config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {row}")
        rows.append(row)
    timed = [r for r in rows if "error" not in r]
    if not timed:
        raise PhaseFailed("no configuration ran", {"rows": rows})
    default = timed[0]["rollout_attention_s"] if rows[0] is timed[0] and rows[0]["config"].endswith("(default)") \
        else float("nan")
    for r in timed:
        r["default_over_this"] = default / r["rollout_attention_s"]
    bad = [r["config"] for r in timed if not r["rel_to_default"] <= 2e-2]
    best = min((r for r in timed if r["config"] not in bad), key=lambda r: r["rollout_attention_s"])
    choice = attention_choice(best)
    write_record(work.parent / ATTENTION_CHOICE, choice)
    log(f"  fastest: {best['config']}; later phases set {choice}")
    figures = {"snapshots": snaps, "slots": slots, "table_pages": width, "stride": stride, "rows": rows,
               "best": best["config"], "choice": choice}
    if bad:
        raise PhaseFailed(f"outputs off the default's by more than 2e-2: {', '.join(bad)}", figures)
    return figures


def attention_choice(row: dict) -> dict:
    """The `gpu_paged_attention` constants (by name) that make a sweep row's configuration the one every
    call traces with: layout, its pages a loop step, partitions (None: the GRID_TARGET rule, as the row
    ran), warps, split rule, store."""
    per_block = "SLOT_PAGES_PER_BLOCK" if row["layout"] == "per_slot" else "PAGES_PER_BLOCK"
    return {"LAYOUT": row["layout"], per_block: row["pages_per_block"],
            "K_SPLITS": None if row.get("rule_splits") else row["k_splits"], "NUM_WARPS": row["num_warps"],
            "SPLIT_RULE": row["split_rule"], "STORE": row["store"], "config": row["config"]}


def use_attention_choice(choice: dict, log) -> None:
    """Set `gpu_paged_attention`'s constants to `choice` (`attention_choice`) in this process, before
    anything traces: every paged attention call of the sampler reads them when it traces."""
    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    for name, value in choice.items():
        if name != "config":
            if not hasattr(gpa, name):
                raise PhaseFailed(f"{ATTENTION_CHOICE} sets {name}, which gpu_paged_attention does not have", {})
            setattr(gpa, name, value)
    log(f"  paged attention: {choice['config']} (the attention phase's choice)")


def read_attention_choice(work_root: Path) -> dict | None:
    """The attention phase's choice in this check's work folder (None: that phase has not run)."""
    path = work_root / ATTENTION_CHOICE
    return json.loads(path.read_text()) if path.is_file() else None


def phase_baseline(mode: str, work: Path, log) -> dict:
    """The first step model's rollout under the default attention configuration (this process reads no
    choice), beside the step phase's rollout under the attention phase's choice: seconds, generated
    tokens/s and default / chosen. Nothing runs when the choice is the default."""
    choice = read_attention_choice(work.parent)
    if choice is None:
        raise PhaseFailed("needs the attention phase's choice (run it in the same check: --phases attention,step,...)",
                          {})
    model = next(iter(MODELS[mode]))
    step = read_record(work.parent, f"step:{model}")
    if step["status"] != "ok" and not step["figures"].get("rollout_s"):
        raise PhaseFailed(f"needs the rollout of step:{model} ({step['status']})", {})
    chosen_s = step["figures"].get("measured", {}).get("sampler/decode") or step["figures"]["rollout_s"]
    sweep = read_record(work.parent, "attention")["figures"]
    default = next((r for r in sweep.get("rows", []) if r.get("default")), None)
    if default is None or default["config"] == choice["config"]:
        return {"config": choice["config"], "note": "the default is the fastest: the step phase's rollout is the baseline"}
    timed = timed_rollout(mode, work, log, model)
    tokens = float(timed.lengths.sum())
    return {"config": default["config"], "rollout_s": timed.rollout_s, "rollout_first_s": timed.first_s,
            "tokens_per_s": tokens / timed.rollout_s, "predicted_attention_s": default["rollout_attention_s"],
            "chosen": choice["config"], "chosen_rollout_s": chosen_s, "chosen_tokens_per_s": tokens / chosen_s,
            "chosen_predicted_attention_s": next(r["rollout_attention_s"] for r in sweep["rows"]
                                                  if r.get("config") == choice["config"]),
            "default_over_chosen": timed.rollout_s / chosen_s}


# ---------------------------------------------------------------------------- phase: exact (optional)
def phase_exact(mode: str, work: Path, log) -> dict:
    """kernels/exact_pallas.py natively (the interpreter on the dry run): for each kernel, whether a row
    computed with other rows (or, for attention, as a decode step over gathered keys) has the bits of the
    same row in a full call, its max error against XLA, and its time. PhaseFailed when a row moves."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl4llm.kernels import exact_pallas
    from jaxrl4llm.kernels.exact import _apply_rope_reference, segment_ranges

    interpret = mode == "dry"
    rng = np.random.default_rng(0)
    size = 1024 if mode == "gpu" else 256
    heads, kv_heads, head_dim, length = (16, 8, 128, 256) if mode == "gpu" else (4, 2, 16, 48)
    figures: dict = {}

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        return np.asarray(out), time.perf_counter() - start

    x = rng.standard_normal((64, size)).astype(np.float32)
    w = rng.standard_normal((size, size)).astype(np.float32) / np.sqrt(size)
    full, seconds = timed(lambda x, w: exact_pallas.matmul(x, w, interpret=interpret), x, w)
    part = np.asarray(exact_pallas.matmul(x[5:8], w, interpret=interpret))
    figures["matmul"] = {"invariant": bool(np.array_equal(part, full[5:8])), "seconds": seconds,
                         "max_err": float(np.abs(full - x.astype(np.float64) @ w).max())}
    q = rng.standard_normal((1, length, heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, length, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    first, last = length // 4, length - 3  # a packed sequence [first, length), its query at `last`
    ranges = segment_ranges(jnp.asarray([[1] * first + [2] * (length - first)]))
    train, seconds = timed(lambda *a: exact_pallas.attention(*a, interpret=interpret), q, k, v, ranges)
    slot_k, slot_v = (np.zeros((1, 2 * length, kv_heads, head_dim), np.float32) for _ in range(2))
    seen = last + 1 - first
    slot_k[0, :seen], slot_v[0, :seen] = k[0, first:last + 1], v[0, first:last + 1]
    decode = np.asarray(exact_pallas.attention(q[:, last:last + 1], slot_k, slot_v, jnp.asarray([[[0, seen, 0, 0]]]),
                                               interpret=interpret))
    group = heads // kv_heads
    keys, values = np.repeat(k[0, first:last + 1], group, 1), np.repeat(v[0, first:last + 1], group, 1)
    scores = np.einsum("hd,shd->hs", q[0, last].astype(np.float64), keys) / np.sqrt(head_dim)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    reference = np.einsum("hs,shd->hd", probs / probs.sum(-1, keepdims=True), values)
    figures["attention"] = {"invariant": bool(np.array_equal(decode[0, 0], train[0, last])), "seconds": seconds,
                            "max_err": float(np.abs(train[0, last] - reference).max())}
    z = rng.standard_normal((64, size)).astype(np.float32) * 3
    tokens = jnp.asarray(rng.integers(0, size, 64))
    logp, seconds = timed(lambda z, t: exact_pallas.token_logprob(z, t, interpret=interpret), z, tokens)
    inverse = np.asarray(exact_pallas.rms_inverse(x, 1e-6, interpret=interpret))
    angles = np.arange(64)[:, None] * (1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim))[None]
    cos, sin = (np.concatenate([f(angles)] * 2, -1).astype(np.float32) for f in (np.cos, np.sin))
    xr = rng.standard_normal((64, 2, head_dim)).astype(np.float32)
    rope = np.asarray(exact_pallas.apply_rope(xr, cos, sin, interpret=interpret))
    s = slice(5, 8)
    figures["rows"] = {
        "invariant": bool(np.array_equal(np.asarray(exact_pallas.token_logprob(z[s], tokens[s], interpret=interpret)),
                                         logp[s])
                          and np.array_equal(np.asarray(exact_pallas.rms_inverse(x[s], 1e-6, interpret=interpret)),
                                             inverse[s])
                          and np.array_equal(np.asarray(exact_pallas.apply_rope(xr[s], cos[s], sin[s],
                                                                                interpret=interpret)), rope[s])),
        "logprob_max_err": float(np.abs(logp - np.asarray(jax.nn.log_softmax(z)[np.arange(64), tokens])).max()),
        "rms_max_err": float(np.abs(inverse - 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-6)).max()),
        "rope_max_err": float(np.abs(rope - np.asarray(_apply_rope_reference(xr[None], cos[None], sin[None]))[0]).max()),
        "logprob_seconds": seconds}
    log(json.dumps(figures))
    moved = [name for name, f in figures.items() if not f["invariant"]]
    if moved:
        raise PhaseFailed(f"rows moved with their companions in: {', '.join(moved)}", figures)
    return figures


# The agreement phase's model and rollout: a random Qwen3-shaped model (head_dim 128 on the GPU, GQA 2:1)
# and P prompts x G samples x R new tokens, bf16; the dry run's is tiny and uses the CPU's C++ exact kernels
# (the Pallas route in the interpreter is tests/kernels/test_exact.py's).
AGREEMENT = {
    "gpu": dict(hidden=1024, layers=8, heads=8, kv_heads=4, vocab=32768, prompts=8, samples=4, new_tokens=128,
                repeats=1),  # one timed run: exact mode's Pallas kernels are untimed on a chip (fixed tiles)
    "dry": dict(hidden=32, layers=2, heads=4, kv_heads=2, vocab=128, prompts=2, samples=2, new_tokens=8, repeats=1),
}


def phase_agreement(mode: str, work: Path, log) -> dict:
    """`numerics.compare` on the device: for default and exact numerics, rollout and update tokens/s
    and the sampled tokens whose log-probs differ in any bit from the trainer's recompute.
    PhaseFailed when exact mode leaves a token differing (issue #39: it must be 0 on every device)."""
    from numerics import compare, random_prompts, tiny_config

    a = AGREEMENT[mode]
    config = tiny_config(a["hidden"], "bfloat16", a["layers"], a["heads"], a["kv_heads"], a["vocab"])
    figures = compare(config, random_prompts(a["prompts"], a["vocab"]), a["new_tokens"], a["samples"], a["repeats"])
    figures["model"] = {k: a[k] for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    log(json.dumps(figures))
    exact = figures["exact"]
    if exact["differing"]:
        raise PhaseFailed(f"exact numerics: {exact['differing']} of {exact['tokens']} sampled tokens' log-probs "
                          "differ from the trainer's", figures)
    return figures


# ---------------------------------------------------------------------------- phase: moe (optional)
# The moe phase's expert layer: Qwen3-30B-A3B's (configs/models/qwen3_30b_a3b_base.yaml: hidden 2048,
# moe_intermediate_size 768, 128 experts, top 8), held float32 and multiplied in bfloat16 as the trainer
# runs it, at a micro-batch's tokens on one chip (4096, 16384) and at 1024. On the CPU (2026-12-06, jax
# 0.10.2, XLA's memory analysis of forward + backward at 16384 tokens) dense_capacity's temporaries were
# 42 GiB and ragged_dot's, expanded over all experts, 478 GiB (120 at 4096, 30 at 1024 against
# dense_capacity's 10.5 and 2.6): a ragged_dot expanded so on the GPU runs out of memory at the
# micro-batch counts (that error is then its row), and 1024 tokens still gives a verdict. `reference`
# unrolls a loop of the E experts into the program (a test oracle): too slow to compile at 128 experts
# within the budget, it runs on the dry run only.
MOE_SHAPES = {
    "gpu": dict(tokens=(1024, 4096, 16384), hidden=2048, width=768, experts=128, k=8, iters=5, dtype="bfloat16",
                forms=("dense_capacity", "ragged_dot")),
    "dry": dict(tokens=(32, 64), hidden=64, width=32, experts=8, k=2, iters=5, dtype="bfloat16",
                forms=("dense_capacity", "ragged_dot", "reference")),
}


def moe_verdict(ragged_s: float, dense_s: float, experts: int, k: int) -> tuple[str, float]:
    """(verdict, multiple): ragged_dot's time as a multiple of the useful FLOPs at dense_capacity's rate
    (dense_capacity runs E/k times the useful FLOPs: multiple = ragged_s / dense_s * E / k), and what it
    says: "grouped matmul" at most a quarter of E/k, "dense expansion" at least half of it, else
    "between" (a grouped matmul slower than dense_capacity's large einsums, or a partial expansion)."""
    multiple = ragged_s / dense_s * experts / k
    if multiple <= experts / k / 4:
        return "grouped matmul", multiple
    return ("dense expansion" if multiple >= experts / k / 2 else "between"), multiple


def phase_moe(mode: str, work: Path, log, partial=lambda figures: None) -> dict:
    """The expert layer's forms (`benchmarks/moe_forms.time_forms`) at MOE_SHAPES[mode]: per token count
    and form, seconds forward and forward + backward, XLA's FLOPs, TFLOP/s on the useful FLOPs
    (2 N k 3 D I forward, 3x with backward) and the time over dense_capacity's; per token count, whether
    ragged_dot runs as a grouped matmul or as a dense expansion over all experts (`moe_verdict`; or its
    running out of memory where dense_capacity ran). A form that fails is its row's error; PhaseFailed
    when no token count gave a verdict."""
    from moe_forms import time_forms, useful_flops

    s = MOE_SHAPES[mode]
    e, k = s["experts"], s["k"]
    figures: dict = {"shapes": {n: s[n] for n in ("hidden", "width", "experts", "k", "dtype")}, "rows": [],
                     "verdicts": {}}
    if "reference" not in s["forms"]:
        figures["skipped"] = f"reference: a loop of {e} experts unrolled into the program (a test oracle), not timed here"
    peaks = read_record(work.parent, "peaks")
    if peaks["status"] == "ok":
        figures["peak_tflops"] = peaks["figures"]["peak_flops"] / 1e12
    for tokens in s["tokens"]:
        useful = useful_flops(tokens, s["hidden"], s["width"], k)
        timed = {}
        for form in s["forms"]:  # one at a time: a form that runs out of memory leaves the others their rows
            try:
                timed.update(time_forms(tokens, s["hidden"], s["width"], e, k, s["iters"], dtype=s["dtype"],
                                        forms=(form,), forward=True, log=log))
            except Exception as err:  # noqa: BLE001 - reported as the row's error; the next form runs
                figures["rows"].append({"tokens": tokens, "form": form, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                log(f"  {form} N={tokens}: {type(err).__name__}: {str(err)[:300]}")
        base = timed.get("dense_capacity")
        for form, r in timed.items():
            figures["rows"].append({
                "tokens": tokens, "form": form, **r, "xla_over_useful": r["fwd_bwd_flops"] / (3 * useful),
                "temp_gib_fwd_bwd": r["fwd_bwd_temp_bytes"] / 2**30,
                "useful_tflops_fwd": useful / r["fwd_s"] / 1e12, "useful_tflops_fwd_bwd": 3 * useful / r["fwd_bwd_s"] / 1e12,
                "fwd_over_dense": r["fwd_s"] / base["fwd_s"] if base else float("nan"),
                "fwd_bwd_over_dense": r["fwd_bwd_s"] / base["fwd_bwd_s"] if base else float("nan")})
        if base and "ragged_dot" in timed:
            rd = timed["ragged_dot"]
            verdict, multiple = moe_verdict(rd["fwd_bwd_s"], base["fwd_bwd_s"], e, k)
            fwd_multiple = moe_verdict(rd["fwd_s"], base["fwd_s"], e, k)[1]
            figures["verdicts"][str(tokens)] = {"verdict": verdict, "multiple_fwd_bwd": multiple,
                                                "multiple_fwd": fwd_multiple,
                                                "temp_over_dense": rd["fwd_bwd_temp_bytes"] / base["fwd_bwd_temp_bytes"]}
            log(f"  {tokens} tokens: ragged_dot forward+backward {rd['fwd_bwd_s'] * 1e3:.3g} ms, "
                f"{rd['fwd_bwd_s'] / base['fwd_bwd_s']:.2f}x dense_capacity's; its time is {multiple:.1f}x the useful "
                f"FLOPs at dense_capacity's rate (forward {fwd_multiple:.1f}x; a dense expansion is {e / k:g}x), "
                f"XLA counts {rd['fwd_bwd_flops'] / (3 * useful):.1f}x, temporaries "
                f"{rd['fwd_bwd_temp_bytes'] / 2**30:.3g} GiB ({figures['verdicts'][str(tokens)]['temp_over_dense']:.2f}x "
                f"dense_capacity's): {verdict}")
        elif base and any(r["form"] == "ragged_dot" and r["tokens"] == tokens and "RESOURCE_EXHAUSTED" in r["error"]
                          for r in figures["rows"] if "error" in r):
            figures["verdicts"][str(tokens)] = {"verdict": "out of memory where dense_capacity (every expert on "
                                                           "every token) ran: an expansion"}
            log(f"  {tokens} tokens: ragged_dot {figures['verdicts'][str(tokens)]['verdict']}")
        partial(figures)
    if not figures["verdicts"]:
        raise PhaseFailed("no token count gave a verdict (ragged_dot against dense_capacity)", figures)
    return figures


# ---------------------------------------------------------------------------- phase: tools (optional)
# The tools phase's workload: benchmarks/tool_rollout.py's arms (plain, segments, tools; its DEFAULTS: 8
# prompts x 8 samples, lengths lognormal mean 160, sigma 0.5, at most 256 tokens, 16-token observations,
# 4 calls a row at most) at Qwen3-0.6B's shapes and vocabulary (random weights, bf16) on 64 slots, a
# stand-in tool of 20 ms and of 200 ms a batch of calls, a run each. The real vocabulary still calls: a
# random model of these shapes sampled its most frequent token 1.6% of the time on the CPU (6 of 376
# tokens, 2026-12-06), about 2 calls in a 160-token row. The second run reuses the first's compiled
# programs (0.2 s against 21 s for the first on the dry run). The dry run's is the demo size (vocabulary 100).
TOOLS = {
    "gpu": dict(size="qwen3-0.6b", slots=64, dtype="bfloat16", repeats=2, tool_ms=(20.0, 200.0)),
    "dry": dict(size="demo", prompts=2, samples=4, slots=8, max_new_tokens=48, lengths="lognormal:mean=24,sigma=0.5",
                dtype="bfloat16", repeats=1, tool_ms=(2.0, 20.0)),
}


def phase_tools(mode: str, work: Path, log, partial=lambda figures: None) -> dict:
    """Rollouts with tool calls against rollouts without (`benchmarks/tool_rollout.measure`) at TOOLS[mode],
    a run per tool time: per arm tokens/s, time against plain, decode steps, segments, calls a row, tool
    seconds and the share hidden behind decoding, the parked share. PhaseFailed when the tools arm made
    no call (its figures then measure nothing)."""
    from tool_rollout import DEFAULTS, measure

    workload = {**DEFAULTS, **{n: v for n, v in TOOLS[mode].items() if n != "tool_ms"}}
    figures: dict = {"workload": {n: v for n, v in workload.items() if v is not None}, "runs": {}}
    for tool_ms in TOOLS[mode]["tool_ms"]:
        f = measure(**{**workload, "tool_ms": tool_ms})
        figures["runs"][f"{tool_ms:g}"] = f
        figures.update(vocab=f["vocab"], tokens=f["tokens"])
        for arm, a in f["arms"].items():
            log(f"  tool {tool_ms:g} ms, {arm}: {json.dumps(a)}")
        partial(figures)
    silent = [ms for ms, f in figures["runs"].items() if not f["arms"]["tools"]["calls_per_row"]]
    if silent:
        raise PhaseFailed(f"the tools arm made no call (tool {', '.join(silent)} ms): the random model's most "
                          f"sampled token ({figures['runs'][silent[0]]['trigger_share']:.2%}) is too rare at vocabulary "
                          f"{figures['vocab']}; set TOOLS' vocab (e.g. 100)", figures)
    return figures


# ---------------------------------------------------------------------------- phase: plan (background)
def phase_plan(mode: str, work: Path, log, partial=lambda figures: None) -> dict:
    """`jaxrl4llm plan --json` of each step phase's run on `plan_topology`, at the rollout's own
    lengths and real prompt tokens (JAX_PLATFORMS=cpu: XLA's CUDA compiler on this host's CPU)."""
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.prompts import load_prompt_sets
    from plan_accuracy import CONFIG_FILES

    w = WORKLOAD[mode]
    lengths = [int(x) for x in forced_lengths(mode)]
    peaks = read_record(work.parent, "peaks")
    flags = plan_flags(peaks["figures"] if peaks["status"] == "ok" else None)
    topology = plan_topology(mode, peaks.get("device", ""))
    figures = {}
    for model in MODELS[mode]:
        root = work / model
        root.mkdir(parents=True, exist_ok=True)
        overrides = step_overrides(mode, model, root / "run")
        train_set, _ = load_prompt_sets(load_config(CONFIG_FILES, overrides))
        prompt_tokens = sum(len(train_set.token_ids[i]) for i in range(w["prompts"])) / w["prompts"]
        lengths_file = root / "response_lengths.jsonl"
        lengths_file.write_text(json.dumps({"step": 1, "response_lengths": lengths}) + "\n")
        command = [*plan_command(work.parent), "plan", *(f"--config={c}" for c in CONFIG_FILES), *overrides,
                   "--topology", topology, "--json", "--response-lengths", str(lengths_file),
                   "--prompt-tokens", f"{prompt_tokens:.2f}", *flags]
        log(f"  {model}: jaxrl4llm plan --config={CONFIG_FILES[0]} ... --topology {topology} {' '.join(flags)}")
        t0 = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        log(done.stderr[-3000:])
        if done.returncode not in (0, 1):  # 1: a program does not fit (the plan is still printed)
            raise PhaseFailed(f"plan of {model} exited {done.returncode}: {done.stderr.strip()[-800:]}", figures)
        plan = json.loads(done.stdout)
        figures[model] = {
            "topology": plan["topology"], "fits": plan["fits"], "compile_s": time.perf_counter() - t0,
            "chip": plan["chip"], "predicted": {p["name"]: p["seconds"] * p["runs"] for p in plan["programs"]},
            "binding": {p["name"]: p["binding"] for p in plan["programs"]}, "step_s": plan["step_seconds"]}
        partial(figures)  # what is planned so far survives a timeout
    return figures


def plan_command(work_root: Path) -> list[str]:
    """The command that runs `jaxrl4llm <args>` for the plan phase: the CLI itself, or, when the attention
    phase chose a configuration, the CLI after `gpu_paged_attention`'s constants are set to it (plan
    compiles the sampler's programs with the kernel the step phases run)."""
    choice = work_root / ATTENTION_CHOICE
    if not choice.is_file():
        return [sys.executable, "-m", "jaxrl4llm.cli"]
    code = (f"import json, sys\nsys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
            "from gpu_check import read_attention_choice, use_attention_choice\n"
            "from pathlib import Path\n"
            "use_attention_choice(read_attention_choice(Path(sys.argv[1])), lambda line: print(line, file=sys.stderr))\n"
            "from jaxrl4llm.cli import main\nsys.exit(main(sys.argv[2:]))")
    return [sys.executable, "-c", code, str(work_root)]


# ---------------------------------------------------------------------------- phase: decode
def phase_decode(mode: str, work: Path, log) -> dict:
    """Generated tokens/s of the continuous engine (the first step phase's rollout: its rows, forced
    lengths and weights) against the HBM roofline (weights + live KV a step / the read bandwidth
    the peaks phase measured: a decode step reads far more than it writes) and against transformers' `generate` on the same weights (the step phase's export)
    on the same device, every row generating the rollout's mean length."""
    import jax
    import numpy as np

    from jaxrl4llm.models import ModelConfig
    from jaxrl4llm.sampling.continuous import BURST
    from sampler import TransformersPeer, continuous_steps, ragged_decode_bytes

    w = WORKLOAD[mode]
    model = next(iter(MODELS[mode]))
    step = read_record(work.parent, f"step:{model}")
    if step["status"] != "ok":
        raise PhaseFailed(f"needs the rollout of step:{model}, which did not run ({step['status']})", {})
    f = step["figures"]
    gpu = jax.default_backend() == "gpu"
    lengths = forced_lengths(mode)
    g, rows = w["samples"], w["prompts"] * w["samples"]
    peaks = read_record(work.parent, "peaks")
    if peaks["status"] != "ok":
        raise PhaseFailed(f"needs the read bandwidth of the peaks phase ({peaks['status']})", {})
    bandwidth = peaks["figures"]["read_bandwidth"]
    folder = f["export"]
    config = ModelConfig.from_pretrained_dir(folder)
    hf_tokens = max(1, int(round(lengths.mean())))
    prompt_len = max(1, int(round(f["prompt_tokens"])))
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (w["prompts"], prompt_len))
    with TransformersPeer(None, "bfloat16", folder, device="cuda" if gpu else "cpu") as peer:
        t_hf = min(peer.time_generate(prompts, g, hf_tokens, True) for _ in range(w["reps"]))
    t_ours = f["measured"]["sampler/decode"]
    steps = continuous_steps(lengths, g, rows, BURST)
    roof_bytes = ragged_decode_bytes(config, np.repeat(f["prompt_lens"], g), lengths, steps, 2)
    roof_s = roof_bytes / bandwidth
    tokens = float(lengths.sum())
    log(f"  ours {tokens / t_ours:.0f} tok/s, roofline {tokens / roof_s:.0f} tok/s (at the read bandwidth, "
        f"{bandwidth / 1e9:.0f} GB/s), transformers {rows * hf_tokens / t_hf:.0f} tok/s")
    return {"model": model, "rows": rows, "mean_length": float(lengths.mean()), "prompt_tokens": f["prompt_tokens"],
            "roofline_bandwidth": "read", "read_bandwidth_gb_s": bandwidth / 1e9,
            "copy_bandwidth_gb_s": peaks["figures"]["hbm_bandwidth"] / 1e9, "ours_s": t_ours, "ours_tokens_per_s": tokens / t_ours,
            "decode_steps": steps, "roofline_gb": roof_bytes / 1e9, "roofline_s": roof_s,
            "roofline_tokens_per_s": tokens / roof_s, "roofline_use": roof_s / t_ours,
            "transformers_new_tokens": hf_tokens, "transformers_s": t_hf,
            "transformers_tokens_per_s": rows * hf_tokens / t_hf,
            "ours_over_transformers": (tokens / t_ours) / (rows * hf_tokens / t_hf)}


# ---------------------------------------------------------------------------- phase: tests
def phase_tests(mode: str, work: Path, log, out_dir: Path, seconds: float) -> dict:
    """`pytest -m gpu` on the kernel tests (collection only on the dry run: they run in CI on the CPU);
    the full output goes to pytest_gpu.log."""
    import re

    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               "tests/models/test_segment_attention.py", "tests/sampling"] + (["--collect-only"] if mode == "dry" else [])
    with open(out_dir / "pytest_gpu.log", "w") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        try:
            rc = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=max(seconds - 5, 5)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = (out_dir / "pytest_gpu.log").read_text().strip().splitlines()[-1:]
    log(f"  pytest exit {rc}: {tail[0] if tail else ''}")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|tests? collected)",
                                             tail[0] if tail else "")}
    figures = {"exit": rc, "summary": tail[0] if tail else "", **counts}
    unknown = "Unknown marker" in (out_dir / "pytest_gpu.log").read_text()  # pytest 9: -m of an unregistered marker
    if rc == 5 or (rc == 4 and unknown):  # nothing selected: no test carries the gpu marker (yet)
        figures["note"] = "no test is marked gpu (the marker is not registered yet)" if unknown else "no test is marked gpu"
    elif rc != 0:
        raise PhaseFailed(f"pytest -m gpu exited {rc}: {figures['summary']}", figures)
    return figures


# ---------------------------------------------------------------------------- phase: demo
# The demo on the GPU: 20 RL steps, evaluated at 0 and 20 on 100 problems. On an H100 (2026-11-27) the
# run is compile-bound: 148 s in all, of which 14 s imports, ~40 s the SFT warm start's compile, ~80 s the
# evaluation's and the first RL step's compiles, and ~1 s the 19 other steps; held-out accuracy rose
# 38.2% -> 64.8%. The full 60 steps (more evaluations) did not fit the phase's 150 s.
DEMO_GPU = ["trainer.steps=20", "data.eval_limit=100"]


def phase_demo(mode: str, work: Path, log) -> dict:
    """`jaxrl4llm demo` (DEMO_GPU's 20 steps on the GPU, its quick form on the dry run): held-out
    accuracy before -> after, seconds."""
    from jaxrl4llm.train.demo import run_demo

    quick = mode == "dry"
    overrides = ["trainer.progress_bar=false", "trainer.compile_cache=false"] + ([] if quick else DEMO_GPU)
    if quick:  # the smallest run that still evaluates before and after
        overrides += ["data.eval_limit=4", "trainer.steps=1", "rollout.prompts_per_step=2",
                      "rollout.samples_per_prompt=2", "trainer.mini_batches=1", "trainer.eval_samples=1",
                      "trainer.export_hf=false"]
    summary = run_demo(out_dir=str(work / "demo"), overrides=overrides, quick=quick, log=log,
                       sft_steps=5 if quick else None)
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if "accuracy" not in before or "accuracy" not in after:
        raise PhaseFailed("the demo did not report held-out accuracy before and after", {})
    log(f"  held-out accuracy {100 * before['accuracy']:.1f}% -> {100 * after['accuracy']:.1f}%")
    return {"quick": quick, "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "seconds": summary["total_seconds"]}


class PhaseFailed(Exception):
    """A phase's check failed; `figures` are what it measured before."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


def run_phase(name: str, mode: str, work: Path, result: Path, out_dir: Path, seconds: float) -> int:
    """Run phase `name` (`step:<model>` for a step) in this process; write {status, seconds, figures,
    error, device} to `result`."""
    def log(line: str) -> None:
        print(line, flush=True)

    if mode == "dry":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record = {"status": "ok", "figures": {}, "error": ""}
    choice = None
    try:
        kind, _, model = name.partition(":")
        choice = read_attention_choice(work.parent) if kind in READS_ATTENTION_CHOICE else None
        if choice is not None and kind != "plan":  # plan's CLI process sets it (`plan_command`)
            use_attention_choice(choice, log)
        if kind == "step":
            record["figures"] = phase_step(mode, work, log, model, partial=lambda figures: write_record(result, {
                "status": "timeout", "figures": figures, "error": "ran out of time after the rollout"}))
        elif kind == "tests":
            record["figures"] = phase_tests(mode, work, log, out_dir, seconds)
        elif kind == "demo":
            record["figures"] = phase_demo(mode, work, log)
        elif kind == "launches":
            record["figures"] = phase_launches(mode, work, log, model)
        elif kind == "exact":
            record["figures"] = phase_exact(mode, work, log)
        elif kind in ("moe", "tools"):  # each run (a token count, a tool time) kept if a later one runs out of time
            record["figures"] = {"moe": phase_moe, "tools": phase_tools}[kind](
                mode, work, log, partial=lambda figures: write_record(result, {
                    "status": "timeout", "figures": figures, "error": "ran out of time after a partial run"}))
        elif kind == "agreement":
            record["figures"] = phase_agreement(mode, work, log)
        elif kind == "profile":
            record["figures"] = phase_profile(mode, work, log)
        elif kind == "trainer":
            record["figures"] = phase_trainer(mode, work, log)
        elif kind == "attention":
            record["figures"] = phase_attention(mode, work, log)
        elif kind == "baseline":
            record["figures"] = phase_baseline(mode, work, log)
        elif kind == "plan":
            record["figures"] = phase_plan(mode, work, log, partial=lambda figures: write_record(result, {
                "status": "timeout", "figures": figures, "error": f"ran out of time after {', '.join(figures)}"}))
        elif kind == "kernels":
            record["figures"] = phase_kernels(mode, work, log, partial=lambda figures: write_record(result, {
                "status": "timeout", "figures": figures, "error": f"ran out of time after {', '.join(figures)}"}))
        else:
            record["figures"] = {"peaks": phase_peaks, "decode": phase_decode}[kind](mode, work, log)
    except PhaseFailed as e:
        record.update(status="fail", error=str(e), figures=e.figures)
    except Exception as e:  # noqa: BLE001 - reported in the table; the driver runs the next phase
        record.update(status="fail", error=f"{type(e).__name__}: {str(e)[:1000]}")
        traceback.print_exc()
    record["seconds"] = time.perf_counter() - t0
    if choice is not None:
        record["attention_choice"] = choice["config"]
    if name != "plan":  # the plan phase runs on the CPU beside the GPU phases
        try:
            record.update(device_info())
        except Exception:  # noqa: BLE001
            pass
    write_record(result, record)
    return 0


def write_record(path: Path, record: dict) -> None:
    """Write a phase's record whole or not at all (the driver may kill the phase at any moment)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(record, default=float))
    part.replace(path)


# ---------------------------------------------------------------------------- driver
def work_path(work: Path, name: str) -> Path:
    """The folder of phase `name` under the check's work folder."""
    return work / name.replace(":", "_")


def result_path(work: Path, name: str) -> Path:
    """Where phase `name` writes its record (a later phase may read an earlier one's)."""
    return work / f"{name.replace(':', '_')}.json"


def read_record(work: Path, name: str) -> dict:
    """Phase `name`'s record ({"status": "not run"} when there is none)."""
    path = result_path(work, name)
    return json.loads(path.read_text()) if path.is_file() else {"status": "not run", "figures": {}}


def fetch_wheels() -> int:
    """Download WHEELS for the GPU host's Python 3.12 into .gpu_wheels/ (run here, with internet)."""
    WHEEL_DIR.mkdir(exist_ok=True)
    for requirement in WHEELS.values():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                   "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(WHEEL_DIR), requirement]
        print("$", " ".join(command[3:]), flush=True)
        subprocess.run(command, check=True)
    total = sum(f.stat().st_size for f in WHEEL_DIR.glob("*.whl"))
    print(f"{len(list(WHEEL_DIR.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {WHEEL_DIR}")
    return 0


def wheel_files(requirement: str) -> list[Path]:
    """The wheel(s) of `name==version` in WHEEL_DIR (pip normalises '-' to '_' in file names)."""
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower()
    return sorted(f for f in WHEEL_DIR.glob("*.whl") if f.name.lower().startswith(f"{stem}-{version}-"))


def setup(site: Path, env: dict, log) -> dict:
    """Probe the phases' Python for each module of WHEELS; pip-install the missing ones from
    .gpu_wheels/ into `site` (put on PYTHONPATH); probe again."""
    def probe(modules) -> dict:
        """{module: its ImportError} of the modules the phases' Python cannot import (one process)."""
        code = ("import importlib, json, sys\nbad = {}\nfor m in sys.argv[1:]:\n    try:\n"
                "        importlib.import_module(m)\n    except Exception as e:\n"
                "        bad[m] = f'{type(e).__name__}: {e}'\nprint(json.dumps(bad))")
        done = subprocess.run([sys.executable, "-c", code, *modules], env=env, capture_output=True, text=True,
                              timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])

    missing = list(probe(WHEELS))
    figures = {"python": platform.python_version(), "missing": missing, "installed": []}
    if missing:
        files = [f for m in missing for f in wheel_files(WHEELS[m])]
        absent = [WHEELS[m] for m in missing if not wheel_files(WHEELS[m])]
        if absent:
            log(f"  no wheel in {WHEEL_DIR} for {', '.join(absent)}: run `scripts/gpu_check --fetch-wheels` where "
                f"there is internet, and carry .gpu_wheels/")
        if files:
            site.mkdir(parents=True, exist_ok=True)
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                                  str(site), *map(str, files)], env=env, timeout=120, capture_output=True, text=True)
            if pip.returncode != 0:  # no pip in that Python: a pure-Python wheel is a zip of its import tree
                import zipfile

                log(f"  pip install failed ({pip.stderr.strip()[-300:]}); unpacking the wheels instead")
                for f in files:
                    zipfile.ZipFile(f).extractall(site)
            figures["installed"] = [f.name for f in files]
    figures["still_missing"] = probe(missing) if missing else {}
    return figures


def run_driver(out_dir: Path, mode: str, only: frozenset[str] | None = None) -> int:
    """Every phase in order (PHASES; `only`: those named, the setup always), each a subprocess under its
    budget; the table and JSON into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    total = TOTAL_SECONDS[mode]
    budget = {p.name: p.gpu_seconds if mode == "gpu" else p.dry_seconds for p in PHASES}
    logfile = open(out_dir / "gpu_check.log", "w", buffering=1)

    def log(line: str) -> None:
        stamp = f"[{time.monotonic() - start:6.1f}s] "
        print(stamp + line, flush=True)
        logfile.write(stamp + line + "\n")

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    site = work / "site"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(site),
                                                                     os.environ.get("PYTHONPATH")])))
    # explicit: plan_accuracy.py and train_step.py default JAX_PLATFORMS to cpu when they are imported;
    # the CPU backend stays available on the GPU (tests that ask for CPU devices)
    env["JAX_PLATFORMS"] = "cpu" if mode == "dry" else "cuda,cpu"
    report = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
              "python": platform.python_version(), "phases": {}}
    log(f"gpu_check {mode}: {out_dir}, budget {total} s, work folder {work}")

    t0 = time.perf_counter()
    try:
        figures, status, error = setup(site, env, log), "ok", ""
        if figures["still_missing"]:
            status, error = "fail", f"still missing after install: {figures['still_missing']}"
    except Exception as e:  # noqa: BLE001
        figures, status, error = {}, "fail", f"{type(e).__name__}: {e}"
    report["phases"]["setup"] = {"status": status, "seconds": time.perf_counter() - t0, "figures": figures,
                                 "error": error}
    log(f"setup: {status} {figures} {error}")

    def command(name: str, result: Path, seconds: float) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--result", str(result), "--work",
                str(work_path(work, name)), "--budget", f"{seconds:.0f}", *(["--dry-run"] if mode == "dry" else []),
                str(out_dir)]

    def phase_env(name: str) -> dict:
        kind, _, variant = name.partition(":")
        extra = dict(PHASE_ENV.get(kind, {}))
        if kind == "launches":
            flags = LAUNCH_VARIANTS[variant][0]
            if variant == "default":
                flags = f"--xla_gpu_dump_autotune_results_to={out_dir / AUTOTUNE_LOG}"
            extra["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), flags]))
        return dict(env, **extra)

    def launch(name: str, seconds: float):
        result = result_path(work, name)
        with open(result.with_suffix(".out"), "w") as output:  # a file, not a pipe: nothing blocks on a full one
            proc = subprocess.Popen(command(name, result, seconds), cwd=REPO, env=phase_env(name), stdout=output,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return proc, result, time.monotonic() + seconds, time.monotonic()

    def finish(name: str, proc, result: Path, deadline: float, started: float) -> None:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the phase and its children (the transformers peer, pytest)
            proc.wait()
            timed_out = True
        output = result.with_suffix(".out").read_text(errors="replace")
        logfile.write(f"----- {name} output -----\n{output}\n----- end of {name} -----\n")
        if result.is_file():  # written whole (`write_record`); a partial one says "timeout"
            record = json.loads(result.read_text())
            if record["status"] == "timeout" and not timed_out:  # it died after writing a partial record
                record.update(status="fail", error=f"exited {proc.returncode} after a partial record "
                                                   f"({record['error']}): {output.strip()[-600:]}")
        else:
            record = {"status": "timeout" if timed_out else "fail", "figures": {},
                      "error": "ran out of its time budget" if timed_out else
                      f"exited {proc.returncode} without a result: {output.strip()[-800:]}"}
        record.setdefault("seconds", time.monotonic() - started)
        report["phases"][name] = record
        log(f"{name}: {record['status']} in {record.get('seconds', float('nan')):.1f} s {record.get('error', '')[:300]}")

    models = list(MODELS[mode])
    background = {}  # name -> (the launched job, the phase after which it is collected)
    for p in PHASES[1:]:
        if (p.name not in only) if only else p.optional:
            continue
        if p.collect_after:
            seconds = min(budget[p.name], total - (time.monotonic() - start))
            background[p.name] = (launch(p.name, seconds), p.collect_after)
            log(f"{p.name}: started in the background ({PHASE_ENV.get(p.name)}, up to {seconds:.0f} s)")
            continue
        expand = {"step": [f"step:{m}" for m in models], "launches": [f"launches:{v}" for v in LAUNCH_VARIANTS]}
        for phase in expand.get(p.name, [p.name]):
            left = total - (time.monotonic() - start)
            if left < 10:
                report["phases"][phase] = {"status": "skipped", "figures": {}, "error": "no time left"}
                log(f"{phase}: skipped (no time left)")
                continue
            seconds = min(budget[p.name], left)
            log(f"{phase}: running (budget {seconds:.0f} s)")
            finish(phase, *launch(phase, seconds))
        for name, (job, after) in list(background.items()):
            if after == p.name:
                log(f"{name}: waiting for the background job")
                finish(name, *job)
                del background[name]
    for name, (job, _) in background.items():  # its phase to collect after did not run (not in --phases)
        log(f"{name}: waiting for the background job")
        finish(name, *job)
    compare_plan(report, models)
    report["total_seconds"] = time.monotonic() - start
    for name in ("kernels", "attention", *(f"step:{m}" for m in models), *(f"launches:{v}" for v in LAUNCH_VARIANTS),
                 "profile", "trainer", "exact", "agreement", "moe", "tools", "baseline"):  # the first on the device names it
        rec = report["phases"].get(name, {})
        if "device" in rec:
            report.update(device=rec["device"], jax=rec["jax"])
            break
    (out_dir / "gpu_check.json").write_text(json.dumps(strict_json(report), indent=1))
    (out_dir / "gpu_check.md").write_text(markdown(report))
    log(f"done in {report['total_seconds']:.0f} s: {out_dir / 'gpu_check.md'}")
    logfile.close()
    shutil.rmtree(work, ignore_errors=True)
    bad = [n for n, r in report["phases"].items() if r["status"] != "ok"]
    return 1 if bad else 0


def strict_json(x):
    """`x` with every non-finite float (an unmeasured ratio, a CPU's infinite interconnect) as None:
    standard JSON has no NaN or Infinity."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def compare_plan(report: dict, models: list[str]) -> None:
    """Put plan's predicted seconds beside the step phases' measured ones: measured / predicted."""
    plan = report["phases"].get("plan", {})
    rows = {}
    for model in models:
        measured = report["phases"].get(f"step:{model}", {}).get("figures", {}).get("measured")
        predicted = plan.get("figures", {}).get(model, {}).get("predicted")
        if not measured or not predicted:
            continue
        rows[model] = {name: {"measured_s": m, "predicted_s": predicted.get(name, float("nan")),
                              "measured_over_predicted": m / predicted[name] if predicted.get(name) else float("nan")}
                       for name, m in measured.items()}
        m, p = sum(measured.values()), sum(predicted.get(n, 0.0) for n in measured)
        rows[model]["step (3 programs)"] = {"measured_s": m, "predicted_s": p,
                                            "measured_over_predicted": m / p if p else float("nan")}
    if rows:
        plan.setdefault("figures", {})["comparison"] = rows


def _fmt(x) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else (f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}")
    return str(x)


def profile_lines(what: str, summary: dict, untraced_s: float, note: str = "") -> list[str]:
    """A markdown section of a program's `trace_summary`: busy time, launches and its top kernels."""
    lines = ["", f"## profile ({what} under jax.profiler: {summary['source']})", "",
             f"traced {_fmt(summary['traced_s'])} s (untraced {_fmt(untraced_s)} s); {summary['kernels']} kernels, busy "
             f"{_fmt(summary['busy_s'])} s of a {_fmt(summary['span_s'])} s span ({_fmt(100 * summary['busy_share'])}%); "
             f"{summary['launch_calls']} launch calls ({_fmt(summary['launch_api_s'])} s){note}", "",
             "| kernel | count | total ms | mean us |", "| --- | ---: | ---: | ---: |"]
    return lines + [f"| `{k['name'][:80]}` | {k['count']} | {_fmt(k['total_ms'])} | {_fmt(k['mean_us'])} |"
                    for k in summary["top"]]


def profiles(report: dict, kind: str) -> list[tuple[str, dict]]:
    """(model, figures) of each `kind` profile in the report: "profile" (a rollout's trace_summary) from the
    step phases' figures and the profile phase, "trainer" (the log-prob pass's and update's) from the step
    phases' trainer_profile and the trainer phase."""
    key = "trainer_profile" if kind == "trainer" else kind  # its name in a step phase's figures
    found = [(n[5:], r["figures"][key]) for n, r in report["phases"].items()
             if n.startswith("step:") and key in r.get("figures", {})]
    alone = report["phases"].get(kind, {}).get("figures", {})
    if alone.get("top") is not None or any(isinstance(v, dict) and "top" in v for v in alone.values()):
        found.append((alone["model"], alone))
    return found


def markdown(report: dict) -> str:
    """The report as markdown: a phase table, then a table per phase of its figures."""
    lines = [f"# gpu_check ({report['mode']})", "",
             f"{report.get('device', '?')}, jax {report.get('jax', '?')}, Python {report['python']}, {report['date']}, "
             f"{report.get('total_seconds', 0):.0f} s in total", "",
             "| phase | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, rec in report["phases"].items():
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', float('nan')):.1f} | "
                     f"{rec.get('error', '')[:200].replace('|', '/')} |")
    kernels = report["phases"].get("kernels", {}).get("figures", {})
    rows = [(k, v) for k, v in kernels.items() if isinstance(v, dict)]
    if rows:
        lines += ["", "## Kernels (bf16; rel = ||out - ref|| / ||ref|| against float64)", "",
                  "| kernel (heads q:kv) | pass | rel | tolerance | max abs | XLA rel | kernel ms | XLA ms | XLA / kernel |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for k, v in rows:
            if "error" in v:
                lines.append(f"| {k} | error | {v['error'][:150].replace('|', '/')} | | | | | | |")
                continue
            speed = v["xla_ms"] / v["kernel_ms"] if v.get("kernel_ms") else float("nan")
            lines.append(f"| {k} | {v['pass']} | {_fmt(v['rel'])} | {v['tolerance']:g} | {_fmt(v['max_abs'])} | "
                         f"{_fmt(v.get('xla_rel', float('nan')))} | {_fmt(v.get('kernel_ms', float('nan')))} | "
                         f"{_fmt(v.get('xla_ms', float('nan')))} | {_fmt(speed)} |")
    comparison = report["phases"].get("plan", {}).get("figures", {}).get("comparison", {})
    steps = {n[5:]: r["figures"] for n, r in report["phases"].items() if n.startswith("step:") and r.get("figures")}
    if steps:
        lines += ["", "## Train step and rollout (measured after compile) and plan's prediction", "",
                  "| model | program | measured s | predicted s | measured / predicted |", "| --- | --- | --- | --- | --- |"]
        for model, f in steps.items():
            for name, m in f.get("measured", {}).items():
                c = comparison.get(model, {}).get(name, {})
                lines.append(f"| {model} | {name} | {_fmt(m)} | {_fmt(c.get('predicted_s', float('nan')))} | "
                             f"{_fmt(c.get('measured_over_predicted', float('nan')))} |")
            c = comparison.get(model, {}).get("step (3 programs)", {})
            lines.append(f"| {model} | step (3 programs) | {_fmt(f.get('step_s', float('nan')))} | "
                         f"{_fmt(c.get('predicted_s', float('nan')))} | "
                         f"{_fmt(c.get('measured_over_predicted', float('nan')))} |")
    plans = {m: f for m, f in report["phases"].get("plan", {}).get("figures", {}).items() if m != "comparison"}
    if plans:
        lines += ["", "## plan", "", "| model | topology | fits | predicted step s | compile s | peak TFLOP/s | HBM GB/s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {m} | {f['topology']} | {f['fits']} | {_fmt(f['step_s'])} | {_fmt(f['compile_s'])} | "
                  f"{_fmt(f['chip']['peak_flops'] / 1e12)} | {_fmt(f['chip']['hbm_bandwidth'] / 1e9)} |"
                  for m, f in plans.items()]
    launches = {n.partition(":")[2]: r["figures"] for n, r in report["phases"].items()
                if n.startswith("launches:") and r.get("figures")}
    if launches:
        base = launches.get("default", {}).get("rollout_s", float("nan"))
        lines += ["", "## launches (the rollout under XLA flag variants)", "",
                  "| variant | rollout s | tokens/s | default / variant | XLA_FLAGS | overrides |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {v} | {_fmt(f['rollout_s'])} | {_fmt(f['tokens_per_s'])} | {_fmt(base / f['rollout_s'])} | "
                  f"{f['xla_flags'] or '-'} | {' '.join(f['overrides']) or '-'} |" for v, f in launches.items()]
    for model, profile in profiles(report, "profile"):
        lines += profile_lines(f"the {model} rollout", profile, profile["rollout_s"],
                               f"; longest row {profile['longest_row']} tokens")
    for model, trainer in profiles(report, "trainer"):
        for program in ("logprob pass", "update"):
            if trainer.get(program, {}).get("top") is not None:
                lines += profile_lines(f"the {model} {program}", trainer[program], trainer[program]["seconds"])
    attention = report["phases"].get("attention", {}).get("figures", {})
    if attention.get("rows"):
        lines += ["", f"## attention (the paged attention alone at {attention['snapshots']} snapshots of the rollout's "
                      f"{attention['slots']} slots, {attention['table_pages']}-page tables, one every "
                      f"{attention['stride']} decode steps)", "",
                  "| configuration | program ms | rollout attention s | default / this | rel to default |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['config']} | error: {r['error'][:150].replace('|', '/')} | | | |" if "error" in r else
                  f"| {r['config']} | {_fmt(r['program_ms'])} | {_fmt(r['rollout_attention_s'])} | "
                  f"{_fmt(r['default_over_this'])} | {_fmt(r['rel_to_default'])} |" for r in attention["rows"]]
        lines += ["", f"The later phases ran {attention['best']}."] if attention.get("best") else []
    baseline = report["phases"].get("baseline", {}).get("figures", {})
    if baseline.get("rollout_s"):
        lines += ["", "| rollout with | configuration | rollout s | tokens/s | default / this |", "| --- | --- | ---: | ---: | ---: |",
                  f"| the default | {baseline['config']} | {_fmt(baseline['rollout_s'])} | {_fmt(baseline['tokens_per_s'])} | 1 |",
                  f"| the choice (the step phase's) | {baseline['chosen']} | {_fmt(baseline['chosen_rollout_s'])} | "
                  f"{_fmt(baseline['chosen_tokens_per_s'])} | {_fmt(baseline['default_over_chosen'])} |"]
    elif baseline.get("note"):
        lines += ["", f"baseline: {baseline['note']}"]
    agreement = report["phases"].get("agreement", {}).get("figures", {})
    if agreement.get("exact"):
        m = agreement["model"]
        lines += ["", f"## agreement (model.numerics, a random Qwen3-shaped model: hidden {m['hidden']}, {m['layers']} "
                      f"layers, {m['heads']}:{m['kv_heads']} heads, vocabulary {m['vocab']}, bf16)", "",
                  "| numerics | rollout tokens/s | update tokens/s | tokens whose log-probs differ | ρ outside [0.9, 1.1] "
                  "| max \\|d\\| |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {k} | {_fmt(agreement[k]['rollout_tokens_per_s'])} | {_fmt(agreement[k]['update_tokens_per_s'])} | "
                  f"{agreement[k]['differing']} of {agreement[k]['tokens']} | {_fmt(100 * agreement[k]['out_10'])}% | "
                  f"{_fmt(agreement[k]['max_abs'])} |" for k in ("default", "exact")]
        lines += ["", f"exact / default time: rollout {_fmt(agreement['rollout_ratio'])}x, "
                      f"update {_fmt(agreement['update_ratio'])}x"]
    moe = report["phases"].get("moe", {}).get("figures", {})
    if moe.get("rows"):
        sh = moe["shapes"]
        lines += ["", f"## moe (the expert layer: hidden {sh['hidden']}, width {sh['width']}, {sh['experts']} experts, top "
                      f"{sh['k']}, {sh['dtype']} matmuls; useful FLOPs 2 N k 3 D I forward, 3x with backward"
                      + (f"; measured peak {_fmt(moe['peak_tflops'])} TFLOP/s" if "peak_tflops" in moe else "") + ")", "",
                  "| tokens | form | forward ms | fwd+bwd ms | XLA GFLOP fwd+bwd | XLA / useful | temp GiB fwd+bwd | "
                  "useful TFLOP/s fwd | useful TFLOP/s fwd+bwd | / dense_capacity fwd | / dense_capacity fwd+bwd |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['tokens']} | {r['form']} | error: {r['error'][:150].replace('|', '/')} | | | | | | | | |"
                  if "error" in r else
                  f"| {r['tokens']} | {r['form']} | {_fmt(1e3 * r['fwd_s'])} | {_fmt(1e3 * r['fwd_bwd_s'])} | "
                  f"{_fmt(r['fwd_bwd_flops'] / 1e9)} | {_fmt(r['xla_over_useful'])} | {_fmt(r['temp_gib_fwd_bwd'])} | "
                  f"{_fmt(r['useful_tflops_fwd'])} | "
                  f"{_fmt(r['useful_tflops_fwd_bwd'])} | {_fmt(r['fwd_over_dense'])} | {_fmt(r['fwd_bwd_over_dense'])} |"
                  for r in moe["rows"]]
        lines += [""] + [f"- {n} tokens: ragged_dot **{v['verdict']}**" if "multiple_fwd_bwd" not in v else
                         f"- {n} tokens: ragged_dot's time is {_fmt(v['multiple_fwd_bwd'])}x the useful FLOPs at "
                         f"dense_capacity's rate forward + backward ({_fmt(v['multiple_fwd'])}x forward; a dense "
                         f"expansion is {_fmt(sh['experts'] / sh['k'])}x), its temporaries "
                         f"{_fmt(v['temp_over_dense'])}x dense_capacity's: **{v['verdict']}**"
                         for n, v in moe["verdicts"].items()]
        lines += [f"- {moe['skipped']}"] if moe.get("skipped") else []
    tools = report["phases"].get("tools", {}).get("figures", {})
    if tools.get("runs"):
        w = tools["workload"]
        lines += ["", f"## tools (benchmarks/tool_rollout.py: {w['size']}, {w['dtype']}, vocabulary {tools['vocab']}, "
                      f"{w['prompts']} prompts x {w['samples']} samples on {w['slots']} slots, {tools['tokens']} tokens, "
                      f"best of {w['repeats']}; the trigger, the token the model samples most, "
                      f"{_fmt(100 * next(iter(tools['runs'].values()))['trigger_share'])}% of the plain arm's)", "",
                  "| tool ms a batch | arm | tokens/s | seconds | vs plain | decode steps | segments | calls/row | "
                  "tool tokens | tool s | hidden | parked share |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        shares = ("tool_token_share", "hidden_share", "parked_share")
        for ms, run in tools["runs"].items():
            for arm, a in run["arms"].items():
                cells = [ms, arm, _fmt(a["tokens_per_s"]), _fmt(a["seconds"]),
                         "" if arm == "plain" else f"{100 * a['vs_plain']:+.1f}%"]
                cells += [(f"{_fmt(100 * a[k])}%" if k in shares else _fmt(a[k])) if k in a else ""
                          for k in ("decode_steps", "segments", "calls_per_row", *shares[:1], "tool_s", *shares[1:])]
                if a.get("tool_s") == 0:  # no call: nothing to hide
                    cells[-2] = ""
                lines.append(f"| {' | '.join(map(str, cells))} |")
    for name in ("peaks", "decode", "tests", "demo"):
        f = report["phases"].get(name, {}).get("figures", {})
        if f:
            lines += ["", f"## {name}", "", "| figure | value |", "| --- | --- |"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in f.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", help="where gpu_check.md/.json/.log and pytest_gpu.log go")
    ap.add_argument("--dry-run", action="store_true", help="every phase on this CPU at toy sizes")
    ap.add_argument("--fetch-wheels", action="store_true", help="download the wheels the GPU host lacks")
    ap.add_argument("--phases", help="comma-separated phases to run (default: every phase but the optional "
                                     f"ones); known: {', '.join(p.name for p in PHASES[1:])}")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels()
    if not args.out_dir:
        ap.error("OUT_DIR is required (or --fetch-wheels)")
    mode = "dry" if args.dry_run else "gpu"
    if args.phase:
        return run_phase(args.phase, mode, Path(args.work), Path(args.result), Path(args.out_dir), args.budget)
    only = None
    if args.phases:
        only = frozenset(n.strip() for n in args.phases.split(",") if n.strip())
        unknown = sorted(only - {p.name for p in PHASES})
        if unknown:
            ap.error(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(p.name for p in PHASES[1:])}")
    return run_driver(Path(args.out_dir), mode, only)


if __name__ == "__main__":
    sys.exit(main())
