"""The Python tool executor against hostile code: time, memory, processes, files, environment,
network and signals; and what a model sees (stdout, the last error line, the middle cut,
reproducible randomness, input order)."""

import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from jaxrl4llm.tools import ExecutorConfig, PythonExecutor, truncate_middle
from jaxrl4llm.tools.confinement import ISOLATION_KEYS, worker_environment
from jaxrl4llm.tools.python_executor import FOLDER_PREFIX, remove_orphaned_folders

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 1.0
SECRET_NAME = f"JAXRL4LLM_TEST_SECRET_{uuid.uuid4().hex[:8].upper()}"
SECRET_VALUE = uuid.uuid4().hex


@pytest.fixture(scope="module")
def hidden_dir():
    """A world-readable folder (as a dataset's is): only hiding keeps the workers out of it."""
    folder = Path(tempfile.mkdtemp(prefix="jaxrl4llm-answers-"))
    folder.chmod(0o755)
    (folder / "gold.jsonl").write_text('{"answer": 42}\n')
    (folder / "gold.jsonl").chmod(0o644)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def executor(hidden_dir):
    """Two workers, a 1 s limit, numpy preloaded; started with a secret in this process's environment."""
    os.environ[SECRET_NAME] = SECRET_VALUE
    try:
        config = ExecutorConfig(timeout=TIMEOUT, cpu_seconds=TIMEOUT, workers=2, preload=("numpy",),
                                max_file_bytes=1 << 20, hidden_paths=(str(hidden_dir),))
        with PythonExecutor(config) as ex:
            yield ex
    finally:
        os.environ.pop(SECRET_NAME, None)


@pytest.fixture(scope="module")
def bare_executor():
    """No namespaces at all: the fallbacks only."""
    with PythonExecutor(ExecutorConfig(timeout=TIMEOUT, workers=1, preload=(), namespaces=False)) as ex:
        yield ex


def run_one(executor, code: str):
    executor.wait_until_ready()  # a worker replaced by an earlier call may still be starting
    start = time.monotonic()
    (result,) = executor.run([code])
    return result, time.monotonic() - start


