"""The console scripts' first module: it imports nothing heavy, so that a stop signal while Python
imports torch, Hydra and the rest (seconds) is one line and exit 128 + the signal, not a traceback.
"""

import atexit
import os
import signal
import sys

from kvbench.jobs.interrupts import STOP_SIGNALS, exit_on_stop, stop_like_ctrl_c


def _interrupted(exc: KeyboardInterrupt, what: str) -> None:
    code = 128 + getattr(exc, "signum", signal.SIGINT)
    exit_on_stop(code)  # a second signal while Python tears down: no traceback from an exit hook
    print(f"kvbench: interrupted by {signal.Signals(code - 128).name} while {what}", file=sys.stderr)
    sys.exit(code)


def main() -> None:
    """Console script ``kvbench``."""
    stop_like_ctrl_c()
    # Registered first, so it runs last of the exit hooks: after it nothing is left to say, and a
    # signal in the interpreter's own teardown would kill the process without a word (Python puts
    # back the default handlers there); it is ignored instead, and the exit status is the run's.
    atexit.register(_ignore_stop_signals)
    try:
        if sys.argv[1:] in (["--help"], ["-h"]):
            sys.exit(_help())
        from kvbench import cli
    except KeyboardInterrupt as exc:
        _interrupted(exc, "starting (nothing was run)")
    cli.main()


def _help() -> int:
    """``kvbench --help`` without composing the config; with overrides or other flags Hydra prints it."""
    from kvbench.cli_help import render

    try:
        print(render())
        sys.stdout.flush()
    except BrokenPipeError:  # `kvbench --help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    return 0


def report_main() -> None:
    """Console script ``kvbench-report``."""
    stop_like_ctrl_c()
    try:
        from kvbench import cli_tools
    except KeyboardInterrupt as exc:
        _interrupted(exc, "starting (nothing was written)")
    sys.exit(cli_tools.report_main())


def dashboard_main() -> None:
    """Console script ``kvbench-dashboard``."""
    stop_like_ctrl_c()
    try:
        from kvbench import cli_tools
    except KeyboardInterrupt as exc:
        _interrupted(exc, "starting (nothing was written)")
    code = cli_tools.dashboard_main()
    # W&B's client keeps threads and its service process busy with a server that does not answer
    # (tens of seconds after the answer is printed); the spec is on disk, so nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def child_main() -> None:
    """A job's process (kvbench.jobs.isolation): interrupted while importing, it exits 130 without a
    word, and its parent records the job ``interrupted``."""
    try:
        # What runs the job (torch, the tasks) is imported here, under this guard, as well:
        # kvbench.jobs.isolation, the parent's side too, does not import it.
        from kvbench.jobs import runner  # noqa: F401
        from kvbench.jobs.isolation import child_main as measure_here
    except KeyboardInterrupt:
        _quiet_exit(128 + signal.SIGINT)
    measure_here()


def _ignore_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _quiet_exit(code: int) -> None:
    # The parent passes its own stop on to this process as well: a second signal must not
    # interrupt the interpreter's exit (torch's finalizers) with a traceback.
    _ignore_stop_signals()
    sys.exit(code)


def forkserver_main() -> None:
    """The fork server's process: it ignores the signals a terminal sends its whole group (it owns no
    job); a child interrupted before its job has taken over the signals exits 130 without a word."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    import json

    from kvbench.jobs.forkserver import serve

    job = serve(int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:])
    if job is None:  # the process that used this server has ended
        os._exit(0)
    try:
        code = job()
    except KeyboardInterrupt:
        _quiet_exit(128 + signal.SIGINT)
    # The job is over and its record handed back. The exit hooks run (a pool the job started is
    # shut down), the interpreter is not torn down: its module-by-module teardown of a process
    # holding torch takes a second a job, copying on write the pages it shares with the server.
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
