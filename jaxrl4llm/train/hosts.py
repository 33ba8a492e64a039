"""The processes of a run: one per host, each driving its own chips, all running the same loop.

A TPU pod slice (or a group of GPU hosts) is several JAX processes joined by
`jax.distributed`; the mesh spans every chip and a global array has shards on every host.
The loop runs the same code on every process, in the same order (each jitted program is
one SPMD program over all chips), and meets the host in four places, all here:

- reading a global array on the host: `fetch` gathers its whole value onto every process
  (small arrays: lengths, flags, metrics inputs); `local_rows` reads only the rows this
  process's chips hold (the responses it scores);
- host results per row (rewards) become the same full vector on every process
  (`gather_rows`), so dynamic sampling, the data cursor and the metrics agree everywhere;
- files: only process 0 writes (`is_main`), after a `barrier` where others must wait;
- start-up: `initialize` joins the processes (TPU VMs: detected; elsewhere from
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).

With one process every function is the plain single-host operation.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(env=os.environ) -> None:
    """jax.distributed.initialize from the environment (call before any device use).

    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID
    name the processes explicitly (GPU hosts, CPU tests); without them JAX detects the
    cluster (TPU VM slices, SLURM, Open MPI). JAXRL4LLM_HEARTBEAT_SECONDS (default 30): a
    process that stops answering for that long makes the others fail instead of hanging.
    On CPU the cross-process collectives run over gloo.
    """
    kwargs = {"heartbeat_timeout_seconds": int(env.get("JAXRL4LLM_HEARTBEAT_SECONDS", "30"))}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(k)]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} not: set the number of "
                             f"processes and this process's id (0 .. N-1) too")
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
        kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    if env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


def is_main() -> bool:
    """This process writes the run's files (config, metrics, TensorBoard, exports)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every process (the same answer everywhere; no-op with one)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32))).all())


def smallest(value: float) -> float:
    """The smallest of `value` over the processes (the same answer everywhere; no-op with one):
    a choice every process must make alike, e.g. sizes from each host's free memory."""
    if jax.process_count() == 1:
        return value
    return float(np.asarray(multihost_utils.process_allgather(np.asarray([value], np.float64))).min())


def fetch(x) -> np.ndarray:
    """The whole value of a (global) array on this host: [N, ...] -> np.ndarray [N, ...].

    Gathers the shards of other processes when this one does not hold them all."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """The rows of x [N, ...] that this process's devices hold: (row indices [n] ascending,
    values [n, ...]). Rows replicated on several local devices are read once."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        values = np.asarray(x)
        return np.arange(values.shape[0]), values
    pieces = {}
    for shard in x.addressable_shards:
        start, stop, _ = shard.index[0].indices(x.shape[0]) if shard.index else (0, x.shape[0], 1)
        if start not in pieces:
            pieces[start] = np.asarray(shard.data)
    starts = sorted(pieces)
    rows = np.concatenate([np.arange(s, s + len(pieces[s])) for s in starts])
    return rows, np.concatenate([pieces[s] for s in starts])


def gather_rows(rows: np.ndarray, values: np.ndarray, num_rows: int) -> np.ndarray:
    """Per-row host values computed on each process for its `rows` -> the full [num_rows]
    vector on every process (a row computed on several processes takes any one of them)."""
    full = np.zeros((num_rows,), np.float32)
    seen = np.zeros((num_rows,), bool)
    full[rows], seen[rows] = values, True
    if jax.process_count() > 1:
        all_full, all_seen = (np.asarray(a) for a in multihost_utils.process_allgather((full, seen)))
        full = np.where(all_seen, all_full, 0.0).max(axis=0, initial=-np.inf, where=all_seen)
        seen = all_seen.any(axis=0)
    if not seen.all():
        raise RuntimeError(f"rows {np.flatnonzero(~seen)[:8].tolist()} were scored by no process")
    return full
