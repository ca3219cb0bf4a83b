"""One job in a fresh process (``runtime.isolate=true``, the default).

A process remembers: ``getrusage``'s peak RSS is the peak since the process started, and
torch's thread count and CUDA allocator outlive a job, so in one process every job after the
first would carry the earlier jobs' figures. So the Hydra job function (the parent) starts a
child with multiprocessing's ``spawn`` method (a new interpreter: nothing inherited, CUDA
works in it); the child resolves the device, measures, writes ``results.json`` and hands its
record back over a pipe. optimum-benchmark's process launcher works the same way.

The parent turns every way a child can end into a record (written by the parent when the
child left none):

- the child hands back its record: that record, whatever its status;
- it dies without one: SIGKILL is ``oom`` when the kernel's OOM-kill count rose during the
  job, or when the count cannot be read (the error then says the OOM killer is only the likely
  cause), else ``interrupted`` (something killed it); SIGINT, SIGTERM, SIGHUP and the like are
  ``interrupted``; a crash (SIGSEGV, SIGABRT, ...) or an exit code is ``error``, named;
- the parent itself is stopped (Ctrl-C, SIGTERM, a launcher's SystemExit on preemption): it
  passes the signal on, gives the child :data:`GRACE_S` to write its ``interrupted`` record,
  kills it if it has not, and raises the interruption again with ``exc.record`` set.

The child watches its parent: when the parent dies, even by SIGKILL, the child stops as if
interrupted. A killed sweep therefore leaves no job measuring on its own after its claim on
the job directory is gone (a resumed sweep could otherwise run it a second time, at once).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from omegaconf import DictConfig

from kvbench.config import BenchConfig, to_bench_config
from kvbench.interrupts import Interrupted, describe_stop, interruptible, stop_reasons
from kvbench.results import RESULTS_FILE, RecordError, RunResult, read_record
from kvbench.runner import Progress, no_progress, run_job, save, utc_now

GRACE_S = 30.0  # how long an interrupted child may take to write its record before it is killed
# Signals that mean "stop" when they kill a process: sent by a person, a shell or a scheduler.
_STOPPED_BY = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
               signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU)
# Signals a launcher may own in the parent (submitit: SIGTERM bypassed, SIGUSR2 requeues).
_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

Measure = Callable[..., RunResult]  # run_job's signature


def launch_job(cfg: DictConfig | BenchConfig, out_dir: Path | str, overrides: Optional[List[str]] = None,
               progress: Progress = no_progress) -> RunResult:
    """Run one job as ``runtime.isolate`` says: in a fresh process, or in this one. A config
    that does not validate is recorded ``invalid`` here: there is nothing to isolate."""
    try:
        job = to_bench_config(cfg)
    except Exception:  # noqa: BLE001 — run_job records any config failure with its message
        return run_job(cfg, out_dir, overrides, progress)
    if not job.runtime.isolate:
        return run_job(job, out_dir, overrides, progress)
    return run_isolated(job, out_dir, overrides, progress)


def run_isolated(job: BenchConfig, out_dir: Path | str, overrides: Optional[List[str]] = None,
                 progress: Progress = no_progress, measure: Measure = run_job) -> RunResult:
    """``measure(job, out_dir, overrides, progress)`` in a spawned child; returns its record,
    or the record of how it died. ``measure`` and ``progress`` must be importable functions
    (they are pickled by reference); ``measure`` is a seam for tests that crash a child."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    # A signal a launcher handles here is the launcher's to act on: the child ignores it and
    # the parent stops the child itself (with SIGINT) when the launcher says so.
    ignored = [s for s in _LAUNCHER_SIGNALS if callable(signal.getsignal(s))]
    before, oom_before, started = _file_id(out_dir), oom_kills(), utc_now()
    child = ctx.Process(target=_child_main, name="kvbench-job",
                        args=(measure, job, str(out_dir), list(overrides or []), progress, sender, ignored))
    with interruptible(once=False):
        try:
            child.start()
            sender.close()  # the child holds the only writing end: EOF means it is gone
            message = _wait(child, receiver)
        except BaseException as exc:
            result = _stop(child, receiver, exc, ignored)
            if result is None:
                result = _lost(job, out_dir, overrides, started, exc, before, oom_before, child.exitcode)
            elif result.status == "interrupted" and not isinstance(exc, Interrupted):
                # The child only saw the SIGINT it was stopped with; the cause is the parent's.
                result.error = describe_stop(exc)
                save(result, out_dir)
            exc.record = result
            raise
        finally:
            receiver.close()
    if message is not None:
        return _record_of(message)
    return _lost(job, out_dir, overrides, started, None, before, oom_before, child.exitcode)


