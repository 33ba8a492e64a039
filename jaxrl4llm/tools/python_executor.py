"""The Python tool of tool-integrated reasoning: runs the code blocks a policy writes mid-rollout,
in a pool of confined worker processes, and returns what a model sees as the tool's output.

    with PythonExecutor(ExecutorConfig(timeout=5)) as executor:
        executor.run(["print(2 ** 10)", "1 / 0"])
    # [ToolResult("ok", "1024\\n", 0.002), ToolResult("error", "ZeroDivisionError: division by zero", 0.001)]

A call's output is its stdout, or on an exception the last line of the traceback (Qwen's and
ToRL's tool format), cut in the middle to ``max_output_chars``. Its status is "ok", "error"
(the code raised), "timeout", "oom" (MemoryError) or "crash" (the worker process died: os._exit,
a segfault, a malformed reply).

Workers are fresh ``python`` processes (``rewards.sandbox.WorkerProcess``), started with sympy and
numpy imported and reused for ``calls_per_worker`` calls. Each call runs in fresh globals. A worker
is replaced after a timeout, a crash, an out-of-memory, a call that left threads or forked, and
after ``calls_per_worker`` calls. ``executor.isolation`` says which of the measures below this host
gave the workers.

Code a model writes is hostile by assumption. What each measure does, and what it does not stop:

- **Its own process, a deadline and a kill.** The caller measures each call's time; SIGALRM
  stops plain Python code shortly before the deadline, and at the deadline the worker is killed
  (SIGKILL) and replaced. Stops: endless loops, sleeps, code stuck in one C call. Does not stop:
  the CPU and memory a call uses until its deadline.
- **Resource limits (setrlimit).** ``RLIMIT_AS`` (``memory_bytes``): an allocation past it raises
  MemoryError ("oom") instead of exhausting the machine; it does not bound the memory of files the
  code writes into its tmpfs (``RLIMIT_FSIZE`` and the tmpfs size do). ``RLIMIT_CPU``: a call gets
  ``cpu_seconds`` of CPU (SIGXCPU, then "timeout") and the worker a total of ``cpu_seconds`` per
  call it may serve, plus 30 s (then SIGKILL): this also ends a worker whose caller died while it
  spun.
  ``RLIMIT_NPROC`` (``max_processes``): a fork bomb fails with BlockingIOError. It counts the
  processes and threads of the worker's user, so it is enforced only where the worker is not root:
  as root it switches to ``nobody`` (``separate_user``; then the workers of all executors share the
  count); a non-root caller's own processes count too, unless a user namespace separates them.
  ``RLIMIT_FSIZE`` (``max_file_bytes``): a larger write, or more output than that, fails with an
  error. ``RLIMIT_NOFILE``: at most ``max_open_files`` open files. No core dumps.
- **A sandbox folder per call.** Each call runs in a new folder (its cwd, HOME and TMPDIR), removed
  after it. With a mount namespace the worker's sandbox folder is a fresh tmpfs (4 x
  ``max_file_bytes``, at least 16 MiB; 4096 files) and the rest of the file system is read-only
  (``read_only_filesystem``), so writes anywhere else fail; folders in ``hidden_paths`` (a dataset
  with the answers, checkpoints) are covered by an empty folder. Without a mount namespace writes
  are confined only by file permissions (``nobody`` when the caller is root). Reads are not
  confined beyond ``hidden_paths``: the code may read every file its user may read (as ``nobody``:
  world-readable files).
- **A scrubbed environment.** The worker gets none of the caller's environment variables (tokens,
  keys): a fixed PATH, LANG, HOME and TMPDIR in its folder, PYTHONPATH to this package, a fixed
  hash seed, one BLAS thread.
- **A network namespace** (``network_namespace``): the worker sees only a loopback device that is
  down, so no connection leaves it (not even to the trainer's localhost ports). Where the host gives
  no namespace, the ``socket`` module refuses to create sockets (``socket_refusal``), which code
  that calls the system itself (ctypes) gets around.
- **A PID namespace** (``pid_namespace``): the worker is process 1 of its namespace and sees no
  other process, so it cannot signal the trainer; after each call it kills every process the call
  left behind, and when it dies they die with it. Without one, signals are stopped only by the
  user switch (``nobody`` may not signal root's processes); a non-root worker without namespaces
  can signal the trainer, and processes a call forked may outlive the worker.
- **Another user.** As root, the worker switches to ``nobody`` (no capabilities, no access to
  root's files); folders of the interpreter that ``nobody`` may not enter (a pyenv under /root) are
  re-mounted for it. In a user namespace (a non-root caller), the worker enters a child namespace
  so that it cannot remount its file system writable. ``no_new_privileges``: no set-user-ID
  program raises its rights.
- **Signals.** The worker leads a process group of its own (setsid) and ignores SIGINT and SIGTERM, so a Ctrl-C or a
  SIGTERM to the trainer's process group does not reach it.
- **Reproducibility.** ``random`` and, once imported, ``numpy.random`` are seeded from ``seed``
  before each call, and PYTHONHASHSEED is fixed: the same code gives the same output on any worker.
- **Replies are data.** The trainer decodes a worker's reply as JSON of bounded size, never with
  pickle, reads it without blocking, and ignores a reply that does not name the running call.

Not stopped: a call runs in the worker's interpreter, so it can change that interpreter's state
(patch a module, including this one) and so the outputs of later calls on the same worker until
the worker is replaced (``calls_per_worker``); with the namespaces it cannot reach other workers
or the trainer. Nor a
kernel exploit: for models that are hostile in earnest, run the workers in a VM or under gVisor.
Linux only.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import warnings
import weakref
from multiprocessing.connection import Connection
from typing import NamedTuple, Sequence

from jaxrl4llm.rewards.sandbox import PACKAGE_ROOT
from jaxrl4llm.rewards.sandbox import CallOutcome
from jaxrl4llm.rewards.sandbox import SoftTimeout
from jaxrl4llm.rewards.sandbox import WorkerProcess
from jaxrl4llm.rewards.sandbox import raise_soft_timeout
from jaxrl4llm.rewards.sandbox import run_calls
from jaxrl4llm.rewards.sandbox import serve
from jaxrl4llm.rewards.sandbox import wait_until_ready
from jaxrl4llm.tools.confinement import Confinement
from jaxrl4llm.tools.confinement import confine
from jaxrl4llm.tools.confinement import limit_cpu_of_next_call
from jaxrl4llm.tools.confinement import namespace_launcher
from jaxrl4llm.tools.confinement import worker_environment

STATUSES = ("ok", "error", "timeout", "oom", "crash")


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """How the Python executor runs code.

    timeout: wall-clock seconds per call. memory_bytes: address space per worker (RLIMIT_AS).
    cpu_seconds: CPU seconds per call (RLIMIT_CPU). max_processes: processes and threads of the
    worker's user (RLIMIT_NPROC). max_file_bytes: largest file a call writes, its output included
    (RLIMIT_FSIZE). max_open_files: RLIMIT_NOFILE. max_output_chars: longer output is cut in the
    middle around a marker of how many characters were dropped. calls_per_worker: a worker is
    replaced after this many calls. workers: processes in the pool. preload: modules imported when a
    worker starts. seed: of ``random`` and ``numpy.random`` before each call, and the hash seed.
    hidden_paths: folders (or files) the code must not read, covered where the host gives a mount
    namespace. namespaces: False runs without any namespace (the fallbacks only).
    """

    timeout: float = 5.0
    memory_bytes: int = 1 << 30
    cpu_seconds: float = 5.0
    max_processes: int = 32
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    max_output_chars: int = 2048
    calls_per_worker: int = 100
    workers: int = dataclasses.field(default_factory=lambda: min(4, os.cpu_count() or 1))
    preload: tuple[str, ...] = ("sympy", "numpy")
    seed: int = 0
    hidden_paths: tuple[str, ...] = ()
    namespaces: bool = True

    def __post_init__(self):
        for name in ("timeout", "memory_bytes", "cpu_seconds", "max_processes", "max_file_bytes", "max_open_files",
                     "max_output_chars", "calls_per_worker", "workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ExecutorConfig.{name} must be positive, got {getattr(self, name)!r}")


class ToolResult(NamedTuple):
    """One call's result: ``status`` (one of STATUSES), ``output`` (stdout, or the last line of the
    traceback; already cut to ``max_output_chars``) and ``seconds`` (the call's wall time)."""

    status: str
    output: str
    seconds: float


def truncate_middle(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its start and end around a marker
    ``...[N chars dropped]...``, all within ``max_chars`` characters."""
    if len(text) <= max_chars:
        return text
    dropped = len(text) - max_chars
    while True:
        marker = f"\n...[{dropped} chars dropped]...\n"
        keep = max(max_chars - len(marker), 0)
        if len(text) - keep == dropped or keep == 0:
            break
        dropped = len(text) - keep
    if keep == 0:
        return marker.strip()[:max_chars]
    head = keep - keep // 2
    return text[:head] + marker + text[len(text) - keep // 2:]


# ---- inside a worker ------------------------------------------------------------------------

class _WorkerState(NamedTuple):
    pid: int
    home: str
    env: dict
    seed: int
    cpu_seconds: float
    max_output_chars: int
    forked: list  # [True] once a call has forked


_state: _WorkerState | None = None
_streams: list = []  # the text streams of the running call's captured stdout and stderr


def worker_entry() -> None:  # pragma: no cover - runs in the worker
    """A worker's main: argv = [socket fd, settings as JSON]; confine, then serve calls."""
    global _state
    conn = Connection(int(sys.argv[1]))
    settings = json.loads(sys.argv[2])
    confinement = Confinement(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings["confinement"].items()})
    isolation = confine(confinement, raise_soft_timeout)
    forked: list = []
    os.register_at_fork(after_in_parent=lambda: forked.append(True))
    _state = _WorkerState(os.getpid(), confinement.home, dict(os.environ), settings["seed"], settings["cpu_seconds"],
                          settings["max_output_chars"], forked)
    serve(conn, {"isolation": isolation}, trusted_replies=False)


def run_snippet(code: str) -> list:  # pragma: no cover - runs in the worker
    """Run ``code`` in fresh globals in a fresh folder: [status, output, dirty]; ``dirty`` says the
    call left this worker in a state not to reuse (threads, forks, an undeletable folder)."""
    state = _state
    call_dir = tempfile.mkdtemp(dir=state.home)
    _enter_call(state, call_dir)
    stdout_fd, stderr_fd = _capture_output()
    status, error_line = _execute(code)
    stdout = _release_output(stdout_fd, stderr_fd)
    if os.getpid() != state.pid:
        os._exit(0)  # a process the code forked: only the worker replies
    dirty = _leave_call(state, call_dir)
    output = stdout if status == "ok" else error_line
    return [status, truncate_middle(output, state.max_output_chars), dirty]


def _enter_call(state: _WorkerState, call_dir: str) -> None:
    os.chdir(call_dir)
    os.environ.clear()
    os.environ.update(state.env, HOME=call_dir, TMPDIR=call_dir)
    tempfile.tempdir = None
    random.seed(state.seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(state.seed)
    limit_cpu_of_next_call(state.cpu_seconds)


def _capture_output() -> tuple[int, int]:
    """Point fds 1 and 2 (and sys.stdout/sys.stderr, line-buffered so that prints and writes to the
    fds keep their order) at two anonymous files."""
    fds = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        captured = os.memfd_create(name)
        os.dup2(captured, fd)
        fds.append(captured)
    sys.stdout = io.open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = io.open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    _streams[:] = [sys.stdout, sys.stderr]
    return fds[0], fds[1]


def _execute(code: str) -> tuple[str, str]:
    """exec in fresh globals: (status, the last traceback line or "")."""
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        return "ok", ""
    except SoftTimeout:
        return "timeout", "TimeoutError: the code ran out of time"
    except MemoryError as exc:
        return "oom", _last_line(exc)
    except SystemExit as exc:
        return ("ok", "") if exc.code in (None, 0) else ("error", f"SystemExit: {exc.code}")
    except BaseException as exc:  # noqa: BLE001 - every failure of the code is its output
        return "error", _last_line(exc)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _last_line(exc: BaseException) -> str:
    try:
        return traceback.format_exception_only(type(exc), exc)[-1].strip()
    except Exception:  # noqa: BLE001 - a hostile exception whose str() fails
        return type(exc).__name__


def _release_output(stdout_fd: int, stderr_fd: int) -> str:
    """Flush the captured streams, point fds 1 and 2 back at /dev/null and close the streams (what
    they still hold cannot reach a later call's output); the stdout text."""
    for stream in _streams:  # ours, whatever the code put in sys.stdout
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    for stream in _streams:
        try:
            stream.close()
        except (OSError, ValueError):
            pass
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    os.lseek(stdout_fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(stdout_fd, 1 << 20):
        chunks.append(chunk)
    os.close(stdout_fd)
    os.close(stderr_fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _leave_call(state: _WorkerState, call_dir: str) -> bool:
    """Undo what the call changed around it; True when the worker should not be reused."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    dirty = threads > 1 or bool(state.forked)
    if os.getpid() == 1:  # process 1 of its own PID namespace: end whatever the call started
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # none left
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    os.chdir(state.home)
    shutil.rmtree(call_dir, ignore_errors=True)
    os.environ.clear()
    os.environ.update(state.env)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, raise_soft_timeout)
    signal.signal(signal.SIGALRM, raise_soft_timeout)
    return dirty or os.path.exists(call_dir)


# ---- in the caller --------------------------------------------------------------------------

_EXECUTORS: weakref.WeakSet = weakref.WeakSet()
FOLDER_PREFIX = "jaxrl4llm-python-"  # an executor's host folder: <tmp>/jaxrl4llm-python-<its process id>-<random>


def remove_orphaned_folders(parent: str | None = None) -> list[str]:
    """Remove the executor folders under `parent` (the temporary folder) whose process is gone: one
    killed (SIGKILL, an out-of-memory kill, os._exit) never ran `close`. Only this user's folders,
    named `FOLDER_PREFIX<pid>-...`, whose pid no longer runs. Returns the paths removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not name.startswith(FOLDER_PREFIX) or not pid.isdigit() or _process_runs(int(pid)):
            continue
        path = os.path.join(parent, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid() or os.path.islink(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
_WORKER_CODE = "from jaxrl4llm.tools.python_executor import worker_entry; worker_entry()"


class PythonExecutor:
    """A pool of ``config.workers`` confined, pre-warmed Python workers (the module docstring).

    ``run(codes)`` runs the snippets in parallel, results in input order. ``isolation``: which
    measures the workers got on this host. ``restarts``: workers replaced so far. Close it (or use
    it as a context manager); open executors are closed at exit. ``folder``: the host folder that
    holds the workers' sandbox folders (removed at close; the folder of a process killed before it
    could close is removed by the next executor on the host, `remove_orphaned_folders`).
    """

    def __init__(self, config: ExecutorConfig = ExecutorConfig()):
        self.config = config
        self._launcher, self._namespaces = namespace_launcher() if config.namespaces else ((), frozenset())
        remove_orphaned_folders()
        self.folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        os.chmod(self.folder, 0o711)  # another user (the workers' nobody) may enter, not list
        self._spawned = 0
        self._homes: dict[WorkerProcess, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0
        self._workers: list[WorkerProcess] = []
        _EXECUTORS.add(self)
        try:
            for _ in range(config.workers):
                self._workers.append(self._spawn())
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise
        self.isolation: dict[str, bool] = dict(self._workers[0].info["isolation"])
        if config.hidden_paths and not self.isolation["read_only_filesystem"]:
            warnings.warn("ExecutorConfig.hidden_paths are not hidden: this host gives the workers no mount namespace",
                          stacklevel=2)

    def _spawn(self) -> WorkerProcess:
        c = self.config
        home = os.path.join(self.folder, f"worker{self._spawned}")
        self._spawned += 1
        os.mkdir(home, 0o700)
        confinement = Confinement(
            namespaces=tuple(sorted(self._namespaces)), home=home, folder_bytes=max(4 * c.max_file_bytes, 16 << 20),
            hidden_paths=tuple(os.path.abspath(p) for p in c.hidden_paths),
            needed_paths=_interpreter_paths(),
            preload=tuple(c.preload), memory_bytes=c.memory_bytes,
            cpu_seconds=c.cpu_seconds * (c.calls_per_worker + 1) + 30, max_processes=c.max_processes,
            max_file_bytes=c.max_file_bytes, max_open_files=c.max_open_files)
        settings = {"confinement": confinement._asdict(), "seed": c.seed, "cpu_seconds": c.cpu_seconds,
                    "max_output_chars": c.max_output_chars}
        worker = WorkerProcess(_WORKER_CODE, [json.dumps(settings)], env=worker_environment(home, PACKAGE_ROOT, c.seed),
                               launcher=self._launcher, trusted_replies=False,
                               max_reply_bytes=12 * c.max_output_chars + 4096, new_session=True, cwd=home)
        self._homes[worker] = home
        return worker

    def _replace(self, worker: WorkerProcess) -> None:
        worker.kill()
        shutil.rmtree(self._homes.pop(worker), ignore_errors=True)
        self.restarts += 1
        self._workers[self._workers.index(worker)] = self._spawn()

    def wait_until_ready(self, timeout: float = 120.0) -> None:
        """Block until every worker has started (the constructor does; a replaced worker starts
        in the background), e.g. before timing calls."""
        with self._lock:
            wait_until_ready(self._workers, timeout=timeout, replace=self._replace,
                             start_failure_hint="the worker's error is on stderr above")

    def _retire(self, worker: WorkerProcess, outcome: CallOutcome) -> bool:
        """Whether a worker that answered should be replaced."""
        value = outcome.value
        reported = value if outcome.status == "ok" and isinstance(value, list) and len(value) == 3 else None
        return (worker.calls >= self.config.calls_per_worker or reported is None
                or reported[0] not in ("ok", "error") or bool(reported[2]))

    def run(self, codes: Sequence[str]) -> list[ToolResult]:
        """Run each snippet in fresh globals on the pool; results in input order."""
        if self._closed:
            raise RuntimeError("PythonExecutor is closed; create a new one")
        codes = [c if isinstance(c, str) else _not_code(c) for c in codes]
        with self._lock:
            outcomes = run_calls(self._workers, [(run_snippet, (code,)) for code in codes],
                                 timeout=self.config.timeout, replace=self._replace, retire=self._retire,
                                 start_failure_hint="the worker's error is on stderr above")
        return [self._result(outcome) for outcome in outcomes]

    def _result(self, outcome: CallOutcome) -> ToolResult:
        limit = self.config.max_output_chars
        value = outcome.value
        timed_out = ToolResult("timeout", f"TimeoutError: the code ran longer than {self.config.timeout:g} s",
                               outcome.seconds)
        if outcome.status == "ok" and isinstance(value, list) and len(value) == 3 and value[0] in STATUSES:
            if value[0] == "timeout":
                return timed_out
            return ToolResult(value[0], _printable(truncate_middle(str(value[1]), limit)), outcome.seconds)
        if outcome.status == "timeout":
            return timed_out
        if outcome.status == "error":
            return ToolResult("error", _printable(truncate_middle(str(value), limit)), outcome.seconds)
        return ToolResult("crash", "the Python process died", outcome.seconds)

    def close(self) -> None:
        """Stop every worker and remove their folders."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:  # all asked first, so that they exit together
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "PythonExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _printable(text: str) -> str:
    """``text`` with any lone surrogate (which no tokenizer encodes) replaced by '?'."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _interpreter_paths() -> tuple[str, ...]:
    """What a worker reads: the interpreter, its prefixes, this package and the caller's sys.path."""
    paths = [os.path.dirname(os.path.realpath(sys.executable)), sys.prefix, sys.base_prefix, PACKAGE_ROOT, *sys.path]
    return tuple(dict.fromkeys(p for p in paths if os.path.isabs(p) and os.path.exists(p)))


def _not_code(value) -> str:
    raise TypeError(f"PythonExecutor.run takes strings of code, got {type(value).__name__}")


@atexit.register
def _close_executors() -> None:
    for executor in list(_EXECUTORS):
        executor.close()
