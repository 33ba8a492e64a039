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

The machinery is public for other worker pools (``jaxrl4llm.tools.python_executor``):
``WorkerProcess`` starts one worker (a command, an environment, an optional launcher such as
``unshare``), ``serve`` is a worker's call loop, and ``run_calls`` spreads calls over workers
under the deadline and reports how each ended (``CallOutcome``). A pool whose workers run
untrusted code (``trusted_replies=False``) decodes their replies as JSON, never with pickle, and
reads them without blocking, so that a worker cannot stall the caller with half a reply.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, NamedTuple, Sequence

_WORKER_MEMORY_BYTES = 3 * 1024**3
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The folder that holds the ``jaxrl4llm`` package: a worker's ``PYTHONPATH`` needs it."""


class SoftTimeout(BaseException):
    """Raised inside a worker by SIGALRM when its call runs out of time (a BaseException, so
    that ``except Exception`` in the called code does not swallow it)."""


def raise_soft_timeout(signum, frame):  # pragma: no cover - runs in the worker
    """Signal handler of a worker's time alarms: raises ``SoftTimeout``."""
    raise SoftTimeout()


def send_reply(conn: Connection, message: Any, trusted: bool) -> None:
    """Send a worker's reply: pickled for a pool that trusts its workers (``Connection.send``), else
    as ASCII JSON (any string encodes, lone surrogates too)."""
    if trusted:
        conn.send(message)
    else:
        conn.send_bytes(json.dumps(message).encode("ascii"))