def _record_of(message: dict) -> RunResult:
    result = RunResult.from_dict(message["record"])
    result.unsaved = message["unsaved"]
    return result


def _child_main(measure: Measure, job: BenchConfig, out_dir: str, overrides: List[str],
                progress: Progress, sender: Any, ignored: List[int]) -> None:
    """The child: measure, hand the record back, exit 0 (128 + signal when interrupted)."""
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)
    _watch_parent()
    code, result = 0, None
    try:
        result = measure(job, out_dir, overrides, progress)
    except BaseException as exc:  # noqa: BLE001 — an interruption: its record is written; hand it over below
        result = getattr(exc, "record", None)
        code = 128 + exc.signum if isinstance(exc, Interrupted) else 1
    # The job is over: a late signal must not cut the hand-over short.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        if result is not None:
            sender.send({"record": result.to_dict(), "unsaved": result.unsaved})
        sender.close()
    except OSError:
        pass  # the parent is gone (the record is on disk, if the disk took it)
    sys.exit(code)


def _watch_parent() -> None:
    """When the parent process ends (even by SIGKILL), interrupt this child's job so that it
    records ``interrupted`` and exits; after GRACE_S, exit regardless."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        stop_reasons[signal.SIGINT] = "interrupted: the job's parent process ended"
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(GRACE_S)
        os._exit(128 + signal.SIGINT)

    threading.Thread(target=watch, name="kvbench-parent-watch", daemon=True).start()


def _wait(child: Any, receiver: Any, timeout: Optional[float] = None) -> Optional[dict]:
    """The child's message once the child has exited (None if it sent none), reading while
    it runs: a record larger than the pipe's buffer would otherwise block it. With
    ``timeout``, returns after that many seconds even if the child is still running."""
    message, sources = None, [receiver, child.sentinel]
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if end is None else max(0.0, end - time.monotonic())
        ready = multiprocessing.connection.wait(sources, remaining)
        if not ready:
            return message
        if receiver in ready:  # drained before the exit is noticed: nothing sent is lost
            try:
                message = receiver.recv()
            except EOFError:
                sources.remove(receiver)
            continue
        child.join()
        return message


def _stop(child: Any, receiver: Any, exc: BaseException, ignored: List[int]) -> Optional[RunResult]:
    """The parent was stopped by ``exc``: pass it on to the child, wait up to GRACE_S for its
    record (a second Ctrl-C stops the wait), then make sure the child is gone."""
    if not child.is_alive() and child.exitcode is None:
        return None  # never started
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    if signum in ignored:
        signum = signal.SIGINT  # the child always takes SIGINT as "stop"
    message = None
    try:
        if child.is_alive():
            os.kill(child.pid, signum)
        message = _wait(child, receiver, GRACE_S)
    except KeyboardInterrupt:
        pass  # impatience: kill it below
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    return None if message is None else _record_of(message)


def _lost(job: BenchConfig, out_dir: Path, overrides: Optional[List[str]], started: str,
          exc: Optional[BaseException], before: Optional[tuple], oom_before: Optional[int],
          exitcode: Optional[int]) -> RunResult:
    """The record of a child that handed none back: the one it wrote if it died right after
    writing it, else one written here from how it ended."""
    if _file_id(out_dir) != before:
        try:
            return read_record(out_dir)
        except RecordError:
            pass  # not a record it finished writing: describe the death instead
    if exc is not None:
        status, error = "interrupted", describe_stop(exc) + "; the job's process left no record"
    else:
        status, error = death_status(exitcode, oom_before, oom_kills())
    result = RunResult(status=status, config=asdict(job), overrides=list(overrides or []),
                       error=error, started_at=started, finished_at=utc_now(),
                       env={"hostname": socket.gethostname()})
    save(result, out_dir)
    return result


def death_status(exitcode: Optional[int], oom_before: Optional[int], oom_after: Optional[int]) -> Tuple[str, str]:
    """(status, error) of a job process that ended with ``exitcode`` (negative: killed by
    that signal, as multiprocessing reports it) without handing back a record; the OOM-kill
    counts from before and after the job tell an OOM kill from any other SIGKILL."""
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
    """How many processes the kernel's OOM killer has killed since boot, in any cgroup
    (``oom_kill`` in /proc/vmstat, Linux >= 4.13); None where that cannot be read."""
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