def processes_mentioning(text: str) -> list[str]:
    """The pids of the processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def process_count() -> int:
    return sum(name.isdigit() for name in os.listdir("/proc"))


def test_isolation_is_reported(executor, bare_executor):
    for ex in (executor, bare_executor):
        assert set(ex.isolation) == set(ISOLATION_KEYS)
        assert all(isinstance(v, bool) for v in ex.isolation.values())
        assert ex.isolation["resource_limits"]
        assert ex.isolation["network_namespace"] or ex.isolation["socket_refusal"]
    assert bare_executor.isolation["socket_refusal"] and not bare_executor.isolation["network_namespace"]


@pytest.mark.parametrize("code", ["while True: pass",
                                  "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"],
                         ids=["endless loop", "endless loop that ignores the alarm"])
def test_endless_loop_times_out_and_the_worker_is_replaced(executor, code):
    restarts = executor.restarts
    result, elapsed = run_one(executor, code)
    assert result.status == "timeout" and "TimeoutError" in result.output
    assert elapsed < TIMEOUT + 1.0
    assert executor.restarts == restarts + 1
    assert [r[:2] for r in executor.run(["print('next')"] * 2)] == [("ok", "next\n")] * 2


def test_huge_allocation_is_out_of_memory(executor):
    result, elapsed = run_one(executor, "x = bytearray(10**10)")
    assert (result.status, result.output) == ("oom", "MemoryError")
    assert run_one(executor, "print(len(bytearray(10**6)))")[0].output == "1000000\n"


def test_fork_bomb_is_stopped(executor):
    before = process_count()
    result, elapsed = run_one(executor, "import os\nwhile True: os.fork()")
    assert result.status in ("error", "crash", "timeout") and elapsed < TIMEOUT + 1.0
    if executor.isolation["separate_user"] or executor.isolation["user_namespace"]:
        assert result.status == "error" and "BlockingIOError" in result.output  # RLIMIT_NPROC
    deadline = time.monotonic() + 5.0
    while process_count() > before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_count() <= before + 3
    assert run_one(executor, "print('alive')")[0].output == "alive\n"


def test_writes_outside_the_call_folder_fail_or_leave_nothing(executor):
    if not (executor.isolation["read_only_filesystem"] or executor.isolation["separate_user"]):
        pytest.skip("the workers run as the caller's user with the caller's file system")
    name = f"jaxrl4llm-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, REPO_ROOT / name]
    code = "import os\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote')\nexcept OSError as e:\n    print(type(e).__name__)\n"
        for t in targets) + "open('inside.txt', 'w').write('x')\nprint(os.listdir('.'))"
    result, _ = run_one(executor, code)
    assert result.status == "ok", result
    assert result.output.splitlines()[-1] == "['inside.txt']"  # the call's own folder is writable
    for target in targets:
        assert not target.exists()
    # The sandbox folder holds only the running call's folder: earlier ones were removed.
    listing = run_one(executor, "import os\nprint(os.listdir(os.path.dirname(os.getcwd())))")[0]
    assert len(json.loads(listing.output.replace("'", '"'))) == 1


@pytest.mark.parametrize("which", ["namespaces", "bare"])
def test_environment_has_none_of_the_callers_variables(executor, bare_executor, which):
    ex = executor if which == "namespaces" else bare_executor
    result, _ = run_one(ex, "import os, json\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(result.output)
    assert SECRET_NAME not in env and SECRET_VALUE not in result.output
    assert set(env) == set(worker_environment("/", "/", 0))
    assert env["HOME"] != os.environ.get("HOME") and env["HOME"] == os.path.realpath(env["HOME"])


@pytest.mark.parametrize("which", ["namespaces", "bare"])
def test_connection_to_the_trainers_localhost_fails(executor, bare_executor, which):
    ex = executor if which == "namespaces" else bare_executor
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result, _ = run_one(ex, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\nprint('connected')")
        assert result.status == "error" and "connected" not in result.output
        server.settimeout(0.05)
        with pytest.raises(TimeoutError):
            server.accept()


def test_signal_to_the_trainer_has_no_effect(executor):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append(True))
    try:
        result, _ = run_one(executor, f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)\nprint('sent')")
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [] and result.status == "error", result  # no such process (PID namespace) or not permitted


def test_hidden_paths_and_other_users_files_cannot_be_read(executor, hidden_dir, tmp_path):
    if executor.isolation["mount_namespace"] and executor.isolation["read_only_filesystem"]:
        result, _ = run_one(executor, f"import os\nprint(os.listdir({str(hidden_dir)!r}))")
        assert result.output == "[]\n"
        result, _ = run_one(executor, f"print(open({str(hidden_dir / 'gold.jsonl')!r}).read())")
        assert result.status == "error" and "42" not in result.output
    if not executor.isolation["separate_user"]:
        pytest.skip("the workers run as the caller's user")
    private = tmp_path / "private.txt"
    private.write_text("secret")
    private.chmod(0o600)
    result, _ = run_one(executor, f"print(open({str(private)!r}).read())")
    assert result.status == "error" and "secret" not in result.output


def test_each_call_has_fresh_globals(executor):
    assert [r.status for r in executor.run(["x = 41", "x = 41"])] == ["ok", "ok"]
    results = executor.run(["print(x)", "print(x)"])  # on the same two workers
    assert [r.output for r in results] == ["NameError: name 'x' is not defined"] * 2


def test_stdout_is_captured_and_cut_in_the_middle(executor):
    code = "import os, sys\nprint('a' * 3000 + 'b' * 3000)\nprint('E' * 10, file=sys.stderr)\nos.write(1, b'c' * 5 + b'\\n')"
    result, _ = run_one(executor, code)
    limit = executor.config.max_output_chars
    assert result.status == "ok" and len(result.output) <= limit
    assert result.output.startswith("a" * 1000) and result.output.endswith("b" * 500 + "\nccccc\n")
    assert "E" not in result.output  # stderr is captured, not returned
    head, rest = result.output.split("\n...[")
    dropped, tail = rest.split(" chars dropped]...\n")
    assert len(head) + int(dropped) + len(tail) == 6000 + len("\n") + len("ccccc\n")


def test_output_past_the_file_limit_is_an_error_and_does_not_reach_later_calls(executor):
    result, _ = run_one(executor, "while True: print('x' * 100)")
    assert result.status == "error" and "File too large" in result.output  # RLIMIT_FSIZE
    assert [r.output for r in executor.run(["print('clean')"] * 2)] == ["clean\n"] * 2


def test_a_worker_left_with_a_thread_is_replaced(executor):
    restarts = executor.restarts
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\nprint('started')"
    assert run_one(executor, code)[0].output == "started\n"
    assert executor.restarts == restarts + 1


def test_any_text_comes_back(executor):
    results = executor.run(["print('é✓😀' * 1000)", "raise ValueError('\\udc80 half a pair')"])
    assert results[0].status == "ok" and results[0].output.startswith("é✓😀" * 300)
    assert results[1] == ("error", "ValueError: ? half a pair", results[1].seconds)


def test_truncate_middle():
    assert truncate_middle("short", 10) == "short"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    for limit in (40, 41, 100, 999):
        cut = truncate_middle(text, limit)
        head, rest = cut.split("\n...[")
        dropped, tail = rest.split(" chars dropped]...\n")
        assert len(cut) == limit and text.startswith(head) and text.endswith(tail)
        assert len(head) + int(dropped) + len(tail) == len(text) and abs(len(head) - len(tail)) <= 1
    assert len(truncate_middle(text, 5)) <= 5


def test_an_exception_gives_the_last_traceback_line(executor):
    results = executor.run(["def f():\n    return 1 / 0\nprint('before')\nf()", "print(("])
    assert results[0][:2] == ("error", "ZeroDivisionError: division by zero")
    assert results[1].status == "error" and results[1].output.startswith("SyntaxError")


def test_seeded_random_is_reproducible(executor):
    code = "import random, numpy\nprint(random.random(), random.randint(0, 10**9), numpy.random.rand(2))"
    outputs = [r.output for r in executor.run([code] * 2) + executor.run([code] * 2)]
    assert outputs[0] and len(set(outputs)) == 1


def test_parallel_calls_return_in_input_order(executor):
    executor.wait_until_ready()
    delays = [0.3, 0.0, 0.2, 0.0]
    start = time.monotonic()
    results = executor.run([f"import time\ntime.sleep({d})\nprint({i})" for i, d in enumerate(delays)])
    assert [r.output for r in results] == [f"{i}\n" for i in range(len(delays))]
    assert time.monotonic() - start < sum(delays)  # the two workers overlap


@pytest.mark.parametrize("code", ["import os\nos._exit(3)", "import ctypes\nctypes.string_at(0)"],
                         ids=["exit", "segfault"])
def test_a_crash_is_reported_and_the_worker_replaced(executor, code):
    restarts = executor.restarts
    result, _ = run_one(executor, code)
    assert result.status == "crash" and executor.restarts == restarts + 1
    assert run_one(executor, "print(1)")[0].output == "1\n"


def test_workers_are_recycled_and_none_outlives_the_executor():
    ex = PythonExecutor(ExecutorConfig(timeout=TIMEOUT, workers=1, calls_per_worker=2, preload=()))
    for _ in range(3):
        assert ex.run(["print(1)"])[0].output == "1\n"
    assert ex.restarts == 1
    root = ex.folder
    ex.close()
    deadline = time.monotonic() + 5.0  # a killed process may take a moment to go
    while processes_mentioning(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(root) == [] and not os.path.exists(root)
    with pytest.raises(RuntimeError, match="closed"):
        ex.run(["print(1)"])


def test_the_folder_of_a_killed_process_is_removed_by_the_next_executor(tmp_path):
    """A process killed before `close` (SIGKILL) leaves its executor's folder; the next executor on
    the host removes it, and leaves a running process's folder and other names alone."""
    code = ("import os, signal, sys; from jaxrl4llm.tools import ExecutorConfig, PythonExecutor; "
            "ex = PythonExecutor(ExecutorConfig(timeout=1.0, workers=1, preload=())); print(ex.folder, os.getpid(), flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    folder, pid = done.stdout.split()
    orphan = Path(folder)
    assert orphan.parent == tmp_path and orphan.is_dir() and orphan.name.startswith(f"{FOLDER_PREFIX}{pid}-")
    running = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-x"
    other = tmp_path / f"{FOLDER_PREFIX}notapid"
    running.mkdir(), other.mkdir()
    assert remove_orphaned_folders(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and running.is_dir() and other.is_dir()
