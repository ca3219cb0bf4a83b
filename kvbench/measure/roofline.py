"""The memory-bandwidth roofline of a decode step.

A decode step is memory-bound: it cannot beat (bytes of weights read + bytes of KV read) /
peak bandwidth. The peak is a measured probe of this machine (the best of a large copy and a
GEMV over a matrix much larger than the caches), cached per machine in
``~/.cache/kvbench/bandwidth.json``, or the user's ``runtime.peak_gb_per_s``. Units: bytes,
GB/s (1e9 bytes per second), percent.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from kvbench.cache import kv_cache_bytes
from kvbench.measure.timing import sync
from kvbench.results import read_json, write_json_atomic

CACHE_FILE = Path(os.environ.get("KVBENCH_CACHE_DIR", Path.home() / ".cache" / "kvbench")) / "bandwidth.json"

ROOFLINE_METHODS = {
    "bytes_read_per_step": "bytes; weights read by a decode step (all but the embedding table, of which B rows)"
                           " + K/V read at the mean context length of the decode steps",
    "kv_bytes_read_per_step": "bytes; K/V read by one decode step at the mean context length",
    "flops_per_step": "FLOP; 2 x batch x (weights multiplied) + attention (QK and PV) at the mean context",
    "roofline_ms": "ms; max(bytes_read_per_step / peak bandwidth, flops_per_step / peak compute): the fastest"
                   " a decode step can be; roofline_bound says which bound binds",
    "achieved_gb_per_s": "GB/s; bytes_read_per_step / decode_ms_p50",
    "percent_of_peak": "%; achieved_gb_per_s / peak_gb_per_s",
    "x_roofline": "ratio; decode_ms_p50 / roofline_ms (1.0 = at the roofline)",
    "peak_gflops": "GFLOP/s; the machine's float32 GEMM probe (1024^3, best of 8), cached with the bandwidth",
    "peak_gb_per_s": "GB/s; runtime.peak_gb_per_s if set, else the machine's measured probe (see peak_method)",
    "roofline_bound": "memory | compute: which bound gives roofline_ms",
    "peak_method": "text; where peak_gb_per_s comes from: runtime.peak_gb_per_s, or probe:<copy|gemv>_gb_per_s "
                   "and the file the probe is cached in",
    "peak_note": "text; only when achieved_gb_per_s exceeds peak_gb_per_s by more than 5% (a probe taken "
                 "under load): what to do",
}


def decode_bytes_read(model, batch_size: int, context_len: float) -> Tuple[int, int]:
    """(total, kv) bytes one decode step reads with ``context_len`` positions in the cache.

    Every weight matrix is streamed once per step; the embedding is a lookup of B rows.
    """
    cfg = model.config
    element = model.dtype.itemsize
    embed = model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += -embed.numel() * embed.element_size() + batch_size * cfg.d_model * element
    kv = kv_cache_bytes(cfg.num_layers, model.num_kv_heads, cfg.head_dim, 1, batch_size, element)
    kv = int(kv * context_len)
    return weights + kv, kv


def decode_flops(model, batch_size: int, context_len: float) -> float:
    """Floating-point operations of one decode step: a multiply-add per weight (the embedding is
    a lookup) and per K/V element read by the attention."""
    cfg = model.config
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.embed.weight.numel()
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len  # QK^T and PV
    return 2.0 * batch_size * (weights + attention)


def _machine_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return f"{socket.gethostname()}|{device.type}|{name}|threads={torch.get_num_threads()}"


def probe_bandwidth(device: torch.device, mib: int = 256, repeats: int = 8) -> Dict[str, float]:
    """Best-of-``repeats`` GB/s of a device copy (read + write counted) and a float32 GEMV, and
    the GFLOP/s of a float32 GEMM."""
    n = mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    matrix = src.view(-1, 4096)
    vector = torch.randn(4096, device=device)

    def best(fn, nbytes):
        fn()  # warm-up (page faults, kernel selection)
        sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    square = torch.randn(1024, 1024, device=device)
    return {"copy_gb_per_s": best(lambda: dst.copy_(src), 2 * src.numel() * 4),
            "gemv_gb_per_s": best(lambda: torch.mv(matrix, vector), matrix.numel() * 4),
            # reported in units of 1e9 "bytes" by best(): pass FLOP to read GFLOP/s
            "matmul_gflops": best(lambda: square @ square, 2 * 1024**3)}


def machine_peaks(device: torch.device, override_gb_per_s: Optional[float] = None,
                  cache_file: Path = CACHE_FILE) -> Tuple[float, float, str]:
    """(GB/s, GFLOP/s, how the bandwidth was obtained): the override, else the probe cached
    for this machine."""
    key = _machine_key(device)
    try:
        cached = read_json(cache_file)
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if "matmul_gflops" not in cached.get(key, {}):
        cached[key] = probe_bandwidth(device)
        try:
            write_json_atomic(cache_file, cached)
        except OSError:
            pass  # a read-only home only costs a re-probe next time
    probe = cached[key]
    gflops = probe["matmul_gflops"]
    if override_gb_per_s:
        return float(override_gb_per_s), gflops, "runtime.peak_gb_per_s"
    best = max(("copy_gb_per_s", "gemv_gb_per_s"), key=probe.get)
    return probe[best], gflops, f"probe:{best} (cached in {cache_file})"


def roofline_metrics(model, batch_size: int, prompt_len: int, gen_len: int, decode_ms_p50: float,
                     peak_gb_per_s: float, peak_gflops: float) -> Dict[str, Any]:
    """Roofline fields for a decode run whose median step took ``decode_ms_p50``."""
    # Step i (0-based) attends prompt_len + i + 1 positions; the mean over the run:
    context = prompt_len + (gen_len + 1) / 2
    total, kv = decode_bytes_read(model, batch_size, context)
    flops = decode_flops(model, batch_size, context)
    memory_ms, compute_ms = total / (peak_gb_per_s * 1e9) * 1e3, flops / (peak_gflops * 1e9) * 1e3
    achieved = total / (decode_ms_p50 / 1e3) / 1e9
    out = {
        "bytes_read_per_step": total,
        "kv_bytes_read_per_step": kv,
        "flops_per_step": flops,
        "roofline_ms": max(memory_ms, compute_ms),
        "roofline_bound": "memory" if memory_ms >= compute_ms else "compute",
        "x_roofline": decode_ms_p50 / max(memory_ms, compute_ms),
        "peak_gflops": peak_gflops,
        "achieved_gb_per_s": achieved,
        "peak_gb_per_s": peak_gb_per_s,
        "percent_of_peak": 100.0 * achieved / peak_gb_per_s,
    }
    if achieved > 1.05 * peak_gb_per_s:
        # A probe taken while other work shared the memory bus underestimates the machine.
        out["peak_note"] = (f"achieved {achieved:.1f} GB/s exceeds the peak {peak_gb_per_s:.1f} GB/s: "
                            f"re-probe on an idle machine (delete {CACHE_FILE}) or set runtime.peak_gb_per_s")
    return out
