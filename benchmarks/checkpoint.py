"""Checkpoint time per save: blocking (save, then wait for the write) against asynchronous
(`RunCheckpointer.save` returns after the copy to host memory; the write goes on while the
next steps run), in the same run, on train_step.py's random 48M Qwen3 with its Adam state.

    .venv/bin/python benchmarks/checkpoint.py [--size 48m] [--steps 12] [--every 3] [--rows 8] [--seq 128]

Each mode runs --steps update steps (the same jitted update, donated state) and saves every
--every steps into its own folder. Per mode: the seconds the loop stood still per checkpoint
(blocking: save + wait; async: save's own return time, plus the final wait at the run's end
spread over the saves) and the wall time of the whole loop, so a write that slows the steps
it overlaps (on a small CPU it competes with them for cores) shows in the total.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from jaxrl4llm.train.checkpointing import RunCheckpointer  # noqa: E402
from train_step import SIZES, setup as train_step_setup  # noqa: E402


def setup(size: str, rows: int, seq: int):
    """(update, initial state, batch) of the --size model: train_step.py's update at [rows, seq]."""
    _, update, state, batch = train_step_setup(size, rows, seq)
    return update, state, batch


def run_loop(update, state, batch, folder: Path, *, steps: int, every: int, blocking: bool) -> dict:
    ckpt = RunCheckpointer(folder, keep=2)
    stalls, t0 = [], time.perf_counter()
    for step in range(steps):
        state, metrics, _ = update(state, batch)
        jax.block_until_ready(metrics)
        if (step + 1) % every == 0:
            t = time.perf_counter()
            ckpt.save(step + 1, state, {"step": step + 1})
            if blocking:
                ckpt.wait()
            stalls.append(time.perf_counter() - t)
    t = time.perf_counter()
    ckpt.close()  # the run's end waits for the last write
    end_wait = time.perf_counter() - t
    return {"state": state, "stall": statistics.median(stalls), "end_wait": end_wait, "saves": len(stalls),
            "total": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="48m", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    update, state, batch = setup(args.size, args.rows, args.seq)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    state, metrics, _ = update(state, batch)  # compile
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    state, metrics, _ = update(state, batch)
    jax.block_until_ready(metrics)
    step_s = time.perf_counter() - t
    print(f"{args.size}: {n_params / 1e6:.1f}M parameters, train state {n_bytes / 2**20:.0f} MiB; one update "
          f"step {step_s:.2f} s; {args.steps} steps, a checkpoint every {args.every}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(("blocking", "async", "blocking", "async")):  # alternating; the second pair is reported
            out = run_loop(update, state, batch, Path(tmp) / f"{mode}{i}", steps=args.steps,
                           every=args.every, blocking=mode == "blocking")
            state = out.pop("state")
            results[mode] = out
    b, a = results["blocking"], results["async"]
    a_stall = a["stall"] + a["end_wait"] / a["saves"]
    print(f"  blocking: loop stopped {b['stall']:.2f} s per checkpoint (save + wait); loop total {b['total']:.1f} s")
    print(f"  async:    loop stopped {a['stall']:.2f} s per checkpoint (save returns), end wait {a['end_wait']:.2f} s "
          f"({a_stall:.2f} s per checkpoint with it); loop total {a['total']:.1f} s")
    print(f"  async / blocking: stop per checkpoint {a_stall / b['stall']:.2f}, loop total {a['total'] / b['total']:.2f}")


if __name__ == "__main__":
    main()
