"""Memory and energy probes, checked against independent references.

The CUDA/NVML path runs on CPU machines: a fake ``pynvml`` module scripts what the driver would
report, and the monitor's torch.cuda seams are monkeypatched."""

import os
import sys
import threading
import time
import types

import psutil
import pytest
import torch
from torch import nn

from kvbench.config.model import ModelConfig
from kvbench.measure import host, memory
from kvbench.measure.memory import MEMORY_METHODS, MemoryMonitor, peak_rss_bytes, weight_bytes
from kvbench.model import Decoder

UUID = "ffc79498-8ff3-c2dc-3b0d-fafd804516ae"  # as str(torch props.uuid) prints it


MB = 1_000_000


def test_weight_bytes_linear_stack():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    assert weight_bytes(model) == (16 * 32 + 32 + 32 * 8) * 4
    assert weight_bytes(model.half()) == (16 * 32 + 32 + 32 * 8) * 2


def test_weight_bytes_persistent_buffers_in_tied_weights_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(3, dtype=torch.float64))  # persistent
            self.register_buffer("table", torch.ones(1000), persistent=False)

    assert weight_bytes(Tied()) == 10 * 4 * 4 + 3 * 8


def test_weight_bytes_decoder_excludes_rope_tables():
    model = Decoder(ModelConfig())
    params = sum(p.numel() for p in model.parameters()) * 4
    rope = model.rope_cos.numel() * 4 + model.rope_sin.numel() * 4
    assert rope > 0
    assert weight_bytes(model) == params


