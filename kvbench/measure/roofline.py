"""The memory-bandwidth roofline of a decode step.

A decode step is memory-bound: it cannot beat (bytes of weights read + bytes of KV read) /
peak bandwidth. The peak is a measured probe of this machine (the best of a large copy and a
GEMV over a matrix much larger than the caches), cached per machine in
``~/.cache/kvbench/bandwidth.json``, or the user's ``runtime.peak_gb_per_s``. Units: bytes,
GB/s (1e9 bytes per second), percent.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from kvbench.cache import kv_cache_bytes
from kvbench.measure.timing import sync

CACHE_FILE = Path(os.environ.get("KVBENCH_CACHE_DIR", Path.home() / ".cache" / "kvbench")) / "bandwidth.json"

ROOFLINE_METHODS = {
    "bytes_read_per_step": "bytes; weights read by a decode step (all but the embedding table, of which B rows)"
                           " + K/V read at the mean context length of the decode steps",
    "kv_bytes_read_per_step": "bytes; K/V read by one decode step at the mean context length",
    "roofline_ms": "ms; bytes_read_per_step / peak bandwidth: the fastest a decode step can be",
    "achieved_gb_per_s": "GB/s; bytes_read_per_step / decode_ms_p50",
    "percent_of_peak": "%; achieved_gb_per_s / peak_gb_per_s",
    "peak_gb_per_s": "GB/s; runtime.peak_gb_per_s if set, else the machine's measured probe (see peak_method)",
}


def decode_bytes_read(model, batch_size: int, context_len: float) -> Tuple[int, int]:
    """(total, kv) bytes one decode step reads with ``context_len`` positions in the cache.

    Every weight matrix is streamed once per step; the embedding is a lookup of B rows.
    """
    cfg = model.config
    element = model.lm_head.weight.element_size()
    embed = model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += -embed.numel() * embed.element_size() + batch_size * cfg.d_model * element
    kv = kv_cache_bytes(cfg.num_layers, model.num_kv_heads, cfg.head_dim, 1, batch_size, element)
    kv = int(kv * context_len)
    return weights + kv, kv


def _machine_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return f"{socket.gethostname()}|{device.type}|{name}|threads={torch.get_num_threads()}"


def probe_bandwidth(device: torch.device, mib: int = 256, repeats: int = 8) -> Dict[str, float]:
    """Best-of-``repeats`` GB/s of a device copy (read + write counted) and a float32 GEMV."""
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

    return {"copy_gb_per_s": best(lambda: dst.copy_(src), 2 * src.numel() * 4),
            "gemv_gb_per_s": best(lambda: torch.mv(matrix, vector), matrix.numel() * 4)}


def peak_bandwidth(device: torch.device, override: Optional[float] = None,
                   cache_file: Path = CACHE_FILE) -> Tuple[float, str]:
    """(GB/s, how it was obtained): the override, else the probe cached for this machine."""
    if override:
        return float(override), "runtime.peak_gb_per_s"
    key = _machine_key(device)
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = probe_bandwidth(device)
        try:
            from kvbench.results import write_json_atomic

            write_json_atomic(cache_file, cached)
        except OSError:
            pass  # a read-only home only costs a re-probe next time
    probe = cached[key]
    best = max(probe, key=probe.get)
    return probe[best], f"probe:{best} (cached in {cache_file})"


def roofline_metrics(model, batch_size: int, prompt_len: int, gen_len: int, decode_ms_p50: float,
                     peak_gb_per_s: float) -> Dict[str, Any]:
    """Roofline fields for a decode run whose median step took ``decode_ms_p50``."""
    # Step i (0-based) attends prompt_len + i + 1 positions; the mean over the run:
    context = prompt_len + (gen_len + 1) / 2
    total, kv = decode_bytes_read(model, batch_size, context)
    achieved = total / (decode_ms_p50 / 1e3) / 1e9
    return {
        "bytes_read_per_step": total,
        "kv_bytes_read_per_step": kv,
        "roofline_ms": total / (peak_gb_per_s * 1e9) * 1e3,
        "achieved_gb_per_s": achieved,
        "peak_gb_per_s": peak_gb_per_s,
        "percent_of_peak": 100.0 * achieved / peak_gb_per_s,
    }
