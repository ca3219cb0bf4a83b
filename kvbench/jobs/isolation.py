"""One job in a fresh process (``runtime.isolate=true``, the default).

A process remembers: the peak RSS, torch's thread count and CUDA allocator outlive a job, so in
one process every job after the first would carry the earlier jobs' figures. So the parent runs
each job in a process of its own, which measures, writes ``results.json`` and hands its record back
over a pipe (as optimum-benchmark's process launcher does). That process is forked by a fork server
(:mod:`kvbench.jobs.forkserver`) that imported torch once, so a job pays a fork rather than seconds
of ``import torch``; else it is a new interpreter fed the job on stdin. Not multiprocessing: its
``spawn`` and ``forkserver`` re-import the parent's ``__main__`` and inherit its start method (in a
joblib worker ``loky``, unknown to a fresh interpreter); a plain ``fork`` of the parent would hand
the job the parent's memory, threads and W&B state.

Every way a child can end becomes a record (:func:`death_status`); a stopped parent passes the
signal on and gives the child :data:`GRACE_S` to write its ``interrupted`` record. The child reads
end-of-file on a pipe when its parent dies (even by SIGKILL) and stops, so a killed sweep leaves no
job measuring after its claim is gone (a resumed sweep could otherwise run it a second time).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from omegaconf import DictConfig

from kvbench.config.bench import BenchConfig
from kvbench.jobs.forkserver import ForkServer, ServerGone, available
from kvbench.jobs.interrupts import (
    STOP_SIGNALS,
    Interrupted,
    describe_stop,
    interruptible,
    launcher_stop,
    ours,
    stop_error,
    stop_reasons,
)
from kvbench.jobs.job_config import to_bench_config
from kvbench.progress import Progress, no_progress
from kvbench.results import RESULTS_FILE, RecordError, RunResult, read_record, save, utc_now

GRACE_S = 30.0  # how long an interrupted child may take to write its record before it is killed
# Signals that mean "stop" when they kill a process: sent by a person, a shell or a scheduler.
_STOPPED_BY = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
               signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU)
# Signals a launcher may own in the parent (submitit: SIGTERM bypassed, SIGUSR2 requeues).
_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

Measure = Callable[..., RunResult]  # run_job's signature


def run_here(cfg: DictConfig | BenchConfig, out_dir: Path | str, overrides: Optional[List[str]] = None,
             progress: Progress = no_progress) -> RunResult:
    """:func:`kvbench.jobs.runner.run_job` in this process, imported when called: a parent whose
    jobs all run isolated never imports torch."""
    from kvbench.jobs.runner import run_job

    return run_job(cfg, out_dir, overrides, progress)


def launch_job(cfg: DictConfig | BenchConfig, out_dir: Path | str, overrides: Optional[List[str]] = None,
               progress: Progress = no_progress) -> RunResult:
    """Run one job as ``runtime.isolate`` says: in a fresh process, or in this one. A config that does
    not validate is recorded ``invalid`` here: there is nothing to isolate."""
    try:
        job = to_bench_config(cfg)  # a BenchConfig passes as it is
    except Exception:  # noqa: BLE001 — run_job records any config failure with its message
        return run_here(cfg, out_dir, overrides, progress)
    if not job.runtime.isolate:
        return run_here(job, out_dir, overrides, progress)
    return run_isolated(job, out_dir, overrides, progress)


def run_isolated(job: BenchConfig, out_dir: Path | str, overrides: Optional[List[str]] = None,
                 progress: Progress = no_progress, measure: Measure = run_here) -> RunResult:
    """``measure(job, out_dir, overrides, progress)`` in a new process; its record, or the record of
    how it died. ``measure`` and ``progress`` are pickled by reference; ``measure`` is a test seam."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ignored = child_ignores()
    before, oom_before, started = _file_id(out_dir), oom_kills(), utc_now()
    lost = lambda status, error: _lost(job, out_dir, overrides, started, before, status, error)
    child = None
    with interruptible(once=False):
        try:
            child = _Child((sys.path, ignored), (measure, job, str(out_dir), list(overrides or []), progress),
                           fork_server())
            message = child.collect()
        except BaseException as exc:  # Ctrl-C, SIGTERM, a launcher's SystemExit: record, then raise again
            if isinstance(exc, Exception) and not launcher_stop(exc):  # the parent's side failed: a record too
                _stop(child, None, ignored)
                return lost("error", f"{type(exc).__name__}: {exc} (running the job's process)")
            result = _stop(child, exc, ignored)
            if result is None:
                result = lost("interrupted", describe_stop(exc) + _no_record(child))
            elif result.status == "interrupted" and not isinstance(exc, Interrupted):
                # The child only saw the SIGINT it was stopped with; the cause is the parent's.
                result.error = stop_error(exc, result.metrics)
                save(result, out_dir)
            exc.record = result
            raise
        finally:
            if child is not None:
                child.close()
    if message is not None:
        return _record_of(message)
    if getattr(child.proc, "lost", None):
        return lost("error", f"the job's process ended without a record and {child.proc.lost}")
    return lost(*death_status(child.proc.returncode, oom_before, oom_kills()))


