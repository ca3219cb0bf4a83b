"""A fork server: one process that imports a job's code (torch, the tasks) once and forks a fresh
process for every job, so that an isolated job pays a ``fork()`` instead of a Python start and
``import torch`` (seconds) each time.

The server is a new interpreter that imports, then waits, and never runs a job itself: what a job
changes (its peak resident set, torch's threads, the allocators, CUDA, which the server never
initialises) dies with its child. The child takes on the requester's current environment, working
directory, umask, affinity, limits, ``sys.path`` and streams; a change that counts at import time
(:data:`IMPORT_TIME_ENV`) gets a new server.

Only the server can wait for its children, so it reports each exit status over the socket and
holds the child's process ID until the requester has read it (``waitid`` with ``WNOWAIT``, then a
``reap`` message): a signal the requester sends can never reach a recycled ID. The server ends when
the requester does; a job runs to its end (or stops itself) if the server dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pickle
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple

SERVER_NAME, JOB_NAME = b"kvbench-fork", b"kvbench-job"  # their names in ps, top and psutil
# Variables read when torch, its thread pools, CUDA and the dynamic loader start: a server
# started under other values would give its jobs those, so a change starts a new server.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "CUDA_", "NVIDIA_", "PYTORCH_", "TORCH", "LD_",
                   "PYTHON", "MALLOC_", "HIP_", "ROCR_", "HSA_", "KVBENCH_FORK")
# What a terminal or a scheduler sends a whole process group: the server ignores them (it owns no
# job and must outlive a job's stop), every job's process starts with Python's own handling.
SERVER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGALRM)
_HEADER = struct.Struct("!Q")
_PENDING = object()  # no message yet
_MAX_FDS = 8
START_TIMEOUT_S = 60.0  # a fork takes milliseconds: a server that does not answer is broken


def available() -> bool:
    """Whether this platform can run a fork server (fork, and descriptors over a Unix socket)."""
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and hasattr(os, "waitid")


def server_key() -> tuple:
    """What a server's jobs inherit from the moment it started, which must match the requester's now."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV)))
    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return sys.executable, tuple(sys.path), env, cpus


class ServerGone(OSError):
    """The fork server ended or stopped answering."""


def _send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int, fds: List[int]) -> bytes:
    chunks, got = [], 0
    while got < size:
        data, new_fds, _, _ = socket.recv_fds(sock, size - got, _MAX_FDS)
        fds.extend(new_fds)
        if not data:
            raise ServerGone("the other end of the fork server's socket closed")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Tuple[object, List[int]]:
    fds: List[int] = []
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    return pickle.loads(_recv_exact(sock, size, fds)), fds


def _set_name(name: bytes) -> None:
    try:  # prctl(PR_SET_NAME): what ps and psutil call the process
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(15, name, 0, 0, 0)
    except (OSError, AttributeError):
        pass


# ---- the requester's side --------------------------------------------------------------------

