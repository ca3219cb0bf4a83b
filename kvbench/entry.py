"""The console scripts' first module: it imports nothing heavy, so that Ctrl-C while Python
imports torch, Hydra and the rest (seconds) is one line and exit 130, not a traceback. The
scripts themselves are in :mod:`kvbench.cli` and :mod:`kvbench.cli_tools`; a job's own process
starts through :func:`child_main`.
"""

import os
import signal
import sys


def _interrupted(what: str) -> None:
    print(f"kvbench: interrupted by SIGINT while {what}", file=sys.stderr)
    sys.exit(128 + signal.SIGINT)


def main() -> None:
    """Console script ``kvbench``."""
    try:
        from kvbench import cli
    except KeyboardInterrupt:
        _interrupted("starting (nothing was run)")
    cli.main()


def report_main() -> None:
    """Console script ``kvbench-report``."""
    try:
        from kvbench import cli_tools
    except KeyboardInterrupt:
        _interrupted("starting (nothing was written)")
    sys.exit(cli_tools.report_main())


def dashboard_main() -> None:
    """Console script ``kvbench-dashboard``."""
    try:
        from kvbench import cli_tools
    except KeyboardInterrupt:
        _interrupted("starting (nothing was written)")
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
        sys.exit(128 + signal.SIGINT)
    measure_here()
