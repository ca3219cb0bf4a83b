"""`kvbench` commands run in processes forked from one interpreter that has imported kvbench.

One interpreter for many `kvbench` commands (config errors, --help, task=inspect, short runs and
sweeps): it imports kvbench.cli once (Hydra) and what those commands import when they get to it
(torch, for task=inspect and for a job recorded invalid in kvbench's own process; wandb, for a
job's tracking: ~4.5 s of CPU a process in all), then forks a child per command that runs
`python -m kvbench.cli ARGS` from there, with its own cwd, environment, stdout, stderr and exit
status, so what a test reads is what a fresh process of that command printed and returned. For
commands whose claim is their output and exit code, not the start of a fresh interpreter
(tests/test_parent_imports.py checks what kvbench.cli imports).

The interpreter stays for the pytest process (one per xdist worker) and serves every test's
commands: it only imports and forks, so each command starts from the same state as the first one
did. It is kept per environment (a test that sets a variable gets an interpreter started with it,
as a fresh process would see it at its imports), less PYTEST_CURRENT_TEST, which pytest sets for
each test: a command gets the caller's as it is at the call.
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The interpreter's loop: a command a line on stdin, its exit status a line on stdout.
_DRIVER = r"""
import json, os, sys, traceback
import kvbench.cli
import kvbench.jobs.runner, kvbench.tasks.inspect
import wandb  # a job's tracking imports it, even with W&B disabled (~1 s of CPU a command)
for request in sys.stdin:
    argv, cwd, env, out, err = json.loads(request)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the command's process: exits with its code, never back into this loop
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)  # pytest's PYTEST_CURRENT_TEST is the test's, not the first one's
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # as a command run with no input, not this pipe
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [kvbench.cli.__file__, *argv]
        try:
            kvbench.cli.main()
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""

_drivers: dict = {}  # environment (sorted items) -> the interpreter's Popen
_lock = threading.Lock()
# Set (by conftest) to the line a test not marked e2e fails with: once started, the interpreter
# serves a command without a Popen, which is where conftest stops a unit test starting one.
REFUSE = ""


def _key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))


def _driver(env: dict) -> subprocess.Popen:
    key = _key(env)
    proc = _drivers.get(key)
    if proc is None or proc.poll() is not None:
        # its own session: a command that outlives a timeout is killed with it (_close)
        proc = subprocess.Popen([sys.executable, "-c", _DRIVER], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        _drivers[key] = proc
    return proc


def _close(proc: subprocess.Popen, kill: bool = False) -> None:
    if kill and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.stdin.close()  # the loop ends at the end of its input
    except OSError:
        pass
    proc.wait()


@atexit.register
def _close_all():
    while _drivers:
        _close(_drivers.popitem()[1])


def _read_line(proc: subprocess.Popen, into: list) -> None:
    into.append(proc.stdout.readline())


def kvbench_forked(commands, timeout: float = 300):
    """``commands``: (argv, cwd) pairs; a CompletedProcess each, as ``python -m kvbench.cli argv``
    run in ``cwd`` would give (WANDB_MODE=disabled, HYDRA_FULL_ERROR=0), run one after another;
    ``timeout``: seconds for them all."""
    import time

    if REFUSE:
        raise AssertionError(REFUSE)
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    deadline = time.monotonic() + timeout
    done = []
    with _lock, tempfile.TemporaryDirectory() as tmp:
        proc = _driver(env)
        for i, (argv, cwd) in enumerate(commands):
            out, err = f"{tmp}/{i}.out", f"{tmp}/{i}.err"
            reply: list = []
            reader = threading.Thread(target=_read_line, args=(proc, reply), daemon=True)
            try:
                proc.stdin.write(json.dumps([list(argv), str(cwd), env, out, err]) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it ended: its exit status says why, below
            reader.start()
            reader.join(max(deadline - time.monotonic(), 0))
            code = reply[0].strip() if reply else ""
            if not code.lstrip("-").isdigit():
                status = "still running" if reader.is_alive() else f"ended with {proc.poll()}"
                _close(_drivers.pop(_key(env)), kill=True)
                raise AssertionError(f"kvbench {argv}: no exit status within {timeout} s from the forking "
                                     f"interpreter ({status})")
            done.append(subprocess.CompletedProcess(["kvbench", *argv], int(code), Path(out).read_text(),
                                                    Path(err).read_text()))
    return done