def serve(conn: Connection, ready_info: Any = None, *, trusted_replies: bool = True) -> None:  # pragma: no cover
    """A worker's call loop: announce ``(None, "ready", ready_info)``, then receive
    ``(token, fn, args, soft_timeout)`` until ``None`` or a closed connection and reply
    ``(token, "ok", result)``, ``(token, "timeout", None)`` (the alarm fired) or
    ``(token, "error", "Type: message")``.

    A process that the called code forked returns here too: it exits at once instead of
    replying, so only the worker itself answers.
    """
    signal.signal(signal.SIGALRM, raise_soft_timeout)
    serving_pid = os.getpid()
    send_reply(conn, (None, "ready", ready_info), trusted_replies)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        token, fn, args, soft_timeout = msg
        try:
            signal.setitimer(signal.ITIMER_REAL, soft_timeout)
            reply = (token, "ok", fn(*args))
        except SoftTimeout:
            reply = (token, "timeout", None)
        except BaseException as exc:  # noqa: BLE001 - report every failure to the caller
            reply = (token, "error", f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if os.getpid() != serving_pid:
            os._exit(0)
        try:
            send_reply(conn, reply, trusted_replies)
        except (OSError, ValueError, TypeError):
            return


def _worker_main(conn, memory_bytes: int | None, warmup: Callable[[], Any] | None,
                 preload: Sequence[str] = ()) -> None:  # pragma: no cover
    """Set up a verifier worker (memory cap, warm-up, imports), then serve calls."""
    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
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
    serve(conn, os.getpid())


def _worker_entry() -> None:  # pragma: no cover - runs in the worker
    """Entry point of a worker subprocess: argv = [fd, memory_bytes, warmup 'module:function',
    preload paths (comma-separated)]."""
    fd, memory, warmup_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    warmup = None
    if warmup_name:
        module, _, attr = warmup_name.partition(":")
        warmup = getattr(importlib.import_module(module), attr)
    _worker_main(Connection(fd), memory or None, warmup, [p for p in sys.argv[4].split(",") if p])


class WorkerProcess:
    """One worker: ``[*launcher, python, -c, entry, <socket fd>, *args]``, talking over a socket pair.

    A plain subprocess (not ``multiprocessing.Process``) never re-imports the caller's
    ``__main__`` and never forks a process that may already run JAX threads. ``entry`` is the
    Python code the worker runs; it finds its end of the socket pair as ``sys.argv[1]`` and
    ends in ``serve``. ``env`` None inherits the caller's environment. ``trusted_replies``
    False: replies are JSON of at most ``max_reply_bytes`` bytes (a worker that runs untrusted
    code must not get to unpickle objects in the caller).

    The scheduler's view of it: ``ready`` (it announced itself), ``info`` (what it announced),
    ``task`` (the index of its running call or None), ``token``, ``started``, ``deadline`` and
    ``calls`` (calls given to it so far).
    """

    def __init__(self, entry: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                 launcher: Sequence[str] = (), trusted_replies: bool = True, max_reply_bytes: int = 2**31 - 1,
                 new_session: bool = False, cwd: str | None = None):
        parent_sock, child_sock = socket.socketpair()
        self.process = subprocess.Popen(
            [*launcher, sys.executable, "-c", entry, str(child_sock.fileno()), *args],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            close_fds=True,
            start_new_session=new_session,
            cwd=cwd,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.trusted_replies, self.max_reply_bytes = trusted_replies, max_reply_bytes
        self.ready = False
        self.info: Any = None
        self.task: int | None = None
        self.token = ""
        self.started = self.deadline = 0.0
        self.calls = 0
        self._received = b""

    def receive(self) -> list:
        """The complete replies that have arrived, decoded. A trusted worker's reply is read whole
        (``Connection.recv``); an untrusted one's bytes are read once, so that a worker that sends
        part of a reply cannot block the caller, and decoded as JSON when complete. Raises EOFError
        when the worker closed its end, ValueError on an oversized or undecodable reply."""
        if self.trusted_replies:
            return [self.conn.recv()]
        chunk = os.read(self.conn.fileno(), 1 << 16)
        if not chunk:
            raise EOFError("the worker closed its connection")
        self._received += chunk
        replies = []
        while len(self._received) >= 4:
            (size,) = struct.unpack("!i", self._received[:4])
            if size < 0 or size > self.max_reply_bytes:
                raise ValueError(f"a reply of {size} bytes (at most {self.max_reply_bytes})")
            if len(self._received) < 4 + size:
                break
            payload, self._received = self._received[4:4 + size], self._received[4 + size:]
            replies.append(json.loads(payload))
        return replies

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

    def stop(self, grace: float = 1.0) -> None:
        """Ask the worker to exit (``None``), wait up to ``grace`` seconds, then kill it."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class CallOutcome(NamedTuple):
    """How one call of ``run_calls`` ended: ``status`` "ok" (``value`` is what the function
    returned), "error" (``value`` is "Type: message" of what it raised), "timeout" (stopped by
    the worker's alarm, or killed at the deadline) or "died" (the worker exited mid-call, or sent
    a malformed reply); ``seconds`` from the call's start on a worker to its end."""

    status: str
    value: Any
    seconds: float


def run_calls(workers: list[WorkerProcess], calls: Sequence[tuple[Callable, tuple]], *, timeout: float,
              replace: Callable[[WorkerProcess], None],
              retire: Callable[[WorkerProcess, CallOutcome], bool] | None = None,
              start_failure_hint: str = "") -> list[CallOutcome]:
    """Run each ``(fn, args)`` of ``calls`` on ``workers`` in parallel; outcomes in input order.

    A call that does not finish within ``timeout`` seconds of its start on a worker ends as
    "timeout"; its worker is killed and ``replace(worker)`` (which must put a new worker in the
    dead one's place in ``workers``) is called, as it is for a worker that died. After a call
    that ended on a live worker, ``retire(worker, outcome)`` True replaces that worker too. A
    worker that exits before announcing itself raises RuntimeError (with ``start_failure_hint``).
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    outcomes: list[CallOutcome | None] = [None] * len(calls)
    pending = deque(range(len(calls)))
    soft = max(timeout * 0.85, timeout - 0.5)
    while pending or any(w.task is not None for w in workers):
        _start_calls(workers, calls, pending, soft, timeout, replace)
        _receive_replies(workers, outcomes, replace, retire, start_failure_hint)
        _stop_overdue_calls(workers, outcomes, replace)
    return outcomes


def wait_until_ready(workers: list[WorkerProcess], *, timeout: float, replace: Callable[[WorkerProcess], None],
                     start_failure_hint: str = "") -> None:
    """Block until every worker has announced itself (TimeoutError after ``timeout`` seconds); a
    worker that exits first raises RuntimeError, as in ``run_calls``."""
    deadline = time.monotonic() + timeout
    while not all(w.ready for w in workers):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"sandbox workers not ready after {timeout:g} s")
        _receive_replies(workers, [], replace, None, start_failure_hint, max_wait=left)


def _start_calls(workers, calls, pending, soft: float, timeout: float, replace) -> None:
    """Give each idle, ready worker the next pending call."""
    for w in list(workers):
        if not (w.ready and w.task is None and pending):
            continue
        i = pending.popleft()
        fn, args = calls[i]
        token = os.urandom(8).hex()  # a reply must name the call it answers
        try:
            w.conn.send((token, fn, tuple(args), soft))
        except (OSError, ValueError):
            pending.appendleft(i)
            replace(w)
            continue
        now = time.monotonic()
        w.task, w.token, w.started, w.deadline = i, token, now, now + timeout
        w.calls += 1


def _receive_replies(workers, outcomes, replace, retire, start_failure_hint: str, max_wait: float = 60.0) -> None:
    """Wait for replies (or start-up announcements) until the nearest deadline, and record them."""
    busy = [w for w in workers if w.task is not None]
    starting = [w for w in workers if not w.ready]
    if not busy and not starting:
        return
    now = time.monotonic()
    wait_for = min((w.deadline for w in busy), default=now + max_wait) - now
    by_conn = {w.conn: w for w in busy + starting}
    for conn in wait(list(by_conn), timeout=max(wait_for, 0.0)):
        w = by_conn[conn]
        try:
            replies = w.receive()
        except Exception:  # noqa: BLE001 - a closed connection, or a reply that does not decode
            _worker_failed(w, workers, outcomes, replace, start_failure_hint)
            continue
        for reply in replies:
            _record_reply(w, reply, outcomes, replace, retire)


def _worker_failed(w, workers, outcomes, replace, start_failure_hint: str) -> None:
    """A worker closed its connection or sent garbage: its call (if any) ends as "died"."""
    if not w.ready:
        code = w.process.poll()
        replace(w)
        raise RuntimeError(f"sandbox worker exited during start-up (exit code {code}); {start_failure_hint}")
    if w.task is not None:
        outcomes[w.task] = CallOutcome("died", "the worker process died", time.monotonic() - w.started)
        w.task = None
    replace(w)


def _record_reply(w, reply, outcomes, replace, retire) -> None:
    """One decoded reply of worker ``w``: its announcement, or the result of its running call."""
    try:
        token, status, value = reply
    except (TypeError, ValueError):
        return
    if status == "ready" and not w.ready:
        w.ready, w.info = True, value
        return
    if w.task is None or token != w.token or status not in ("ok", "error", "timeout"):
        return  # a stray message: not the answer to the call the worker was given
    outcome = CallOutcome(status, value, time.monotonic() - w.started)
    outcomes[w.task] = outcome
    w.task = None
    if retire is not None and retire(w, outcome):
        replace(w)


def _stop_overdue_calls(workers, outcomes, replace) -> None:
    """Kill and replace every worker whose call is past its deadline."""
    now = time.monotonic()
    for w in list(workers):
        if w.task is not None and now >= w.deadline:
            outcomes[w.task] = CallOutcome("timeout", None, now - w.started)
            w.task = None
            replace(w)


def _verifier_worker(memory_bytes, warmup, pythonpath: Sequence[str] = (), preload: Sequence[str] = ()) -> WorkerProcess:
    """A ``SandboxPool`` worker: the caller's environment plus this package on ``PYTHONPATH``."""
    warmup_name = f"{warmup.__module__}:{warmup.__qualname__}" if warmup is not None else ""
    env = dict(os.environ)
    paths = [PACKAGE_ROOT, *pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    code = "from jaxrl4llm.rewards.sandbox import _worker_entry; _worker_entry()"
    return WorkerProcess(code, [str(memory_bytes or 0), warmup_name, ",".join(preload)], env=env)


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

    def _spawn(self) -> WorkerProcess:
        return _verifier_worker(self._memory, self._warmup, self._pythonpath, self._preload)

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
        with self._lock:
            outcomes = run_calls(
                self._workers, [(fn, tuple(args)) for args in calls], timeout=timeout, replace=self._replace,
                start_failure_hint="run `python -c 'import jaxrl4llm.rewards.symbolic'` to see the import error")
        results, why = [], []
        for outcome in outcomes:
            results.append(outcome.value if outcome.status == "ok" else default)
            why.append(None if outcome.status == "ok" else outcome.value if outcome.status == "error"
                       else "the worker process died (a crash in C code, or out of memory)"
                       if outcome.status == "died" else f"timed out after {timeout:g} s")
        if errors is not None:
            errors.extend(why)
        return results

    def _replace(self, worker: WorkerProcess) -> None:
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
            w.stop()

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
