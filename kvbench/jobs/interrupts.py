"""How a job notices that it is being stopped from outside, so that it can record it.

Python turns SIGINT into KeyboardInterrupt but lets SIGTERM and SIGHUP (a closed terminal) end
the process on the spot, with no chance to write a record. :func:`interruptible` turns all three
into :class:`Interrupted` for a block (unless a launcher already handles the signal) and protects
the writing of the record from a second signal; :func:`stop_like_ctrl_c` does the same for the
whole process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Dict, List, Optional

# What ends a job from outside: Ctrl-C (SIGINT), SIGTERM (kill, timeout(1), SLURM, the submitit
# local executor) and SIGHUP (the terminal was closed: the kernel signals its foreground group).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Why a signal was sent, when this process sent it to itself (a watchdog), by signal number.
stop_reasons: Dict[int, str] = {}


class Interrupted(KeyboardInterrupt):
    """A job stopped by a signal: a KeyboardInterrupt, so that whatever lets Ctrl-C through lets a
    SIGTERM through too."""

    def __init__(self, signum: int, reason: str = ""):
        self.signum = signum
        super().__init__(reason or f"interrupted by {signal.Signals(signum).name}")

    def __reduce__(self):  # launchers pickle a job's exception (submitit does)
        return type(self), (self.signum, str(self)), self.__dict__


class Stops:
    """The signal handler :func:`interruptible` installs, and its state."""

    def __init__(self, once: bool):
        self.once = once
        self.fired: List[int] = []
        self.holding = False
        self.held: Optional[int] = None  # a signal that arrived while held

    def hold(self) -> None:
        """From now on a signal is kept in ``held`` instead of raised (the record is being written)."""
        self.holding = True

    def __call__(self, signum: int, frame) -> None:
        if signum == signal.SIGHUP:
            release_hung_up_terminal()
        if self.holding:
            self.held = self.held or signum
            return
        if self.once and self.fired:
            return
        self.fired.append(signum)
        raise Interrupted(signum, stop_reasons.pop(signum, "") or slurm_reason(signum))


def raise_stop(signum: int, frame) -> None:
    """kvbench's process-wide handler of SIGTERM and SIGHUP."""
    if signum == signal.SIGHUP:
        release_hung_up_terminal()
    raise Interrupted(signum, stop_reasons.pop(signum, "") or slurm_reason(signum))


def stop_like_ctrl_c() -> None:
    """From now on SIGTERM and SIGHUP raise :class:`Interrupted`, as Ctrl-C raises KeyboardInterrupt:
    one line and 128 + the signal instead of a silent death. A signal someone else handles or
    ignores (``nohup``) is left as it is."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, raise_stop)


def ours(handler) -> bool:
    """``handler`` is Python's default or kvbench's own, so kvbench may replace it for a block."""
    return (handler in (signal.SIG_DFL, signal.default_int_handler, raise_stop) or isinstance(handler, Stops)
            or bypassed(handler))


def exit_on_stop(code: Optional[int] = None, line: str = "") -> None:
    """This process is exiting: from now on a stop signal ends it at once with ``code`` (128 + that
    signal when None), after ``line`` on stderr, instead of raising inside an exit hook (torch's and
    W&B's finalizers would print a traceback)."""
    def now(signum: int, frame) -> None:
        try:
            if line:
                sys.stderr.write(line.format(signal=signal.Signals(signum).name) + "\n")
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # a closed terminal: nothing to say it on
        os._exit(code if code is not None else 128 + signum)

    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, now)


def release_hung_up_terminal() -> None:
    """After SIGHUP: put /dev/null in place of a standard stream whose terminal has hung up, so that
    what the process still prints cannot fail with EIO and cost the record. Such a terminal is no
    longer a tty and polls as POLLHUP | POLLERR."""
    for fd in (0, 1, 2):
        try:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0)):
                continue
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd)
            os.close(null)
        except OSError:
            continue


def bypassed(handler) -> bool:
    """``handler`` is submitit's ``bypass`` of SIGTERM, which only logs the signal. On SLURM a SIGTERM
    is the scheduler ending the job, with SIGKILL ``KillWait`` seconds later: left bypassed, the job
    would be killed without a record, so kvbench takes it."""
    owner = getattr(handler, "__self__", None)
    return getattr(handler, "__name__", "") == "bypass" and type(owner).__module__.startswith("submitit")


def launcher_stop(exc: BaseException) -> bool:
    """``exc`` is a launcher ending the job rather than the job failing: submitit raises
    UncompletedJobError on SLURM's SIGUSR2 when it will not requeue the job."""
    return type(exc).__name__ == "UncompletedJobError" and type(exc).__module__.startswith("submitit")


# What sacct's State of a job that SLURM is ending means, for an interrupted record.
SLURM_ENDS = {"TIMEOUT": "past its time limit (--time)", "CANCELLED": "cancelled (scancel)",
              "REQUEUED": "requeued (scontrol requeue, or preempted)", "PREEMPTED": "preempted"}


def slurm_reason(signum: int) -> str:
    """Why SLURM sent SIGTERM to this job, from ``sacct``; bounded to 2 s: SIGKILL follows after
    ``KillWait``."""
    job = os.environ.get("SLURM_JOB_ID")
    if signum != signal.SIGTERM or not job:
        return ""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    name = f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{task}" if task else job
    try:
        state = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True,
                               text=True, timeout=2).stdout.split()
    except (OSError, subprocess.SubprocessError):
        state = []
    why = SLURM_ENDS.get(state[0] if state else "", "being ended (its time limit, scancel, a requeue or preemption)")
    return f"interrupted by SIGTERM from SLURM: job {name} is {why}"


@contextmanager
def interruptible(signals=STOP_SIGNALS, once: bool = True):
    """Within the block each of ``signals`` raises :class:`Interrupted` in the main thread; yields the
    :class:`Stops` handler. A signal someone else handles is left to them. With ``once``, later
    signals are ignored, so that a second Ctrl-C cannot cut short the writing of the first's record."""
    stops = Stops(once)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            if ours(signal.getsignal(signum)):
                previous[signum] = signal.signal(signum, stops)
    try:
        yield stops
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def describe_stop(exc: BaseException) -> str:
    """The ``error`` text of an interrupted record."""
    if isinstance(exc, Interrupted):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by SIGINT"
    if launcher_stop(exc):
        return (f"stopped by submitit: {exc} (SLURM's SIGUSR2 before the time limit; a timed-out job is "
                "requeued only hydra.launcher.max_num_timeout times)")
    if isinstance(exc, SystemExit):
        return (f"stopped by SystemExit({exc.code!r}): the process was told to exit (a launcher "
                "does this on preemption or timeout, after requeueing the job)")
    return f"stopped by {type(exc).__name__}: {exc}"


def stop_error(exc: BaseException, metrics: Dict) -> str:
    """The ``error`` text of an interrupted record whose task may have kept what it measured: a task
    that keeps the figures of its complete rounds says so (``partial_reason``), and so does the line."""
    reason = metrics.get("partial_reason") if metrics.get("partial") is True else None
    return describe_stop(exc) + (f"; partial: {reason}" if isinstance(reason, str) else "")

