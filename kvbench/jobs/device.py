"""``runtime.device``: which device a job runs on, one GPU per concurrent job on a multi-GPU node.

Hydra's launchers schedule; this answers what a job asks when it starts: which device is mine?
``cuda:free`` is the first GPU of this host no other kvbench process holds: an ``flock`` per GPU
UUID, held for the process's life and released by the kernel when it exits, even on SIGKILL.
With ``runtime.isolate=true`` that process is the job's own; with ``false`` a joblib worker runs
many jobs and keeps one GPU.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

from kvbench.core.errors import ConfigError

FREE_GPU = "cuda:free"

_held: Dict[str, Any] = {}  # lock dir -> (index, open lock file) held by this process


def default_lock_dir() -> Path:
    """Per host and per user: GPUs are a node's resource, and another user's jobs are SLURM's."""
    return Path(tempfile.gettempdir()) / f"kvbench-gpu-locks-{os.getuid()}"


def hold_free_gpu(keys: Sequence[str], lock_dir: Path | str | None = None) -> int:
    """Index into ``keys`` (a stable id per visible GPU) of the GPU this process holds, taking the
    first free one on the first call."""
    lock_dir = Path(lock_dir) if lock_dir is not None else default_lock_dir()
    held = _held.get(str(lock_dir))
    if held is not None:
        return held[0]
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index, key in enumerate(keys):
        handle = open(lock_dir / f"gpu-{_safe_name(key)}.lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"{socket.gethostname()} pid {os.getpid()}\n")  # who holds it, for people
        handle.flush()
        _held[str(lock_dir)] = (index, handle)
        return index
    raise ConfigError(
        f"runtime.device={FREE_GPU!r}: all {len(keys)} GPUs of {socket.gethostname()} are held by other "
        f"kvbench processes (locks in {lock_dir}); run at most {len(keys)} jobs at once, "
        f"e.g. hydra.launcher.n_jobs={len(keys)}")


def _safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


def free_gpu():
    """``torch.device`` of a GPU this process holds (see :func:`hold_free_gpu`), keyed by UUID
    so that processes with different ``CUDA_VISIBLE_DEVICES`` still agree on a physical GPU."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"runtime.device={FREE_GPU!r}: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    keys: List[str] = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    return torch.device("cuda", hold_free_gpu(keys))


def resolve_device(name: str):
    """``runtime.device`` as a torch device: ``auto`` picks CUDA when present, ``cuda:free`` a GPU
    no other job of this node holds; CUDA asked for where there is none is a ConfigError."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda:free":  # one GPU per concurrent job on a multi-GPU node
        return free_gpu()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device={name!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(f"runtime.device={name!r}: this machine has {count} CUDA device(s) "
                          f"(cuda:0 .. cuda:{count - 1})")
    return device