def child_ignores() -> List[int]:
    """The signals a job's process must ignore: those a launcher handles in this process (the parent
    stops the child itself when told; submitit's SIGTERM bypass is no handling), and those this
    process ignores (``nohup``'s SIGHUP, which a child of the fork server would not inherit)."""
    handlers = {s: signal.getsignal(s) for s in (*_LAUNCHER_SIGNALS, signal.SIGINT, signal.SIGQUIT)}
    return [s for s, h in handlers.items() if h is signal.SIG_IGN or (s in _LAUNCHER_SIGNALS and callable(h)
                                                                      and not ours(h))]


_server: Optional[ForkServer] = None
PRELOAD = ("kvbench.jobs.runner", "kvbench.jobs.isolation")  # what the fork server imports once


def fork_server() -> Optional[ForkServer]:
    """This process's fork server, started at its first isolated job and again when it is gone or
    no longer matches this process; None where there can be none, or with KVBENCH_FORK_SERVER=0
    (for a library that does not survive a fork)."""
    global _server
    if not available() or os.environ.get("KVBENCH_FORK_SERVER", "1") == "0":
        return None
    if _server is not None and _server.owner != os.getpid():  # inherited through a fork: the parent's
        _server.sock.close()
        _server = None
    if _server is not None and not _server.usable():
        _server.close()
        _server = None
    if _server is None:
        _server = ForkServer(PRELOAD)
        atexit.register(_close_server, _server)
    return _server


def _close_server(server: ForkServer) -> None:
    # At this process's exit: the server would exit by itself (end of file on its socket), after
    # this process; closed here, it is gone when this process is, as a process's children should be.
    if server.owner == os.getpid() and server.proc.poll() is None:
        server.close()


def _record_of(message: dict) -> RunResult:
    result = RunResult.from_dict(message["record"])
    result.unsaved = message["unsaved"]
    result.written_to = message.get("written_to")
    return result


