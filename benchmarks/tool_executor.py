"""Benchmark of the Python tool executor (jaxrl4llm.tools.PythonExecutor).

Prints:
  - the isolation the workers got on this host, and the pool's start time (workers ready, sympy
    and numpy imported);
  - calls/s of a trivial snippet and of a sympy snippet, in batches over the pool's workers;
  - the cost of a fresh worker: from a worker's death to its replacement being ready;
  - the peer figure: a fresh ``python -c`` per call (a new interpreter importing sympy, as
    sandboxes that start one process per call do), and the ratio.

Usage: python benchmarks/tool_executor.py [--workers N] [--batch 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrl4llm.tools import ExecutorConfig, PythonExecutor  # noqa: E402

TRIVIAL = "print(1 + 1)"
SYMPY = "import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 1), sympy.integrate(x**2, x))"


def calls_per_second(executor: PythonExecutor, code: str, batch: int, rounds: int) -> float:
    """Best of ``rounds`` batches of ``batch`` calls."""
    best = float("inf")
    for _ in range(rounds):
        executor.wait_until_ready()
        start = time.perf_counter()
        results = executor.run([code] * batch)
        best = min(best, time.perf_counter() - start)
        assert all(r.status == "ok" for r in results), results[:2]
    return batch / best


def fresh_worker_seconds(executor: PythonExecutor, times: int) -> float:
    """Median seconds from a worker's death (os._exit) to its replacement being ready."""
    seconds = []
    for _ in range(times):
        executor.wait_until_ready()
        assert executor.run(["import os\nos._exit(0)"])[0].status == "crash"
        start = time.perf_counter()
        executor.wait_until_ready()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fresh_interpreter_seconds(code: str, times: int) -> float:
    """Median seconds of one ``python -c code`` (the peer: one process per call)."""
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="default: min(4, cores)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    config = ExecutorConfig() if args.workers is None else ExecutorConfig(workers=args.workers)
    start = time.perf_counter()
    with PythonExecutor(config) as executor:
        print(f"workers: {config.workers}; pool start (workers ready, sympy+numpy imported): "
              f"{time.perf_counter() - start:.2f} s")
        print("isolation: " + ", ".join(f"{k}={v}" for k, v in executor.isolation.items()))
        trivial = calls_per_second(executor, TRIVIAL, args.batch, args.rounds)
        sympy_rate = calls_per_second(executor, SYMPY, args.batch, args.rounds)
        fresh = fresh_worker_seconds(executor, 3)
    peer = fresh_interpreter_seconds(SYMPY, 3)
    print(f"trivial snippet: {trivial:.0f} calls/s ({1e3 * config.workers / trivial:.2f} ms per call per worker)")
    print(f"sympy snippet:   {sympy_rate:.0f} calls/s ({1e3 * config.workers / sympy_rate:.2f} ms per call per worker)")
    print(f"fresh worker (death to ready): {fresh:.2f} s")
    print(f"peer, a fresh `python -c` per sympy call: {peer:.2f} s per call = {config.workers / peer:.1f} calls/s "
          f"on {config.workers} processes; ratio ours/peer: {sympy_rate * peer / config.workers:.0f}x")


if __name__ == "__main__":
    main()
