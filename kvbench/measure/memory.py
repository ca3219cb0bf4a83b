"""Memory and energy of a run: model weights, host RSS, the torch allocator, and NVML.

Three views of GPU memory disagree by design, so all are recorded: the torch allocator's peak
(tensors only, this process), NVML's per-process figure (everything this process holds,
including the CUDA context), and NVML's device-wide figure (every process on the GPU). Units
and methods of every field are in ``MEMORY_METHODS``; nothing here raises when a source is
missing: the field is None and a ``*_reason`` field says why.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from kvbench.measure.host import CLEAR_REFS, release_heap, rss_status
from kvbench.metrics import Metric, metric_table, record_methods

MEMORY_METRICS: Dict[str, Metric] = metric_table(
    Metric("peak_rss_bytes", "bytes", "Linux: VmHWM of /proc/self/status, the peak resident set of the job's "
                                      "process since it started: forked by the fork server (VmHWM reset at the fork "
                                      "through /proc/self/clear_refs; the server's pages the job maps count, its "
                                      "import-time peak does not) or exec'd (not getrusage's ru_maxrss, which a "
                                      "process inherits from its parent); elsewhere ru_maxrss / psutil's peak; in one "
                                      "process with earlier jobs: null, and peak_rss_reason says so"),
    Metric("torch_peak_allocated_bytes", "bytes", "torch.cuda.max_memory_allocated after "
                                  "reset_peak_memory_stats at enter (tensors of this process)"),
    Metric("torch_peak_reserved_bytes", "bytes", "torch.cuda.max_memory_reserved, over the same span "
                                 "(allocator cache included)"),
    Metric("nvml_device_used_bytes", "bytes", "nvmlDeviceGetMemoryInfo(...).used at exit, all processes "
                              "on the device (v2 API excludes driver-reserved memory, v1 includes it)"),
    Metric("nvml_peak_used_bytes", "bytes", "max of nvml_device_used_bytes sampled at enter, every "
                            "interval_ms by a background thread, and at exit"),
    Metric("nvml_samples", "count", "NVML memory samples behind nvml_peak_used_bytes"),
    Metric("nvml_memory_api", "text", "'v2' or 'v1': which nvmlDeviceGetMemoryInfo version answered"),
    Metric("nvml_process_used_bytes", "bytes", "usedGpuMemory of os.getpid() in "
                               "nvmlDeviceGetComputeRunningProcesses at exit (context included)"),
    Metric("energy_mj", "mJ", "delta of nvmlDeviceGetTotalEnergyConsumption between enter and exit "
                 "(whole device; the counter updates coarsely, so short regions read low)"),
    Metric("energy_span_s", "s", "perf_counter time between the two energy counter reads behind energy_mj "
                                   "(the span energy_mj is the energy of)"),
    Metric("power_limit_w", "W", "nvmlDeviceGetEnforcedPowerLimit: the most the board may draw (the bound "
                                 "energy_mj / energy_span_s is checked against)"),
    Metric("nvml_driver_version", "text", "nvmlSystemGetDriverVersion"),
    Metric("nvml_device_uuid", "text", "NVML UUID the torch device was matched to (by UUID, not index)"),
    Metric("nvml_reason", "text", "why the nvml_* fields are null (no GPU, no NVML, a failed read); null when read"),
    Metric("nvml_process_reason", "text", "why nvml_process_used_bytes is null (the driver does not list this "
                           "process, or NVML is unavailable); null when read"),
    Metric("energy_reason", "text", "why energy_mj (and energy_mj_per_token) is null: no energy counter, or it did not "
                     "advance over the timed trials; null when measured"),
)
MEMORY_METHODS: Dict[str, str] = record_methods(MEMORY_METRICS)

# What allocating one object (the KV cache) cost, seen by torch and by the driver.
ALLOCATION_METRICS: Dict[str, Metric] = metric_table(
    Metric("kv_cache_bytes_torch", "bytes", "CUDA only: torch.cuda.memory_allocated after the cache was created minus "
                            "before (this process's tensors; the caching allocator rounds each block up)"),
    Metric("kv_cache_bytes_nvml", "bytes",
           "CUDA only: NVML device memory used after the cache was created minus before, "
                           "torch's unused cached blocks released first (whole device: new allocator segments, "
                           "2 MiB granular; other processes' activity in between would count too); null with "
                           "kv_cache_bytes_alloc_reason when the driver saw no growth although torch allocated "
                           "(the caching allocator served it from memory it already held)"),
    Metric("kv_cache_bytes_alloc_reason", "text", "why kv_cache_bytes_torch / kv_cache_bytes_nvml are null (CUDA only; "
                                   "measured for cache.impl=static, which allocates once); null when measured"),
)
ALLOCATION_METHODS: Dict[str, str] = record_methods(ALLOCATION_METRICS)

_NVML_FIELDS = ("nvml_device_used_bytes", "nvml_peak_used_bytes", "nvml_samples",
                "nvml_memory_api", "nvml_process_used_bytes", "energy_mj", "energy_span_s",
                "power_limit_w", "nvml_driver_version", "nvml_device_uuid")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of what a checkpoint of ``model`` holds: parameters and persistent buffers (the rope
    tables are derived, not weights); tied parameters count once."""
    # keep_vars=True returns the Parameter objects themselves, so tied weights share an id.
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (torch's CUDA OOM, Python's, or the CPU
    allocator's RuntimeError)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes. Linux: VmHWM (since exec or a clear_refs
    reset). Not ru_maxrss: the kernel carries it across fork+exec, so a job started by a parent of
    800 MiB would report 813 MiB whatever it held."""
    if sys.platform.startswith("linux"):
        try:
            return rss_status()[1]
        except (OSError, KeyError, ValueError):
            pass  # no /proc: getrusage below (which may include a parent's peak)
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024 if sys.platform.startswith("linux") else peak  # Linux KiB, macOS bytes
    import psutil
    info = psutil.Process().memory_info()
    return int(getattr(info, "peak_wset", info.rss))  # win32 keeps a peak; others only rss


# --- seams: the only torch.cuda calls, so tests can drive the CUDA path on a CPU machine ---

def _torch_device_uuid(device: torch.device) -> str:
    """The CUDA runtime's UUID of ``device``, as torch prints it (no ``GPU-`` prefix)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def _torch_reset_peak(device: torch.device) -> None:
    torch.cuda.reset_peak_memory_stats(device)