class _Child:
    """A job's process: hands its record back on one pipe and watches another for the end of this
    process. Forked by the fork server, else a new interpreter running :func:`child_main`."""

    def __init__(self, setup: tuple, job: tuple, server: Optional[ForkServer] = None):
        self.records, record_w = os.pipe()
        alive_r, self._alive = os.pipe()  # only this process holds the writing end
        try:
            if server is not None:
                try:
                    self.proc = server.fork(pickle.dumps((run_forked, (setup[1], job))), (record_w, alive_r))
                except ServerGone:  # it died starting (an import that crashes?): a new interpreter says why
                    server = None
            if server is None:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", "from kvbench.entry import child_main; child_main()",
                     str(record_w), str(alive_r)], stdin=subprocess.PIPE, pass_fds=(record_w, alive_r))
        except BaseException:
            self.close()
            raise
        finally:
            os.close(record_w)
            os.close(alive_r)
        if server is not None:
            return
        try:
            with self.proc.stdin as stdin:
                pickle.dump(setup, stdin)
                pickle.dump(job, stdin)
        except BaseException:  # the caller never gets this object: leave nothing behind
            self.proc.kill()
            self.proc.wait()
            self.close()
            raise

    def collect(self, timeout: Optional[float] = None) -> Optional[dict]:
        """The child's message once it has exited (None if it sent none), read while it runs (a
        record larger than the pipe's buffer would otherwise block it); ``timeout`` leaves it running."""
        chunks = []
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self.records], [], [], remaining)[0]:
                return None
            chunk = os.read(self.records, 1 << 16)
            if not chunk:  # end of file: the child closed its end, or died
                break
            chunks.append(chunk)
        self.proc.wait(None if end is None else max(0.1, end - time.monotonic()))
        try:
            return pickle.loads(b"".join(chunks)) if chunks else None
        except Exception:  # noqa: BLE001 — a record cut short by the child's death is no record
            return None

    def close(self) -> None:
        for fd in (self.records, self._alive):
            os.close(fd)


def child_main() -> None:
    """Entry point of a job's process started as a new interpreter; exits 128 + signal when interrupted."""
    record_fd, alive_fd = int(sys.argv[1]), int(sys.argv[2])
    stdin = sys.stdin.buffer
    sys.path[:], ignored = pickle.load(stdin)  # the parent's, so that its functions import here
    sys.exit(_measure_and_hand_over(record_fd, alive_fd, ignored, lambda: pickle.load(stdin)))


def run_forked(fds: List[int], ignored: List[int], job: tuple) -> int:
    """Entry point of a job's process forked by the fork server; returns the exit status."""
    record_fd, alive_fd = fds
    return _measure_and_hand_over(record_fd, alive_fd, ignored, lambda: job)


def _measure_and_hand_over(record_fd: int, alive_fd: int, ignored: List[int], job: Callable[[], tuple]) -> int:
    for fd in (record_fd, alive_fd):
        os.set_inheritable(fd, False)  # processes the job starts must not hold them open
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)
    _watch_parent(alive_fd)
    code, result = 0, None
    try:
        measure, config, out_dir, overrides, progress = job()
        result = measure(config, out_dir, overrides, progress)
    except BaseException as exc:  # noqa: BLE001 — an interruption: its record is written; hand it over below
        result = getattr(exc, "record", None)
        code = 128 + exc.signum if isinstance(exc, Interrupted) else 1
        if result is None and not isinstance(exc, KeyboardInterrupt):
            raise  # no record to hand over: the traceback is the evidence, the parent records the exit
    # The job is over: a late signal must not cut the hand-over (or the interpreter's exit) short.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    try:
        with os.fdopen(record_fd, "wb") as pipe:
            if result is not None:
                pickle.dump({"record": result.to_dict(), "unsaved": result.unsaved,
                             "written_to": result.written_to}, pipe)
    except OSError:
        pass  # the parent is gone (the record is on disk, if the disk took it)
    return code


def _watch_parent(alive_fd: int) -> None:
    """When the parent ends (even by SIGKILL), interrupt the job; after GRACE_S, exit regardless."""

    def watch() -> None:
        while os.read(alive_fd, 1):
            pass  # nothing is ever written: this returns at end of file, when the parent is gone
        # The first stop signal this process does not ignore: a job started in the background of a
        # script ignores SIGINT, and would measure on for GRACE_S and write no record.
        signum = next((s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN), signal.SIGINT)
        stop_reasons[signum] = "interrupted: the job's parent process ended"
        os.kill(os.getpid(), signum)
        time.sleep(GRACE_S)
        os._exit(128 + signum)

    threading.Thread(target=watch, name="kvbench-parent-watch", daemon=True).start()


