"""A job directory's state besides its record: who is running it now (the claim) and whether it
is done already (resume).

The claim is an ``flock``, so that two kvbench processes never measure one job at the same time;
the kernel drops it when the holder exits in any way (even SIGKILL), so it never goes stale.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from kvbench.results import RecordError, RunResult, distrust, read_record, record_config

CLAIM_FILE = ".kvbench-claim"
SWEEP_LOCK = ".kvbench-sweep"  # in a sweep's directory: held while a sweep decides the directory is its
# Keys of a job's config that say how it is scheduled or recorded, not what it measures.
NOT_IDENTITY = ("rerun", "wandb", "objective", "objective_caps")


class JobClaim:
    """This process is running the job in ``directory``: an exclusive ``flock`` on its claim file,
    which names the host, pid and start."""

    def __init__(self, directory: Path, handle: Any):
        self.directory, self._handle = directory, handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the last descriptor drops the flock
            self._handle = None

    def __enter__(self) -> "JobClaim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim_job(directory: Path | str) -> Optional[JobClaim]:
    """Claim the job in ``directory`` for this process; None when another process holds it
    (another kvbench, or a job process a killed sweep left running)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle = _open_claim(directory / CLAIM_FILE)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    since = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{socket.gethostname()} pid {os.getpid()} since {since}\n")
        handle.flush()
    except OSError as exc:  # a full disk: the descriptor's file has no name of its own
        try:
            handle.close()  # flushes what the disk refused once more, and fails again
        except OSError:
            pass
        exc.filename = str(directory / CLAIM_FILE)
        raise
    return JobClaim(directory, handle)


@contextmanager
def sweep_lock(directory: Path | str) -> Iterator[None]:
    """An exclusive, waited-for ``flock`` on ``directory``'s :data:`SWEEP_LOCK`, held for the
    milliseconds a sweep takes to decide the directory is its own. Where the file cannot be made
    nothing is held (whatever writes there next fails, naming the path)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = _open_claim(directory / SWEEP_LOCK)
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()


def _open_claim(path: Path):
    """The claim file, opened without truncating it (that would erase the holder's name) and never
    through a link: a symlink planted at its name is removed, so the claim never truncates its target."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        path.unlink()  # a link in the job's own directory: the link goes, its target is untouched
        fd = os.open(path, flags, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "r+")


def claim_holder(directory: Path | str) -> Optional[str]:
    """Who holds the claim on ``directory`` (``"host pid N since T"``), or None when nobody does."""
    path = Path(directory) / CLAIM_FILE
    try:  # never through a link, never blocking on a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        handle = os.fdopen(fd)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read(200).strip() or "another process"
        except OSError:
            return None
        return None  # closing the file drops the shared lock just taken


def completed_record(out_dir: Path | str, config: Dict[str, Any],
                     overrides: Optional[Iterable[str]] = None) -> Optional[RunResult]:
    """The record in ``out_dir`` if it is ``ok``, trusted and of the same ``config`` (and, given,
    the same ``overrides``), else None: resume's "is this job done?" (:func:`resume_check`)."""
    return resume_check(out_dir, config, overrides)[0]


def resume_check(out_dir: Path | str, config: Dict[str, Any],
                 overrides: Optional[Iterable[str]] = None) -> Tuple[Optional[RunResult], Optional[str]]:
    """(the record, None) when the job in ``out_dir`` is done; else (None, why an ``ok`` record there
    does not count, or None when there is none). A job has one identity: its config, and its
    overrides as the sweep's table matches them (a record the table would list as missing is not
    skipped as done). A changed override list makes a job number mean another job."""
    try:
        record = read_record(out_dir)
    except RecordError:
        return None, None
    if record.status != "ok":
        return None, None
    why = distrust(record)
    if why is None and _identity(record.config) != _identity(config):
        why = "its config is not this job's"
    if why is None and overrides is not None and job_overrides(record.overrides) != job_overrides(overrides):
        why = (f"its overrides ({' '.join(job_overrides(record.overrides) or []) or 'none'}) are not this job's "
               f"({' '.join(job_overrides(overrides) or []) or 'none'})")
    return (record, None) if why is None else (None, why)


# Overrides that change how a job is scheduled or recorded, not what it measures (the config keys
# of NOT_IDENTITY, and the launcher): a resume may add them without making other jobs.
NOT_JOB = (*(f"{key}{sep}" for key in NOT_IDENTITY for sep in "=."), "hydra/launcher=", "hydra.launcher.")


def job_overrides(overrides: Any) -> Optional[List[str]]:
    """The overrides that say which job this is; None for anything but a sequence of them (a
    record or an overrides.yaml may hold anything)."""
    if isinstance(overrides, (str, bytes, Mapping)) or not isinstance(overrides, Iterable):
        return None
    return [str(o) for o in overrides if not str(o).startswith(NOT_JOB)]


def _identity(config: Any) -> Any:
    # Compare as results.json stores it (JSON types), only the keys the job's task reads (so an
    # older record holding others compares the same), without the keys that do not change a job.
    if not isinstance(config, dict):
        return None
    plain = json.loads(json.dumps(record_config(config), default=str))
    return {k: v for k, v in plain.items() if k not in NOT_IDENTITY}