class ForkServer:
    """A running fork server that preloads the modules ``preload``; :meth:`fork` starts a job."""

    def __init__(self, preload: Sequence[str]):
        self.key, self.owner = server_key(), os.getpid()
        self.job: Optional[ForkedProcess] = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from kvbench.entry import forkserver_main; forkserver_main()",
                 str(theirs.fileno()), json.dumps(sys.path), *preload], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.ready = False
        self.broken = False

    def usable(self) -> bool:
        return (not self.broken and self.proc.poll() is None and self.key == server_key()
                and (self.job is None or self.job.done()))

    def wait_ready(self) -> None:
        """Until the server has imported what it preloads (the first job's start: seconds)."""
        if not self.ready:
            self._expect("ready", None)
            self.ready = True

    def fork(self, call: bytes, fds: Sequence[int]) -> "ForkedProcess":
        """A new process that runs ``function(fds, *args)`` of ``pickle.loads(call)``, its return value
        the exit status. Signals are held during the request, so that every job forked is one this
        process knows the ID of."""
        self.wait_ready()
        setup = {"env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(), "path": list(sys.path),
                 "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                 "limits": _limits(), "argv0": sys.argv[0] if sys.argv else ""}
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_IGNORES)
        try:
            _send(self.sock, pickle.dumps(("fork", setup, call)), [1, 2, *fds])
            pid = self._expect("started", START_TIMEOUT_S)
            if pid is _PENDING:
                raise ServerGone(f"the fork server did not start the job within {START_TIMEOUT_S:.0f} s")
        except BaseException:
            self.broken = True
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.job = ForkedProcess(self, pid)
        return self.job

    def _expect(self, kind: str, timeout: Optional[float]):
        """The value of the server's next message, which must be ``kind``; :data:`_PENDING` when none
        came within ``timeout``. A message cut short leaves the server unusable."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return _PENDING
        try:
            message, fds = _recv(self.sock)
        except BaseException:
            self.broken = True
            raise
        for fd in fds:
            os.close(fd)
        if not isinstance(message, tuple) or message[0] != kind:
            self.broken = True
            raise ServerGone(f"the fork server answered {message!r}, not {kind!r}")
        return message[1] if len(message) > 1 else None

    def close(self) -> None:
        """End the server (a job of it still running is not its to end: it runs on or stops itself)."""
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # still importing: it would read end of file afterwards
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """A fork server's child with :class:`subprocess.Popen`'s interface; ``lost`` says why there is no
    exit status when the server died first."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: Optional[int] = None
        self.lost: Optional[str] = None

    def done(self) -> bool:
        return self.returncode is not None or self.lost is not None

    def poll(self) -> Optional[int]:
        if not self.done():
            self._read(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        if not self.done():
            self._read(timeout)
            if not self.done():
                raise subprocess.TimeoutExpired(f"job process {self.pid}", timeout)
        return self.returncode

    def _read(self, timeout: Optional[float]) -> None:
        try:
            code = self.server._expect("exited", timeout)
        except OSError as exc:  # ServerGone included: end of file where the status should be
            self.lost = f"its exit status was lost: the fork server that started it ended ({exc})"
            return
        if code is _PENDING:
            return
        self.returncode = code
        try:  # the server may reap it now
            _send(self.server.sock, pickle.dumps(("reap",)))
        except OSError:
            self.server.broken = True

    def send_signal(self, signum: int) -> None:
        # The ID is still this job's: the server reaps it only after reporting its exit to us.
        if not self.done():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _limits() -> dict:
    return {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
            if name.startswith("RLIMIT_")}


# ---- the server's side ------------------------------------------------------------------------

def serve(sock_fd: int, path: Sequence[str], preload: Sequence[str]) -> Optional[Callable[[], int]]:
    """The server's loop. Returns None in the server when the requester has gone, and in each forked
    child the job to run."""
    import importlib

    _set_name(SERVER_NAME)
    for signum in SERVER_IGNORES:
        signal.signal(signum, signal.SIG_IGN)
    sys.path[:] = path
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 — a job that needs it fails in its own process, with its traceback
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return None  # CUDA does not survive a fork: no server (the requester starts interpreters instead)
    sock = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock.fileno(), False)
    unreaped: Optional[int] = None
    try:
        _send(sock, pickle.dumps(("ready",)))
        while True:
            message, fds = _recv(sock)
            if unreaped is not None:  # the requester has read its status: the ID may go
                os.waitpid(unreaped, 0)
                unreaped = None
            if message == ("reap",):
                continue
            _, setup, call = message
            pid = os.fork()
            if pid == 0:
                sock.close()
                return partial(_child, setup, call, fds)
            for fd in fds:
                os.close(fd)
            _send(sock, pickle.dumps(("started", pid)))
            code = _wait_exit(pid, sock)
            if code is None:  # the requester went away; its job stops itself (it watches it too)
                return None
            _send(sock, pickle.dumps(("exited", code)))
            unreaped = pid
    except (ServerGone, OSError):
        return None


def _wait_exit(pid: int, sock: socket.socket) -> Optional[int]:
    """``pid``'s exit status as subprocess gives it (negative: the signal), left unreaped; None when
    the requester closed the socket first."""
    try:
        watch = [sock, os.pidfd_open(pid)]
    except (AttributeError, OSError):
        watch = [sock]
    try:
        while True:
            readable = select.select(watch, [], [], None if len(watch) == 2 else 0.05)[0]
            if sock in readable:  # end of file (or a request out of turn): the requester is gone or lost
                return None
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == pid:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    finally:
        if len(watch) == 2:
            os.close(watch[1])


def _child(setup: dict, call: bytes, fds: List[int]) -> int:
    """A job's process, just forked: the requester's environment, then the job."""
    _set_name(JOB_NAME)
    for signum in SERVER_IGNORES:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(setup["env"])
    os.chdir(setup["cwd"])
    os.umask(setup["umask"])
    if setup["cpus"] and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, setup["cpus"])
    for name, limits in setup["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), limits)
        except (ValueError, OSError):
            pass  # a hard limit above the server's: the server's stays
    sys.path[:] = setup["path"]
    sys.argv[:] = [setup["argv0"]]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip((1, 2), fds[:2]):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as an interpreter started on them would
    _reset_peak_rss()
    function, args = pickle.loads(call)
    return function(fds[2:], *args)


def _reset_peak_rss() -> None:
    # A forked process starts with its parent's high-water mark of resident memory (VmHWM), the
    # server's; from here the peak is this process's own (Linux >= 4.0; elsewhere nothing to do).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