def _stop(child: Optional[_Child], exc: Optional[BaseException], ignored: List[int]) -> Optional[RunResult]:
    """Pass ``exc`` on to the child, wait up to GRACE_S for its record (a second Ctrl-C stops the
    wait), then make sure it is gone; without ``exc`` it is killed at once."""
    if child is None:
        return None  # never started
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    if signum in ignored:  # the child takes SIGINT as "stop" (else SIGTERM; else it is killed below)
        signum = signal.SIGINT if signal.SIGINT not in ignored else signal.SIGTERM
    message = None
    try:
        if exc is not None:
            if child.proc.poll() is None:
                os.kill(child.proc.pid, signum)
            message = child.collect(GRACE_S)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        pass  # impatience, or a child that does not stop: kill it below
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
    return None if message is None else _record_of(message)


def _no_record(child: Optional[_Child]) -> str:
    """Why a stopped job has only the record written here: said so, so that the ``results:`` path
    printed after it is never read as a measurement."""
    if child is None:
        return " before the job's process started: nothing was measured (this record is kvbench's own)"
    if child.proc.returncode == -signal.SIGKILL:
        return (f"; the job's process was killed before it handed back its record (after {GRACE_S:.0f} s, or a "
                "second signal): what it measured is lost (this record is kvbench's own)")
    return (" while the job's process was starting, before it measured anything (this record is kvbench's "
            "own)")


def _lost(job: BenchConfig, out_dir: Path, overrides: Optional[List[str]], started: str,
          before: Optional[tuple], status: str, error: str) -> RunResult:
    """The record of a job whose process handed none back: the one it wrote if it died right
    after writing it, else one written here with ``status`` and ``error``."""
    if _file_id(out_dir) != before:
        try:
            return read_record(out_dir)
        except RecordError:
            pass  # not a record it finished writing: describe the end instead
    result = RunResult(status=status, config=asdict(job), overrides=list(overrides or []), error=error,
                       started_at=started, finished_at=utc_now(), env={"hostname": socket.gethostname()})
    save(result, out_dir)
    return result


def death_status(exitcode: Optional[int], oom_before: Optional[int], oom_after: Optional[int]) -> Tuple[str, str]:
    """(status, error) of a job process that ended with ``exitcode`` (negative: that signal) without
    a record; the OOM-kill counts tell an OOM kill from any other SIGKILL."""
    if exitcode is None or exitcode >= 0:
        return "error", f"the job's process exited with code {exitcode} without writing a record"
    signum = -exitcode
    name = _signal_name(signum)
    if signum == signal.SIGKILL:
        if oom_before is None or oom_after is None:
            return "oom", ("the job's process was killed by SIGKILL, most likely by the kernel's OOM killer "
                           "(unconfirmed: /proc/vmstat has no oom_kill count here)")
        if oom_after > oom_before:
            return "oom", (f"the job's process was killed by SIGKILL while the kernel's OOM killer killed "
                           f"{oom_after - oom_before} process(es) (/proc/vmstat oom_kill): out of memory")
        return "interrupted", ("the job's process was killed by SIGKILL, not by the kernel's OOM killer "
                               "(/proc/vmstat oom_kill unchanged): a person or a scheduler killed it")
    if signum in _STOPPED_BY:
        return "interrupted", f"the job's process was killed by {name} before it wrote a record"
    return "error", f"the job's process died of {name} ({signal.strsignal(signum)})"


def oom_kills() -> Optional[int]:
    """How many processes the kernel's OOM killer has killed since boot (/proc/vmstat, Linux >= 4.13)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _file_id(out_dir: Path) -> Optional[tuple]:
    # Records are replaced by rename, so a new one is a new inode.
    try:
        info = (out_dir / RESULTS_FILE).stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns
