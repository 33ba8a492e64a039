"""A pool of reusable worker processes that run a function under a hard wall-clock limit.

Symbolic math on untrusted answers can take unbounded time or memory (``10^{10^{10^{10}}}``,
a simplification that never ends). ``SandboxPool`` runs such calls in separate processes:

- each worker is a fresh ``python`` subprocess started once and reused for many calls (no
  fork of a process that may run JAX threads, no re-import of the caller's ``__main__``);
- every call gets a deadline measured in the caller's process; a worker that misses it is
  killed (SIGKILL) and replaced, and the call returns the caller's ``default``;
- inside the worker a SIGALRM set slightly before the deadline lets well-behaved Python code
  stop on its own, so most timeouts do not even cost a restart;
- each worker caps its address space (``RLIMIT_AS``), so a runaway big-integer computation
  raises MemoryError instead of exhausting the machine;
- the deadline is enforced from whatever thread calls ``run``; it does not rely on signals in
  the caller, so it works outside the main thread.

The function and its arguments must be picklable (module-level functions).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

_WORKER_MEMORY_BYTES = 3 * 1024**3


class _SoftTimeout(BaseException):
    """Raised inside a worker by SIGALRM when its call runs out of time."""


def _on_alarm(signum, frame):  # pragma: no cover - runs in the worker
    raise _SoftTimeout()


def _worker_main(conn, memory_bytes: int | None, warmup: Callable[[], Any] | None,
                 preload: Sequence[str] = ()) -> None:  # pragma: no cover
    """Worker loop: receive (fn, args, soft_timeout), send ("ok", result) or ("error", text)."""
    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if warmup is not None:
        try:
            warmup()
        except Exception:  # noqa: BLE001 - a failed warm-up only costs speed
            pass
    for path in preload:  # the caller's functions, imported before the first timed call
        try:
            _import_by_path(path)
        except Exception:  # noqa: BLE001 - the call reports the import error itself
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args, soft_timeout = msg
        try:
            signal.setitimer(signal.ITIMER_REAL, soft_timeout)
            reply = ("ok", fn(*args))
        except _SoftTimeout:
            reply = ("timeout", None)
        except BaseException as exc:  # noqa: BLE001 - report every failure to the caller
            reply = ("error", f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_entry() -> None:  # pragma: no cover - runs in the worker
    """Entry point of a worker subprocess: argv = [fd, memory_bytes, warmup 'module:function',
    preload paths (comma-separated)]."""
    fd, memory, warmup_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    warmup = None
    if warmup_name:
        module, _, attr = warmup_name.partition(":")
        warmup = getattr(importlib.import_module(module), attr)
    _worker_main(Connection(fd), memory or None, warmup, [p for p in sys.argv[4].split(",") if p])


class _Worker:
    """One worker: a fresh ``python`` subprocess talking over a socket pair.

    A plain subprocess (not ``multiprocessing.Process``) never re-imports the caller's
    ``__main__`` and never forks a process that may already run JAX threads.
    """

    def __init__(self, memory_bytes, warmup, pythonpath: Sequence[str] = (), preload: Sequence[str] = ()):
        parent_sock, child_sock = socket.socketpair()
        warmup_name = f"{warmup.__module__}:{warmup.__qualname__}" if warmup is not None else ""
        env = dict(os.environ)
        paths = [_PACKAGE_ROOT, *pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        code = "from jaxrl4llm.rewards.sandbox import _worker_entry; _worker_entry()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(child_sock.fileno()), str(memory_bytes or 0), warmup_name, ",".join(preload)],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        try:
            self.process.kill()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.process.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        self.conn.close()


class SandboxPool:
    """``num_workers`` reusable processes running calls under a hard per-call time limit.

    Args:
      num_workers: processes to keep (default: number of CPU cores).
      memory_bytes: address-space cap per worker (None: no cap).
      warmup: picklable no-argument function each worker calls once at start (e.g. to load
        parsers), not counted against any call's time limit.
      pythonpath: folders the workers import from before their own ``sys.path`` (e.g. the
        caller's ``sys.path``, so that they find the modules it imported).
      preload: functions ('package.module:function') each worker imports at start for
        ``call_by_path``, so that no call's time limit pays for the import.
    """

    def __init__(self, num_workers: int | None = None, *, memory_bytes: int | None = _WORKER_MEMORY_BYTES,
                 warmup: Callable[[], Any] | None = None, pythonpath: Sequence[str] = (), preload: Sequence[str] = ()):
        self.num_workers = max(1, num_workers or os.cpu_count() or 1)
        self._memory = memory_bytes
        self._warmup = warmup
        self._pythonpath, self._preload = tuple(pythonpath), tuple(preload)
        self._workers = [self._spawn() for _ in range(self.num_workers)]
        self._lock = threading.Lock()
        self.restarts = 0
        self._closed = False

    def _spawn(self) -> _Worker:
        return _Worker(self._memory, self._warmup, self._pythonpath, self._preload)

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple], *, timeout: float, default: Any = None,
            errors: list | None = None) -> list:
        """Run ``fn(*args)`` for every tuple in ``calls`` in parallel; results in input order.

        A call that raises, or does not finish within ``timeout`` seconds of starting on a
        worker, yields ``default``. Worker start-up time is not charged to any call. With an
        ``errors`` list, it receives one entry per call: None, or why the call yielded
        ``default`` ("ValueError: ...", "timed out after 5 s", "the worker process died").
        """
        if self._closed:
            raise RuntimeError("SandboxPool is closed; create a new one")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        results = [default] * len(calls)
        why = [f"timed out after {timeout:g} s"] * len(calls)  # what a call that never reports hit
        pending = deque(range(len(calls)))
        soft = max(timeout * 0.85, timeout - 0.5)
        with self._lock:
            while pending or any(w.task is not None for w in self._workers):
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.task is None and pending:
                        i = pending.popleft()
                        try:
                            w.conn.send((fn, tuple(calls[i]), soft))
                        except (OSError, ValueError):
                            pending.appendleft(i)
                            self._replace(w)
                            continue
                        w.task, w.deadline = i, now + timeout
                busy = [w for w in self._workers if w.task is not None]
                starting = [w for w in self._workers if not w.ready]
                if not busy and not starting:
                    continue
                wait_for = min((w.deadline for w in busy), default=now + 60.0) - now
                ready = wait([w.conn for w in busy + starting], timeout=max(wait_for, 0.0))
                by_conn = {w.conn: w for w in self._workers}
                for conn in ready:
                    w = by_conn.get(conn)
                    if w is None:
                        continue
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        if not w.ready:
                            code = w.process.poll()
                            self._replace(w)
                            raise RuntimeError(
                                f"sandbox worker exited during start-up (exit code {code}); run "
                                "`python -c 'import jaxrl4llm.rewards.symbolic'` to see the import error"
                            )
                        if w.task is not None:
                            why[w.task] = "the worker process died (a crash in C code, or out of memory)"
                        w.task = None  # the worker died mid-call (e.g. a crash in C code)
                        self._replace(w)
                        continue
                    if status == "ready":
                        w.ready = True
                        continue
                    if status == "ok" and w.task is not None:
                        results[w.task], why[w.task] = value, None
                    elif status == "error" and w.task is not None:
                        why[w.task] = value
                    w.task = None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.task is not None and now >= w.deadline:
                        w.task = None
                        self._replace(w)
        if errors is not None:
            errors.extend(why)
        return results

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.restarts += 1
        self._workers[self._workers.index(worker)] = self._spawn()

    def close(self) -> None:
        """Stop all workers."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            try:
                w.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            w.kill()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_IMPORTED: dict[str, Any] = {}


def call_by_path(path: str, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` for the function named by ``path`` ('package.module:function' or
    'package.module.function'), imported once per process: lets a worker run the user's code
    named by a config key without pickling the function itself."""
    return _import_by_path(path)(*args, **kwargs)


def _import_by_path(path: str) -> Any:
    fn = _IMPORTED.get(path)
    if fn is None:
        module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        fn = _IMPORTED[path] = getattr(importlib.import_module(module), attr)
    return fn


_POOLS: dict[int, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(num_workers: int | None = None, *, warmup: Callable[[], Any] | None = None) -> SandboxPool:
    """The process-wide pool with ``num_workers`` workers (created on first use, closed at exit)."""
    n = max(1, num_workers or os.cpu_count() or 1)
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None or pool._closed:
            pool = _POOLS[n] = SandboxPool(n, warmup=warmup)
        return pool


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
