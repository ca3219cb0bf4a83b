"""How a job notices that it is being stopped from outside, so that it can record it.

Python turns SIGINT into KeyboardInterrupt but lets SIGTERM end the process on the spot, with
no chance to write a record. :func:`interruptible` turns both into :class:`Interrupted` for the
length of a block, unless a launcher already handles the signal (submitit's SIGUSR2 requeues),
and protects the writing of the record from a second signal. Under SLURM the reason names what
the scheduler did (:func:`slurm_reason`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Dict, List, Optional

# What ends a job from outside: Ctrl-C (SIGINT) and SIGTERM (kill, timeout(1), SLURM, the
# submitit local executor).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Why a signal was sent, when this process sent it to itself (a watchdog), by signal number.
stop_reasons: Dict[int, str] = {}


class Interrupted(KeyboardInterrupt):
    """A job stopped by a signal. A KeyboardInterrupt, so that whatever lets Ctrl-C through
    lets a SIGTERM through too; ``signum`` says which, and the exit status is 128 + signum."""

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
        if self.holding:
            self.held = self.held or signum
            return
        if self.once and self.fired:
            return
        self.fired.append(signum)
        raise Interrupted(signum, stop_reasons.pop(signum, "") or slurm_reason(signum))


def bypassed(handler) -> bool:
    """``handler`` is submitit's ``bypass``, which it installs for SIGTERM in every job and which
    only logs the signal (it expects SIGUSR2 to come with it). On SLURM a job's SIGTERM is the
    scheduler ending it (time limit, scancel, requeue, preemption) with SIGKILL ``KillWait``
    seconds later: left bypassed, the job would be killed without a record, so kvbench takes it."""
    owner = getattr(handler, "__self__", None)
    return getattr(handler, "__name__", "") == "bypass" and type(owner).__module__.startswith("submitit")


def launcher_stop(exc: BaseException) -> bool:
    """``exc`` is a launcher ending the job rather than the job failing: submitit's handler of
    SIGUSR2 (SLURM's warning before ``--time``) raises UncompletedJobError, in whatever the job
    is doing, when it will not requeue the job (``max_num_timeout`` timeouts used up)."""
    return type(exc).__name__ == "UncompletedJobError" and type(exc).__module__.startswith("submitit")


# What sacct's State of a job that SLURM is ending means, for an interrupted record.
SLURM_ENDS = {"TIMEOUT": "past its time limit (--time)", "CANCELLED": "cancelled (scancel)",
              "REQUEUED": "requeued (scontrol requeue, or preempted)", "PREEMPTED": "preempted"}


def slurm_reason(signum: int) -> str:
    """Why SLURM sent SIGTERM to this job, from its accounting (``sacct``): "" outside a SLURM
    job or for another signal. Bounded to 2 s: SIGKILL follows SIGTERM after ``KillWait``."""
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
    """Within the block each of ``signals`` raises :class:`Interrupted` in the main thread;
    yields the :class:`Stops` handler.

    A signal whose handler someone else installed (submitit requeues on SIGUSR2) is left to
    them, except submitit's bypass of SIGTERM (:func:`bypassed`). With ``once``, only the first
    signal raises and later ones are ignored, so that a second Ctrl-C cannot cut short the
    writing of the first one's record. Outside the main thread (where Python cannot install
    handlers) nothing is installed."""
    stops = Stops(once)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            handler = signal.getsignal(signum)
            if handler in (signal.SIG_DFL, signal.default_int_handler) or bypassed(handler):
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
