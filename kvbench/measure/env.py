"""The environment a run was measured in, recorded beside its metrics in results.json.

Every probe is best-effort: a value that cannot be read is None, so recording the
environment never costs a run.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from kvbench.measure.memory import nvml_driver_version
from kvbench.metrics import Metric, metric_table, record_methods

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../kvbench
_GIT_TIMEOUT_S = 2.0


def _safe(probe: Callable[[], Any]) -> Any:
    try:
        return probe()
    except Exception:  # noqa: BLE001 — a probe that fails records None; the environment never costs a run
        return None


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None  # often empty, and on Linux only the architecture


def _device_name(device: torch.device) -> Optional[str]:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model()


def _git(*args: str) -> Optional[str]:
    out = subprocess.run(["git", "-C", str(_PACKAGE_DIR), *args], capture_output=True,
                         text=True, timeout=_GIT_TIMEOUT_S)
    return out.stdout.strip() if out.returncode == 0 else None


def _git_state() -> tuple[Optional[str], Optional[bool]]:
    """(commit, dirty) of the checkout kvbench runs from; (None, None) for an installed copy."""
    # A site-packages copy can sit inside some unrelated repository (a .venv in a project);
    # only trust HEAD if that repository actually tracks this package.
    if _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None, None
    commit = _git("rev-parse", "HEAD")
    # Untracked files are ignored: run outputs land in the tree without changing the code.
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def _kvbench_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvbench")
    except PackageNotFoundError:
        return None


def collect_env(device: torch.device | str = "cpu") -> Dict[str, Any]:
    """Software, hardware and source versions as a flat JSON-able dict; never raises."""
    device = torch.device(device)
    commit, dirty = _safe(_git_state) or (None, None)
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        # a plain str: torch's TorchVersion would make whoever unpickles the record import torch
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cudnn": _safe(lambda: torch.backends.cudnn.version()),
        "device_type": device.type,
        "device_name": _safe(lambda: _device_name(device)),
        "gpu_driver_version": nvml_driver_version(),
        "torch_num_threads": _safe(torch.get_num_threads),
        "cpu_count": os.cpu_count(),
        "hostname": _safe(socket.gethostname),
        "platform": _safe(platform.platform),
        "kvbench_version": _safe(_kvbench_version),
        "git_commit": commit,
        "git_dirty": dirty,
    }


# How busy the machine was around a job (recorded in metrics; tables show the flag).
LOAD_METRICS: Dict[str, Metric] = metric_table(
    Metric("load_avg_before", "runnable tasks", "1-minute load average (os.getloadavg) when the job started measuring"),
    Metric("load_avg_after", "runnable tasks", "1-minute load average when the job finished measuring"),
    Metric("usable_cpus", "count", "CPUs this process may run on (os.sched_getaffinity)"),
    Metric("noisy", "bool", "true when the machine had more runnable work than CPUs around the job: "
           "max(load_avg_before, load_avg_after) > usable_cpus + 0.5 (the job's own threads count in the load); "
           "timings of a noisy job are unreliable"),
    Metric("noisy_reason", "text", "why noisy is true (null when it is false or unknown)"),
)
LOAD_METHODS: Dict[str, str] = record_methods(LOAD_METRICS)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def noisy(before: Optional[float], after: Optional[float], cpus: int) -> Tuple[Optional[bool], Optional[str]]:
    """Whether the machine was oversubscribed around a job, and why (see :data:`LOAD_METHODS`)."""
    loads = [x for x in (before, after) if x is not None]
    if not loads:
        return None, None
    worst = max(loads)
    if worst > cpus + 0.5:
        return True, (f"load average {worst:.2f} on {cpus} usable CPUs: other work competed for the cores "
                      "(timings are unreliable; rerun on an idle machine)")
    return False, None