def _torch_empty_cache(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _torch_allocated(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _torch_peaks(device: torch.device) -> Tuple[int, int]:
    # Synchronise first so the NVML exit samples and energy see the region's queued kernels.
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def nvml_uuid(torch_uuid: str) -> str:
    """NVML's spelling of a device UUID: torch omits the ``GPU-`` prefix NVML uses."""
    return torch_uuid if torch_uuid.startswith(("GPU-", "MIG-")) else "GPU-" + torch_uuid


def open_nvml() -> Tuple[Any, Optional[str]]:
    """``(pynvml, None)`` after a successful nvmlInit, else ``(None, reason)``; the caller shuts it
    down. Imported here so that a machine without nvidia-ml-py still imports kvbench."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as e:
        return None, f"pynvml not importable ({e})"
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 — NVMLError_LibraryNotFound, DriverNotLoaded, ...: a reason, never a failure
        return None, f"nvmlInit failed: {e}"
    return nvml, None


def nvml_driver_version() -> Optional[str]:
    """The GPU driver version NVML reports, or None without NVML; never raises."""
    nvml, _ = open_nvml()
    if nvml is None:
        return None
    try:
        return _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 — a driver version that cannot be read is None
        return None
    finally:
        _shutdown(nvml)


def nvml_used_bytes(device: torch.device) -> Tuple[Optional[int], Optional[str]]:
    """Device memory used now by the GPU behind ``device`` (NVML v2 API, else v1), or ``(None, reason)``."""
    nvml, reason = open_nvml()
    if nvml is None:
        return None, reason
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(nvml_uuid(_torch_device_uuid(device)))
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).used), None
        except Exception:  # noqa: BLE001 — old driver or pynvml: no _v2 symbol or no version kwarg
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used), None
    except Exception as e:  # noqa: BLE001 — any NVML failure becomes the reason
        return None, f"NVML read failed: {e}"
    finally:
        _shutdown(nvml)


@contextmanager
def allocation_delta(device: torch.device | str, prefix: str = "kv_cache_bytes") -> Iterator[Dict[str, Any]]:
    """Memory an allocation inside the block took, as torch and as the driver see it (CUDA only): a
    dict filled at exit."""
    device = torch.device(device)
    out: Dict[str, Any] = {f"{prefix}_torch": None, f"{prefix}_nvml": None, f"{prefix}_alloc_reason": None}
    if device.type != "cuda":
        out[f"{prefix}_alloc_reason"] = f"CUDA only (device is {device.type})"
        yield out
        return
    # Blocks the caching allocator keeps from earlier work would serve the allocation without the
    # driver seeing it (NVML would read 0 bytes for every cache): release them.
    _torch_empty_cache(device)
    torch_before = _torch_allocated(device)
    nvml_before, reason = nvml_used_bytes(device)
    yield out
    out[f"{prefix}_torch"] = _torch_allocated(device) - torch_before
    nvml_after, reason_after = nvml_used_bytes(device)
    if nvml_before is None or nvml_after is None:
        out[f"{prefix}_alloc_reason"] = reason or reason_after
    elif nvml_after - nvml_before <= 0 < out[f"{prefix}_torch"]:
        # A zero here means "not seen", not "free": torch placed the tensors in memory it held.
        out[f"{prefix}_alloc_reason"] = (f"NVML saw {nvml_after - nvml_before} bytes of growth while torch allocated "
                                         f"{out[f'{prefix}_torch']}: the caching allocator served the allocation "
                                         "from memory it already held, so the driver could not see it")
    else:
        out[f"{prefix}_nvml"] = nvml_after - nvml_before


def _text(value: Any) -> str:
    # Older pynvml releases return bytes for strings.
    return value.decode() if isinstance(value, bytes) else str(value)


class MemoryMonitor:
    """Measures memory (and GPU energy) over a ``with`` block; ``result()`` is keyed as
    ``MEMORY_METHODS``. On CPU only ``peak_rss_bytes`` is measured."""

    def __init__(self, device: torch.device | str = "cpu", interval_ms: float = 10.0):
        self.device = torch.device(device)
        self.interval_s = interval_ms / 1e3
        self._lock = threading.Lock()
        self._result: Dict[str, Any] = {}

    def __enter__(self) -> "MemoryMonitor":
        # Per-block state lives here so one monitor can measure several blocks in turn.
        self._nvml: Any = None
        self._handle: Any = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._peak_used: Optional[int] = None
        self._samples = 0
        self._energy_start: Optional[int] = None
        r = self._result = {"peak_rss_bytes": None, "torch_peak_allocated_bytes": None,
                            "torch_peak_reserved_bytes": None, "nvml_reason": None,
                            "nvml_process_reason": None, "energy_reason": None}
        r.update(dict.fromkeys(_NVML_FIELDS))
        if self.device.type != "cuda":
            self._nvml_unavailable(f"device is {self.device.type}")
            return self
        _torch_reset_peak(self.device)
        self._start_nvml()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.device.type == "cuda":
                allocated, reserved = _torch_peaks(self.device)  # synchronises: the block's kernels are done
                self._read_energy()  # first thing after the block, before the sampler's join and NVML calls
                self._result.update(torch_peak_allocated_bytes=int(allocated),
                                    torch_peak_reserved_bytes=int(reserved))
        except Exception:
            # After a failing body (a CUDA error) its exception is the one worth seeing.
            if exc_type is None:
                raise
        finally:
            # Whatever happened above or in the body, the sampler must not outlive the block.
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            if self._nvml is not None:
                self._finish_nvml()
        self._result["peak_rss_bytes"] = peak_rss_bytes()

    def result(self) -> Dict[str, Any]:
        return dict(self._result)

    def _nvml_unavailable(self, reason: str) -> None:
        self._result.update(nvml_reason=reason, nvml_process_reason=reason, energy_reason=reason)

    def _start_nvml(self) -> None:
        nvml, reason = open_nvml()
        if nvml is None:
            return self._nvml_unavailable(reason)
        try:
            # By UUID: CUDA_VISIBLE_DEVICES renumbers torch's indices but not NVML's.
            uuid = nvml_uuid(_torch_device_uuid(self.device))
            self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self._result["nvml_device_uuid"] = uuid
            self._result["nvml_driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
            self._nvml = nvml
            self._result["nvml_memory_api"] = "v2"
            try:
                self._sample()
            except Exception:  # noqa: BLE001 — old driver or pynvml: no _v2 symbol or no version kwarg
                self._result["nvml_memory_api"] = "v1"
                self._sample()
        except Exception as e:  # noqa: BLE001 — any NVML failure becomes nvml_reason
            self._nvml, self._handle = None, None
            self._result.update(dict.fromkeys(_NVML_FIELDS))
            self._nvml_unavailable(f"NVML device lookup failed: {e}")
            _shutdown(nvml)
            return
        try:
            self._result["power_limit_w"] = nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3  # mW
        except Exception:  # noqa: BLE001 — not every board reports one; the power bound is then not checked
            pass
        self._thread = threading.Thread(target=self._sample_loop, name="kvbench-nvml-sampler",
                                        daemon=True)
        self._thread.start()
        try:  # last thing before the block, so its span is the block's
            self._energy_start = int(nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
            self._energy_t0 = time.perf_counter()
        except Exception as e:  # noqa: BLE001 — NVMLError_NotSupported on pre-Volta or some virtual GPUs
            self._result["energy_reason"] = f"energy counter unavailable: {e}"

    def _used_bytes(self) -> int:
        nvml, handle = self._nvml, self._handle
        if self._result["nvml_memory_api"] == "v1":
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).used)

    def _sample(self) -> int:
        used = self._used_bytes()
        with self._lock:
            self._samples += 1
            self._peak_used = used if self._peak_used is None else max(self._peak_used, used)
        return used

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 — a missed sample only lowers the count
                pass  # the exit sample still lands

    def _finish_nvml(self) -> None:
        nvml, r = self._nvml, self._result
        try:
            r["nvml_device_used_bytes"] = self._sample()
        except Exception as e:  # noqa: BLE001 — the exit read failing becomes nvml_reason
            r["nvml_reason"] = f"NVML memory read failed at exit: {e}"
        r["nvml_peak_used_bytes"], r["nvml_samples"] = self._peak_used, self._samples
        self._read_energy()  # when the body failed before its exit read
        r["nvml_process_used_bytes"], r["nvml_process_reason"] = self._process_used()
        _shutdown(nvml)
        self._nvml = self._handle = None

    def _read_energy(self) -> None:
        """energy_mj and energy_span_s (the span it covers), once per block."""
        if self._energy_start is None or self._nvml is None or self._result["energy_mj"] is not None:
            return
        try:
            end = int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
            self._result["energy_span_s"] = time.perf_counter() - self._energy_t0
            self._result["energy_mj"] = end - self._energy_start
        except Exception as e:  # noqa: BLE001 — the energy counter failing becomes energy_reason
            self._result["energy_reason"] = f"energy counter unavailable: {e}"
        self._energy_start = None

    def _process_used(self) -> Tuple[Optional[int], Optional[str]]:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as e:  # noqa: BLE001 — becomes nvml_process_reason
            return None, f"nvmlDeviceGetComputeRunningProcesses failed: {e}"
        pid = os.getpid()
        mine = [p for p in procs if p.pid == pid]
        if not mine:
            # In a container NVML reports host pids, which never equal ours.
            return None, f"pid {pid} not among NVML's compute processes (pid namespace?)"
        if mine[0].usedGpuMemory is None:
            return None, "driver does not report per-process memory (usedGpuMemory is None)"
        return int(mine[0].usedGpuMemory), None


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 — nothing left to measure; a failed shutdown must not fail the run
        pass


# ---- the peak of one span of a process (task=capacity's probes) -------------------------------

def peak_span_reason(device: torch.device) -> Optional[str]:
    """Why :class:`PeakSpan` cannot measure on ``device`` here; None when it can."""
    if device.type == "cuda":
        return None
    try:
        rss_status()
        with open(CLEAR_REFS, "w") as f:  # resets VmHWM to the current RSS (Linux >= 4.0)
            f.write("5")
    except (OSError, KeyError, ValueError) as exc:
        return f"the peak resident set of a span needs Linux's /proc/self/status and clear_refs ({exc})"
    return None


class PeakSpan:
    """The peak memory this process holds between enter and exit, in bytes (``peak``).

    CPU (Linux): VmHWM reset through /proc/self/clear_refs, the whole resident set (weights
    included). CUDA: ``torch.cuda.max_memory_reserved`` (the CUDA context is not in it)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak: Optional[int] = None

    def __enter__(self) -> "PeakSpan":
        if self.device.type == "cuda":
            _torch_empty_cache(self.device)
            _torch_reset_peak(self.device)
        else:
            release_heap()
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # An out-of-memory inside the span still has a peak: the attempt's.
        if self.device.type == "cuda":
            self.peak = _torch_peaks(self.device)[1]
        else:
            self.peak = rss_status()[1]
