"""The memory-bandwidth roofline of a decode step.

A decode step is memory-bound: it cannot beat (bytes of weights read + bytes of KV read) / peak
bandwidth. It is a stream of matrix-vector products, so the peak is the read rate of a float32 GEMV
over a matrix much larger than the caches, probed on this machine, or ``runtime.peak_gb_per_s``.
The probe runs next to each run (``runtime.probe=run``: a shared machine's rate moves within
minutes) or once per machine, cached. Units: bytes, GB/s (1e9 bytes per second), percent.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from kvbench.config.bench import MAX_GB_PER_S
from kvbench.jsonio import read_json, write_json_atomic
from kvbench.measure.timing import sync
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.mlp.experts import Experts
from kvbench.quant_weights import expert_stored_bytes, module_stored_bytes

CACHE_FILE = Path(os.environ.get("KVBENCH_CACHE_DIR", Path.home() / ".cache" / "kvbench")) / "bandwidth.json"
# No device multiplies float32 matrices at 10 PFLOP/s (B200's TF32 tensor cores: about 2.2 dense).
MAX_GFLOPS = 1e7

ROOFLINE_METRICS: Dict[str, Metric] = metric_table(
    Metric("bytes_read_per_step", "bytes",
           "weights read by a decode step (all but the embedding table, of which B rows; of a mixture of experts only "
           "the experts the router chose: routed_expert_bytes_per_step), as the checkpoint stores them "
           "(model.weights_stored: FP8 a byte per weight + block scales, MXFP4/NVFP4 half a byte + scales; kvbench "
           "dequantizes on load and reads a compute-dtype copy, which it does not count) + K/V read at the mean "
           "context length of the decode steps"),
    Metric("routed_expert_bytes_per_step", "bytes",
           "mixture-of-experts models: the weights of the distinct experts each timed decode step's router chose, "
           "summed over the MoE layers (distinct experts x bytes per expert as stored), mean over the steps"),
    Metric("kv_bytes_read_per_step", "bytes", "K/V read by one decode step at the mean context length, as stored "
                              "(cache.dtype int8/float8: codes + scales, what a fused kernel reads; kvbench "
                              "dequantizes into a compute-dtype copy first, which it does not count)"),
    Metric("flops_per_step", "FLOP", "2 x batch x (weights multiplied; of a mixture of experts the top_k experts of "
                                     "each token) + attention (QK and PV) at the mean context"),
    Metric("roofline_ms", "ms", "max(bytes_read_per_step / peak bandwidth, flops_per_step / peak compute): the fastest"
                   " a decode step can be; roofline_bound says which bound binds"),
    Metric("achieved_gb_per_s", "GB/s", "bytes_read_per_step / decode_ms_p50"),
    Metric("percent_of_peak", "%", "achieved_gb_per_s / peak_gb_per_s"),
    Metric("x_roofline", "ratio", "decode_ms_p50 / roofline_ms (1.0 = at the roofline)"),
    Metric("peak_gflops", "GFLOP/s", "the machine's float32 GEMM probe (1024^3, best of 8), taken with the bandwidth"),
    Metric("peak_gb_per_s", "GB/s", "runtime.peak_gb_per_s if set, else probe_gemv_gb_per_s (peak_method says which, "
                     "and whether the probe ran next to this run or was cached)"),
    Metric("probe_gemv_gb_per_s", "GB/s", "bytes of a 256 MiB float32 matrix / the best of 8 torch.mv over it"),
    Metric("probe_copy_gb_per_s", "GB/s", "2 x 256 MiB (read + write) / the best of 8 copies of a 256 MiB tensor"),
    Metric("roofline_bound", "text", "memory | compute: which bound gives roofline_ms"),
    Metric("peak_method", "text",
           "where peak_gb_per_s comes from: runtime.peak_gb_per_s, or probe:gemv_gb_per_s and where "
                   "the probe was taken (next to this run, or the cache file and the date it was probed)"),
    Metric("gemm_ms_at_batch", "ms", "the step's weight GEMMs alone, timed next to the run: every nn.Linear of the "
                                     "model in order, F.linear on a (batch, in_features) input (M = batch), and of a "
                                     "mixture of experts as many experts per layer as its router chose per step "
                                     "(the mean, rounded down; M = batch x top_k / that), best of 5 passes"),
    Metric("attainable_ms", "ms", "gemm_ms_at_batch + kv_bytes_read_per_step / peak_gb_per_s: the fastest step this "
                                  "machine's own GEMM kernels allow at this batch (at M > 1 no torch kernel streams "
                                  "weights at the GEMV rate: experiments/results/small_batch_gemm.md)"),
    Metric("x_attainable", "ratio", "decode_ms_p50 / attainable_ms (1.0 = as fast as the GEMMs at this batch "
                                    "allow); read beside x_roofline, which assumes the GEMV rate at every batch"),
    Metric("peak_note", "text", "only when achieved_gb_per_s exceeds peak_gb_per_s by more than 5% (a probe taken "
                 "under load): what to do"),
)
ROOFLINE_METHODS: Dict[str, str] = record_methods(ROOFLINE_METRICS)


def decode_bytes_read(model, batch_size: int, context_len: float, cache_dtype: str = "auto",
                      routed_bytes: Optional[float] = None) -> Tuple[float, int]:
    """(total, kv) bytes one decode step reads with ``context_len`` positions in the cache.

    Every weight matrix is streamed once per step; the embedding is a lookup of B rows. Of a
    mixture of experts only the experts the router chose are read (``routed_bytes``, as stored:
    :func:`stored_routed_bytes` of kvbench.mlp.experts.record_routing's); without it, the most a
    step can read (min(E, B x k)).
    """
    cfg = model.config
    element = model.dtype.itemsize
    embed = model.embed.weight
    stored = cfg.weights_stored  # a quantized checkpoint's weights count as its files hold them
    weights = module_stored_bytes(model, stored)
    weights += -embed.numel() * embed.element_size() + batch_size * cfg.d_model * element
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if experts:
        per_expert = {m: expert_stored_bytes(m, stored) for m in experts}
        if routed_bytes is None:
            routed_bytes = sum(min(m.moe.num_experts, batch_size * m.moe.top_k) * b for m, b in per_expert.items())
        weights += routed_bytes - sum(m.moe.num_experts * b for m, b in per_expert.items())
    # each layer reads what it attends at that context, by its layout's own formula (kvbench.layouts)
    kv = model.layouts.read_bytes(context_len, batch_size, element, cache_dtype)
    return weights + kv, kv


def stored_routed_bytes(model, routed_bytes: Optional[float]) -> Optional[float]:
    """``routed_bytes`` (record_routing's, each expert in the compute dtype) as the checkpoint stores
    those experts (``model.weights_stored``); every MoE layer's experts are alike."""
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if routed_bytes is None or experts is None:
        return routed_bytes
    return routed_bytes * expert_stored_bytes(experts, model.config.weights_stored) / experts.bytes_per_expert()


def decode_flops(model, batch_size: int, context_len: float) -> float:
    """Floating-point operations of one decode step: a multiply-add per weight (the embedding is a
    lookup) and each layer's attention over the positions it reads."""
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.embed.weight.numel()
    # each token runs its top_k routed experts (their stacked weights are 3-D, left out above)
    weights += sum(m.moe.top_k * m.matrix_params_per_expert() for m in model.modules() if isinstance(m, Experts))
    return batch_size * (2.0 * weights + model.layouts.step_flops(context_len))


def _machine_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return f"{socket.gethostname()}|{device.type}|{name}|threads={torch.get_num_threads()}"


def probe_bandwidth(device: torch.device, mib: int = 256, repeats: int = 8,
                    clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Best-of-``repeats`` GB/s of a device copy (read + write counted) and a float32 GEMV, and the
    GFLOP/s of a float32 GEMM. ``clock``: on a CPU shared with other jobs ``time.process_time``,
    which is not charged while the process waits for a core."""
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
            t0 = clock()
            fn()
            sync(device)
            times.append(clock() - t0)
        return nbytes / min(times) / 1e9

    square = torch.randn(1024, 1024, device=device)
    return {"copy_gb_per_s": best(lambda: dst.copy_(src), 2 * src.numel() * 4),
            "gemv_gb_per_s": best(lambda: torch.mv(matrix, vector), matrix.numel() * 4),
            # reported in units of 1e9 "bytes" by best(): pass FLOP to read GFLOP/s
            "matmul_gflops": best(lambda: square @ square, 2 * 1024**3)}


def machine_peaks(device: torch.device, override_gb_per_s: Optional[float] = None,
                  cache_file: Path = CACHE_FILE, fresh: bool = False) -> Dict[str, Any]:
    """The roofline's peaks as record fields; ``fresh``: probe now instead of reading the cache."""
    if fresh:
        probe, where = probe_bandwidth(device), "probed next to this run"
    else:
        probe, where = _cached_probe(device, cache_file)
    peak, method = probe["gemv_gb_per_s"], f"probe:gemv_gb_per_s ({where})"
    if override_gb_per_s:
        peak, method = float(override_gb_per_s), "runtime.peak_gb_per_s"
    return {"peak_gb_per_s": peak, "peak_gflops": probe["matmul_gflops"], "peak_method": method,
            "probe_gemv_gb_per_s": probe["gemv_gb_per_s"], "probe_copy_gb_per_s": probe["copy_gb_per_s"]}


def _cached_probe(device: torch.device, cache_file: Path) -> Tuple[Dict[str, float], str]:
    key = _machine_key(device)
    try:
        cached = read_json(cache_file)
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    # absent, older than the probe date, edited, damaged or physically impossible: probe again
    if not _valid_probe(cached.get(key), physical_ceilings(device)) or "probed_at" not in cached[key]:
        cached[key] = {**probe_bandwidth(device), "probed_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            write_json_atomic(cache_file, cached)
        except OSError:
            pass  # a read-only home only costs a re-probe next time
    return cached[key], f"cached in {cache_file} at {cached[key]['probed_at']}"


def physical_ceilings(device: torch.device) -> Dict[str, float]:
    """The most each probed rate can be on ``device``: a rate beyond is a cache entry edited or
    miscomputed, and as the roofline's peak it would make every run look idle. On CUDA, twice the
    DRAM rate from memory clock and bus width, so that a part of the probe served from L2 never
    trips it."""
    gb = MAX_GB_PER_S
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz > 0 and bus_bits > 0:
            gb = min(gb, 2 * (2 * clock_khz * 1e3 * bus_bits / 8 / 1e9))
    return {"copy_gb_per_s": gb, "gemv_gb_per_s": gb, "matmul_gflops": MAX_GFLOPS}


def _valid_probe(probe: Any, ceilings: Dict[str, float]) -> bool:
    return isinstance(probe, dict) and all(
        isinstance(probe.get(k), (int, float)) and not isinstance(probe.get(k), bool)
        and math.isfinite(probe[k]) and 0 < probe[k] <= ceiling for k, ceiling in ceilings.items())


def roofline_metrics(model, batch_size: int, prompt_len: int, gen_len: int, decode_ms_p50: float,
                     peak_gb_per_s: float, peak_gflops: float,
                     kv_positions: Optional[float] = None, cache_dtype: str = "auto",
                     routed_bytes: Optional[float] = None) -> Dict[str, Any]:
    """Roofline fields for a decode run whose median step took ``decode_ms_p50``.

    ``kv_positions``: the mean positions per KV head a step reads, when that is not the context (a
    fixed-shape step reads its whole context bucket)."""
    # Step i (0-based) attends prompt_len + i + 1 positions (the new token's included). The mean over the
    # run's steps of each step's figure, not the figure at the mean context: a chunk's or a window's
    # positions, or a pool's entries, are not linear in the context (a chunked layer's read at the mean
    # of 1001..1100 with chunks of 1024 is 26 positions; the steps' mean is 272).
    contexts = [float(kv_positions)] if kv_positions is not None else \
        [prompt_len + i + 1 for i in range(max(1, gen_len))]
    routed_bytes = stored_routed_bytes(model, routed_bytes)
    total, kv = decode_bytes_read(model, batch_size, contexts[0], cache_dtype, routed_bytes)
    if len(contexts) > 1:
        element = model.dtype.itemsize
        weights, kv = total - kv, sum(model.layouts.read_bytes(c, batch_size, element, cache_dtype)
                                      for c in contexts) / len(contexts)
        total = weights + kv
    flops = decode_flops(model, batch_size, contexts[0]) + batch_size * (
        sum(model.layouts.step_flops(c) for c in contexts) / len(contexts) - model.layouts.step_flops(contexts[0]))
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
    if routed_bytes is not None:
        out["routed_expert_bytes_per_step"] = routed_bytes
    if achieved > 1.05 * peak_gb_per_s:
        # A probe taken while other work shared the memory bus underestimates the machine.
        out["peak_note"] = (f"achieved {achieved:.1f} GB/s exceeds the peak {peak_gb_per_s:.1f} GB/s: "
                            f"probe next to the run (runtime.probe=run), re-probe on an idle machine "
                            f"(delete {CACHE_FILE}) or set runtime.peak_gb_per_s")
    return out


def probe_step_gemms(model, batch_size: int, device: torch.device, repeats: int = 5,
                     clock: Callable[[], float] = time.perf_counter, routed: Sequence[int] = ()) -> float:
    """Milliseconds of one decode step's weight GEMMs at M = ``batch_size``, in module order (as a
    step meets them, so each weight is streamed from memory, not a cache); best of ``repeats``. A
    mixture of experts' layer runs ``routed[i]`` of its experts, each on B x k / that many rows."""
    calls = []  # (weight, bias, rows), in the order a step meets them
    per_layer = iter(routed)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            calls.append((m.weight, m.bias, batch_size))
        elif isinstance(m, Experts):
            n = next(per_layer, 0)
            rows = max(1, batch_size * m.moe.top_k // n) if n else 0
            for e in range(n):
                calls += [(m.w_gate_up[e], None if m.b_gate_up is None else m.b_gate_up[e], rows),
                          (m.w_down[e], None if m.b_down is None else m.b_down[e], rows)]
    inputs = {(w.shape[1], rows): torch.randn(rows, w.shape[1], device=device, dtype=w.dtype) for w, _, rows in calls}
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            sync(device)
            t0 = clock()
            for w, b, rows in calls:
                torch.nn.functional.linear(inputs[(w.shape[1], rows)], w, b)
            sync(device)
            if i:
                times.append(clock() - t0)
    return min(times) * 1e3


def attainable_metrics(decode_ms_p50: float, gemm_ms: float, kv_bytes: int, peak_gb_per_s: float) -> Dict[str, Any]:
    """``attainable_ms`` and ``x_attainable`` (see :data:`ROOFLINE_METHODS`) from the probed GEMMs."""
    attainable = gemm_ms + kv_bytes / (peak_gb_per_s * 1e9) * 1e3
    return {"gemm_ms_at_batch": gemm_ms, "attainable_ms": attainable, "x_attainable": decode_ms_p50 / attainable}