def test_peak_rss_grows_by_a_touched_allocation():
    current = psutil.Process().memory_info().rss
    before = peak_rss_bytes()
    # The peak can't be below what is resident now; the kernel's RSS counters are per-CPU
    # approximations, so the two reads may differ by a little.
    assert before >= current - 16 * MB
    # The high-water mark only moves once RSS passes it, so allocate past the old peak.
    n_bytes = (before - current) + 200 * MB
    block = torch.ones(n_bytes // 4)  # ones() writes every page, so all of it becomes resident
    assert peak_rss_bytes() - before >= 150 * MB
    del block


class FakeNVMLError(Exception):
    pass


class FakeNVML(types.ModuleType):
    """What the monitor calls in pynvml, with scripted readings; records what it served."""

    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(self, memory=(1000, 5000, 3000), energy=(10_000, 12_345), procs=None,
                 energy_error=False, v2=True):
        super().__init__("pynvml")
        self.memory, self.energy = list(memory), list(energy)
        self.procs = [types.SimpleNamespace(pid=1, usedGpuMemory=7),
                      types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=123_456_789)] \
            if procs is None else procs
        self.energy_error, self.v2 = energy_error, v2
        self.served, self.inits, self.shutdowns = [], 0, 0
        self.handle = object()

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-" + UUID:  # what NVML does with an index-style or prefix-less id
            raise FakeNVMLError(f"not found: {uuid!r}")
        return self.handle

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        assert handle is self.handle
        if version is not None and (not self.v2 or version != self.nvmlMemory_v2):
            raise TypeError("no v2 in this pynvml")
        used = self.memory.pop(0) if len(self.memory) > 1 else self.memory[0]
        self.served.append(used)
        return types.SimpleNamespace(used=used, total=80_000, free=80_000 - used)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        assert handle is self.handle
        if self.energy_error:
            raise FakeNVMLError("Not Supported")
        return self.energy.pop(0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        assert handle is self.handle
        return self.procs


@pytest.fixture
def fake_cuda(monkeypatch):
    """The torch.cuda seams of memory.py, answering as a GPU with UUID would."""
    calls = []
    monkeypatch.setattr(memory, "_torch_device_uuid", lambda device: UUID)
    monkeypatch.setattr(memory, "_torch_reset_peak", lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(memory, "_torch_peaks", lambda device: (111, 222))
    monkeypatch.setattr(memory, "_torch_empty_cache", lambda device: calls.append(("empty_cache", device)))
    return calls


def install(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def run_monitor(min_samples=1, body_error=None):
    """A monitored block that lasts until the fake has served ``min_samples`` readings."""
    mon = MemoryMonitor("cuda:0", interval_ms=1.0)
    with mon:
        deadline = time.monotonic() + 5
        fake = sys.modules["pynvml"]
        while len(fake.served) < min_samples and time.monotonic() < deadline:
            time.sleep(0.002)
        if body_error:
            raise body_error
    return mon


def test_cuda_path_reports_scripted_readings_exactly(monkeypatch, fake_cuda):
    fake = install(monkeypatch, FakeNVML())
    r = run_monitor(min_samples=3).result()  # enter + two thread samples: 1000, 5000, 3000
    assert fake_cuda == [("reset", torch.device("cuda:0"))]
    assert r["torch_peak_allocated_bytes"] == 111 and r["torch_peak_reserved_bytes"] == 222
    assert r["nvml_device_uuid"] == "GPU-" + UUID
    assert r["nvml_device_used_bytes"] == 3000  # the exit reading
    assert r["nvml_peak_used_bytes"] == max(fake.served) == 5000
    assert r["nvml_samples"] == len(fake.served) >= 4  # enter + thread + exit
    assert r["nvml_memory_api"] == "v2"
    assert r["nvml_process_used_bytes"] == 123_456_789
    assert r["energy_mj"] == 12_345 - 10_000
    assert r["nvml_driver_version"] == "550.54.15"
    assert r["nvml_reason"] is r["nvml_process_reason"] is r["energy_reason"] is None
    assert r["peak_rss_bytes"] > 0
    assert fake.inits == fake.shutdowns == 1
    assert set(MEMORY_METHODS) <= set(r)  # every documented field is present


def test_falls_back_to_v1_memory_info(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(memory=(2000, 9000, 4000), v2=False))
    r = run_monitor(min_samples=3).result()
    assert r["nvml_memory_api"] == "v1"
    assert (r["nvml_peak_used_bytes"], r["nvml_device_used_bytes"]) == (9000, 4000)


def test_pid_missing_or_memory_hidden_gives_reason(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(procs=[types.SimpleNamespace(pid=1, usedGpuMemory=7)]))
    r = run_monitor().result()
    assert r["nvml_process_used_bytes"] is None and str(os.getpid()) in r["nvml_process_reason"]
    assert r["nvml_device_used_bytes"] is not None  # the rest still measured

    hidden = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)]
    install(monkeypatch, FakeNVML(procs=hidden))
    r = run_monitor().result()
    assert r["nvml_process_used_bytes"] is None and "usedGpuMemory" in r["nvml_process_reason"]


def test_energy_not_supported_gives_reason(monkeypatch, fake_cuda):
    install(monkeypatch, FakeNVML(energy_error=True))
    r = run_monitor().result()
    assert r["energy_mj"] is None and "Not Supported" in r["energy_reason"]
    assert r["nvml_peak_used_bytes"] is not None


def test_device_matched_by_uuid_not_index(monkeypatch, fake_cuda):
    fake = install(monkeypatch, FakeNVML())
    monkeypatch.setattr(memory, "_torch_device_uuid", lambda device: "0")
    with MemoryMonitor("cuda:0") as mon:
        pass
    r = mon.result()
    assert "lookup" in r["nvml_reason"] and r["nvml_device_used_bytes"] is None
    assert fake.shutdowns == fake.inits == 1
    assert r["torch_peak_allocated_bytes"] == 111  # torch figures don't depend on NVML


def nvml_fields_none(r):
    keys = [k for k in r if k.startswith("nvml_") and not k.endswith("reason")] + ["energy_mj"]
    return all(r[k] is None for k in keys)


def test_without_pynvml_nothing_raises(monkeypatch, fake_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with MemoryMonitor("cuda:0") as mon:
        pass
    r = mon.result()
    assert nvml_fields_none(r) and "pynvml" in r["nvml_reason"]
    assert r["torch_peak_reserved_bytes"] == 222


def test_nvml_init_failure_gives_reason(monkeypatch, fake_cuda):
    fake = install(monkeypatch, FakeNVML())

    def fail():
        raise FakeNVMLError("Driver Not Loaded")

    fake.nvmlInit = fail
    with MemoryMonitor("cuda:0") as mon:
        pass
    r = mon.result()
    assert nvml_fields_none(r) and "Driver Not Loaded" in r["nvml_reason"]


def test_cpu_device_measures_rss_only(monkeypatch):
    fake = install(monkeypatch, FakeNVML())  # present, but must not be touched on CPU
    with MemoryMonitor("cpu") as mon:
        pass
    r = mon.result()
    assert r["peak_rss_bytes"] > 0 and r["nvml_reason"] == "device is cpu"
    assert r["torch_peak_allocated_bytes"] is None and r["torch_peak_reserved_bytes"] is None
    assert nvml_fields_none(r) and fake.inits == 0


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "kvbench-nvml-sampler"]


def test_sampling_thread_stops_on_exit_and_on_error(monkeypatch, fake_cuda):
    fake = install(monkeypatch, FakeNVML())
    mon = MemoryMonitor("cuda:0", interval_ms=1.0)
    with mon:
        assert len(sampler_threads()) == 1
    assert not mon._thread.is_alive() and not sampler_threads()
    served = len(fake.served)
    with mon:  # a monitor measures a second block from scratch
        pass
    assert mon.result()["nvml_samples"] == len(fake.served) - served and not sampler_threads()

    with pytest.raises(RuntimeError, match="boom"):
        run_monitor(min_samples=2, body_error=RuntimeError("boom"))
    assert not sampler_threads()
    assert fake.shutdowns == fake.inits == 3
    served = len(fake.served)
    time.sleep(0.02)
    assert len(fake.served) == served  # nothing samples after the block


def test_allocation_delta_reads_torch_and_nvml_around_the_block(monkeypatch, fake_cuda):
    """The KV cache's cost as torch and the driver see it: after minus before, each read once."""
    allocated = iter([1_000, 1_000 + 4_096])
    monkeypatch.setattr(memory, "_torch_allocated", lambda device: next(allocated))
    fake = install(monkeypatch, FakeNVML(memory=(50_000, 50_000 + 2 * 2**20)))
    with memory.allocation_delta("cuda:0") as out:
        assert out["kv_cache_bytes_torch"] is None  # filled at exit
    assert out == {"kv_cache_bytes_torch": 4_096, "kv_cache_bytes_nvml": 2 * 2**20,
                   "kv_cache_bytes_alloc_reason": None}
    assert fake.served == [50_000, 50_000 + 2 * 2**20] and fake.inits == fake.shutdowns == 2
    assert fake_cuda == [("empty_cache", torch.device("cuda:0"))]  # cached blocks released before reading


def test_allocation_delta_without_nvml_keeps_torch_and_says_why(monkeypatch, fake_cuda):
    allocated = iter([0, 512])
    monkeypatch.setattr(memory, "_torch_allocated", lambda device: next(allocated))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with memory.allocation_delta("cuda:0") as out:
        pass
    assert out["kv_cache_bytes_torch"] == 512 and out["kv_cache_bytes_nvml"] is None
    assert "pynvml" in out["kv_cache_bytes_alloc_reason"]
    with memory.allocation_delta("cpu") as cpu:
        pass
    assert cpu == {"kv_cache_bytes_torch": None, "kv_cache_bytes_nvml": None,
                   "kv_cache_bytes_alloc_reason": "CUDA only (device is cpu)"}


@pytest.mark.cuda
def test_real_gpu_allocation_delta_sees_the_tensor():
    """On a GPU: torch's delta is the tensor to the byte; the driver's delta is the allocator's new
    segment, the tensor rounded up to its 2 MiB granule."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()  # no cached block to reuse: the allocation must reach the driver
    size = 64 * 2**20
    with memory.allocation_delta(device) as out:
        t = torch.empty(size, dtype=torch.uint8, device=device)
    assert out["kv_cache_bytes_torch"] == size
    assert out["kv_cache_bytes_alloc_reason"] is None, out
    assert size <= out["kv_cache_bytes_nvml"] <= size + 2 * 2**20, out
    del t


@pytest.mark.cuda
def test_real_gpu_monitor_reads_nvml_torch_and_energy():
    device = torch.device("cuda")
    size = 256 * 2**20
    with MemoryMonitor(device, interval_ms=5.0) as mon:
        t = torch.ones(size // 4, device=device)  # float32: size bytes
        for _ in range(20):
            t.mul_(1.0001)
        torch.cuda.synchronize()
    r = mon.result()
    assert r["torch_peak_allocated_bytes"] >= size and r["torch_peak_reserved_bytes"] >= size
    assert r["nvml_reason"] is None and r["nvml_memory_api"] in ("v2", "v1")
    assert r["nvml_peak_used_bytes"] >= r["nvml_device_used_bytes"] >= size
    assert r["nvml_samples"] >= 2 and r["nvml_device_uuid"].startswith(("GPU-", "MIG-"))
    assert (r["energy_mj"] is not None and r["energy_mj"] >= 0) or r["energy_reason"]
    # per-process memory is hidden in some containers (pid namespaces): then a reason says so
    assert (r["nvml_process_used_bytes"] or 0) >= size or r["nvml_process_reason"]
    del t


def test_inside_long_lived_frozen_a_cycle_made_there_is_still_freed_with_its_tensor():
    # what the capacity search relies on: release_heap inside the frozen heap still frees the
    # probe's garbage (a cycle holding 64 MiB, touched) and hands it back to the OS
    import gc
    import weakref

    class Node:
        pass

    before = gc.get_freeze_count()
    with host.long_lived_frozen():
        assert gc.get_freeze_count() > before  # what lived on entry is frozen
        host.release_heap()
        start = host.rss_status()[0]
        a, b = Node(), Node()
        a.other, b.other = b, a
        a.tensor = torch.ones(64 * 2 ** 20 // 4)
        gone = weakref.ref(a)
        held = host.rss_status()[0]
        del a, b
        host.release_heap()
        assert gone() is None
        assert held - start >= 60 * 2 ** 20 and host.rss_status()[0] - start < 16 * 2 ** 20
    assert gc.get_freeze_count() == 0  # collectable again after the job
