"""How a job notices that it is being stopped from outside, so that it can record it.

Python turns SIGINT into KeyboardInterrupt but lets SIGTERM end the process on the spot, with
no chance to write a record. :func:`interruptible` turns both into :class:`Interrupted` for the
length of a block, unless a launcher already handles the signal (submitit does), and protects
the writing of the record from a second signal.
"""

from __future__ import annotations

import signal
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
        raise Interrupted(signum, stop_reasons.pop(signum, ""))


@contextmanager
def interruptible(signals=STOP_SIGNALS, once: bool = True):
    """Within the block each of ``signals`` raises :class:`Interrupted` in the main thread;
    yields the :class:`Stops` handler.

    A signal whose handler someone else installed (submitit bypasses SIGTERM and requeues on
    SIGUSR2) is left to them. With ``once``, only the first signal raises and later ones are
    ignored, so that a second Ctrl-C cannot cut short the writing of the first one's record.
    Outside the main thread (where Python cannot install handlers) nothing is installed."""
    stops = Stops(once)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
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
    if isinstance(exc, SystemExit):
        return (f"stopped by SystemExit({exc.code!r}): the process was told to exit (a launcher "
                "does this on preemption or timeout, after requeueing the job)")
    return f"stopped by {type(exc).__name__}: {exc}"
