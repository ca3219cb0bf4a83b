"""Scale-out helpers: resuming a sweep, and one GPU per concurrent job on a multi-GPU node.

Scheduling itself is Hydra's launchers' job (submitit for SLURM, joblib for one node); this
module only answers two questions a job asks itself when it starts:

- has this exact job already finished (an ok ``results.json`` for the same config in its
  directory)? Then a re-run of the sweep skips it. ``results.json`` is written atomically, so a
  job killed part-way leaves no record (or the previous complete one), never a torn one.
- which GPU is mine (``runtime.device=cuda:free``)? The first GPU of this host that no other
  kvbench process holds. The hold is an ``flock`` on a lock file per GPU UUID, kept for the
  life of the process and released by the kernel when the process exits, even on SIGKILL.
  A joblib worker runs many jobs in one process, so each worker keeps one GPU.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig

from kvbench.config import ConfigError
from kvbench.results import RESULTS_FILE

FREE_GPU = "cuda:free"
# Keys of BenchConfig that say how a job is scheduled or recorded, not what it measures.
_NOT_IDENTITY = ("rerun", "wandb")

_held: Dict[str, Any] = {}  # lock dir -> (index, open lock file) held by this process


def completed_record(out_dir: Path | str, cfg: DictConfig) -> Optional[Dict[str, Any]]:
    """The record in ``out_dir`` if it is ``ok`` and was produced by the same config, else None.

    A missing, unreadable or non-ok record, or one for a different config (the sweep's override
    list changed, so this job number now means another job), means the job must run."""
    path = Path(out_dir) / RESULTS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "ok":
        return None
    from kvbench.runner import to_bench_config

    try:
        bench = to_bench_config(cfg)
    except ConfigError:
        return None
    return record if _identity(record.get("config")) == _identity(asdict(bench)) else None


def _identity(config: Any) -> Any:
    # Compare as results.json stores it (JSON types), without the keys that do not change a job.
    if not isinstance(config, dict):
        return None
    plain = json.loads(json.dumps(config, default=str))
    return {k: v for k, v in plain.items() if k not in _NOT_IDENTITY}


def default_lock_dir() -> Path:
    """Per host and per user: GPUs are a node's resource, and another user's jobs are SLURM's."""
    return Path(tempfile.gettempdir()) / f"kvbench-gpu-locks-{os.getuid()}"


def hold_free_gpu(keys: Sequence[str], lock_dir: Path | str | None = None) -> int:
    """Index into ``keys`` (one stable id per visible GPU) of a GPU this process now holds.

    The first call takes the first key whose lock no other process holds; later calls in the
    same process return the same index. Raises :class:`ConfigError` when every GPU is held."""
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
    return device
