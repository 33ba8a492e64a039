"""What a worker process of the Python executor does to itself before it runs any snippet: its
namespaces, mounts, user, resource limits and signals (``confine``), and how it is launched
(``namespace_launcher``). ``jaxrl4llm.tools.python_executor``'s docstring says what each measure
stops and what it does not.

Linux only. Everything here runs in the worker, single-threaded, before the first snippet, except
``namespace_launcher`` and ``worker_environment``, which the executor calls to start a worker.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from typing import NamedTuple, Sequence

SANDBOX_UID = 65534
"""The user (and group) a worker switches to when the executor runs as root: ``nobody``."""

NAMESPACES = ("user_namespace", "network_namespace", "pid_namespace", "mount_namespace")
ISOLATION_KEYS = NAMESPACES + ("read_only_filesystem", "separate_user", "no_new_privileges",
                               "resource_limits", "socket_refusal")
"""The keys of ``PythonExecutor.isolation``: each True where the workers got that measure."""

_UNSHARE_COMMON = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RDONLY, _MS_BIND, _MS_REC = 0x2, 0x4, 0x8, 0x1, 0x1000, 0x4000
_CLONE_NEWUSER = 0x10000000
_PR_SET_NO_NEW_PRIVS = 38
_SYS_MOUNT_SETATTR = 442  # one number on every architecture but alpha (Linux 5.12+)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1


@functools.cache
def namespace_launcher() -> tuple[tuple[str, ...], frozenset[str]]:
    """The ``unshare`` command that starts a worker in its own namespaces on this host, and the
    namespaces it gives (``NAMESPACES`` names); ``((), frozenset())`` where none works. As root the
    worker needs no user namespace (it switches to ``SANDBOX_UID`` itself); otherwise the user
    namespace maps the caller to root inside it. Probed once per process (about 50 ms)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return (), frozenset()
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    user_ns = {"user_namespace"} if user else set()
    candidates = [
        ((unshare, *user, *_UNSHARE_COMMON), user_ns | {"network_namespace", "pid_namespace", "mount_namespace"}),
        ((unshare, *user, "--net"), user_ns | {"network_namespace"}),
    ]
    for command, given in candidates:
        try:
            probe = subprocess.run([*command, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command, frozenset(given)
    return (), frozenset()


def worker_environment(home: str, package_root: str, seed: int) -> dict[str, str]:
    """A worker's whole environment: nothing of the caller's. A fixed PATH (the interpreter's
    folder and the system's), LANG, HOME and TMPDIR in the worker's sandbox folder, PYTHONPATH to
    import the worker's entry, a fixed hash seed, one BLAS/OpenMP thread, no bytecode writes and
    no user site-packages or working folder on ``sys.path``."""
    return {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        "PYTHONPATH": package_root,
        "PYTHONHASHSEED": str(seed),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONSAFEPATH": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, options: str = "") -> None:
    encode = lambda s: None if s is None else s.encode()
    _check(_libc().mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(options)),
           f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def make_read_only(path: str = "/") -> None:
    """Make every mount at and below ``path`` read-only in this mount namespace (mount_setattr)."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    _check(libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), path.encode(),
                        ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           "mount_setattr")


def _others_can_enter(path: str) -> bool:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def expose_paths(paths: Sequence[str]) -> None:
    """Let other users reach ``paths`` (the interpreter, its libraries, this package) in this mount
    namespace: each ancestor folder that others may not enter (``/root``, mode 0700, holding a
    pyenv) is covered by an empty tmpfs into which only the needed child is bind-mounted back.
    The rest of that folder is hidden."""
    while True:
        blocked: dict[str, set[str]] = {}
        for path in paths:
            if not (os.path.isabs(path) and os.path.exists(path)):
                continue
            parts = os.path.realpath(path).split(os.sep)[1:]
            for depth in range(1, len(parts)):
                folder = os.sep + os.path.join(*parts[:depth])
                if not _others_can_enter(folder):
                    blocked.setdefault(folder, set()).add(parts[depth])
                    break
        if not blocked:
            return
        for folder, children in blocked.items():
            fds = {child: os.open(os.path.join(folder, child), os.O_PATH) for child in children}
            _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
            for child, fd in fds.items():
                target = os.path.join(folder, child)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                _mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND | _MS_REC)
                os.close(fd)


def hide_paths(paths: Sequence[str]) -> None:
    """Cover each folder of ``paths`` with an empty read-only tmpfs, each file with /dev/null."""
    for path in paths:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=0555")
        elif os.path.exists(path):
            _mount("/dev/null", path, None, _MS_BIND)


def mount_sandbox_folder(home: str, size_bytes: int, uid: int) -> None:
    """A fresh tmpfs of at most ``size_bytes`` (and 4096 files) on ``home``, owned by ``uid``."""
    options = f"size={size_bytes},nr_inodes=4096,mode=0700,uid={uid},gid={uid}"
    _mount("tmpfs", home, "tmpfs", _MS_NOSUID | _MS_NODEV, options)


def switch_user(uid: int) -> None:
    """Become ``uid`` (and group ``uid``, no supplementary groups): a root process loses every
    capability."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def enter_child_user_namespace() -> None:
    """Move into a new user namespace, so that this process no longer holds the capabilities of
    the namespace that owns its mounts: it cannot remount them. (Its ids are not mapped there, as
    /proc is read-only by then: they print as 65534 and act as before.)"""
    _check(_libc().unshare(ctypes.c_int(_CLONE_NEWUSER)), "unshare(CLONE_NEWUSER)")


def forbid_new_privileges() -> None:
    """PR_SET_NO_NEW_PRIVS: no set-user-ID program (su, mount) can raise this process's rights."""
    _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def set_resource_limits(memory_bytes: int, cpu_seconds: float, max_processes: int, max_file_bytes: int,
                        max_open_files: int) -> None:
    """setrlimit, soft = hard: address space, total CPU seconds of this process, processes (and
    threads) of its user, size of a written file, open files; no core dumps."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + cpu_seconds)
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_NPROC, max_processes), (resource.RLIMIT_FSIZE, max_file_bytes),
                         (resource.RLIMIT_NOFILE, max_open_files), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


def limit_cpu_of_next_call(cpu_seconds: float) -> None:
    """Lower the soft CPU limit to what this process has used plus ``cpu_seconds`` (SIGXCPU there;
    the hard limit, set once, is the whole worker's budget)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used.ru_utime + used.ru_stime + cpu_seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


class _RefusedSocket:
    def __new__(cls, *args, **kwargs):
        raise PermissionError(errno.EACCES, "network access is disabled in this sandbox")


def refuse_sockets() -> None:
    """Make the ``socket`` module refuse to create sockets (the fallback without a network
    namespace: a snippet that calls the system directly, through ctypes, is not stopped)."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "network access is disabled in this sandbox")

    socket.socket = socket.SocketType = _socket.socket = _RefusedSocket  # type: ignore[misc,assignment]
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, refuse)


def ignore_outside_signals(on_time_up) -> None:
    """SIGINT and SIGTERM (meant for the trainer, e.g. a Ctrl-C to its process group) are ignored;
    SIGXFSZ is ignored (an oversized write then fails with an error); SIGXCPU and SIGALRM call
    ``on_time_up``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, on_time_up)
    signal.signal(signal.SIGALRM, on_time_up)


def reachable_by_others(path: str) -> bool:
    """Whether a user who owns none of them may enter every folder on the way to ``path``."""
    parts = os.path.realpath(path).split(os.sep)[1:]
    folders = [os.sep + os.path.join(*parts[:depth]) for depth in range(1, len(parts) + 1)]
    return all(_others_can_enter(f) for f in folders if os.path.isdir(f))


class Confinement(NamedTuple):
    """What ``confine`` sets up in a worker. ``namespaces``: those its launcher gave it;
    ``home``: its sandbox folder; ``folder_bytes``: the size of the tmpfs mounted there (with
    a mount namespace); ``hidden_paths``: covered; ``needed_paths``: what the worker must still
    read as another user (the interpreter, its libraries, this package); ``preload``: modules
    imported before any limit; then the resource limits."""

    namespaces: tuple[str, ...]
    home: str
    folder_bytes: int
    hidden_paths: tuple[str, ...]
    needed_paths: tuple[str, ...]
    preload: tuple[str, ...]
    memory_bytes: int
    cpu_seconds: float
    max_processes: int
    max_file_bytes: int
    max_open_files: int


def confine(settings: Confinement, on_time_up) -> dict[str, bool]:
    """Confine this worker process, in order: signals; with a mount namespace, a read-only file
    system but for a fresh tmpfs on ``home`` (and ``hidden_paths`` covered); the preloaded
    imports; another user (as root: ``SANDBOX_UID``; in a user namespace: a child namespace
    without rights over the mounts); no new privileges; sockets refused without a network
    namespace; resource limits; stdout and stderr to /dev/null. Returns which measures took
    (``ISOLATION_KEYS``); one that fails is reported False, not raised."""
    got = dict.fromkeys(ISOLATION_KEYS, False)
    got.update({name: True for name in settings.namespaces})
    got["pid_namespace"] = got["pid_namespace"] and os.getpid() == 1
    ignore_outside_signals(on_time_up)
    as_root = os.geteuid() == 0 and not got["user_namespace"]
    if got["mount_namespace"]:
        got["read_only_filesystem"] = _mount_sandbox(settings, SANDBOX_UID if as_root else 0, as_root)
    os.chdir(settings.home)
    for module in settings.preload:
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - a snippet that imports it sees the error itself
            pass
    if as_root:
        got["separate_user"] = _switch_to_sandbox_user(settings)
    elif got["user_namespace"] and not _leave_mount_rights():
        got["read_only_filesystem"] = False  # the worker could remount its file system writable
    got["no_new_privileges"] = _attempt(forbid_new_privileges)
    if not got["network_namespace"]:
        got["socket_refusal"] = _attempt(refuse_sockets)
    got["resource_limits"] = _attempt(lambda: set_resource_limits(
        settings.memory_bytes, settings.cpu_seconds, settings.max_processes, settings.max_file_bytes,
        settings.max_open_files))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    return got


def _attempt(step) -> bool:
    try:
        step()
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _mount_sandbox(settings: Confinement, owner: int, as_root: bool) -> bool:
    """The mounts of a worker with its own mount namespace: True when the file system outside
    the sandbox folder is read-only."""
    try:
        if as_root:
            expose_paths(settings.needed_paths)
        make_read_only("/")
        mount_sandbox_folder(settings.home, settings.folder_bytes, owner)
        hide_paths(settings.hidden_paths)
    except OSError:
        return False
    return True


def _switch_to_sandbox_user(settings: Confinement) -> bool:
    """As root: become ``SANDBOX_UID``, when that user can still read what the worker needs."""
    if not all(reachable_by_others(p) for p in settings.needed_paths if os.path.exists(p)):
        return False
    return _attempt(lambda: (os.chown(settings.home, SANDBOX_UID, SANDBOX_UID), switch_user(SANDBOX_UID)))


def _leave_mount_rights() -> bool:
    """In a user namespace: enter a child one (needs a single thread), giving up the rights over
    this worker's mounts."""
    return len(os.listdir("/proc/self/task")) == 1 and _attempt(enter_child_user_namespace)
