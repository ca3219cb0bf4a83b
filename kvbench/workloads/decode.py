"""The decode workload (``workload=decode``): prefill ``prompt_len`` tokens, then ``gen_len``
greedy decode steps, ``runtime.warmup`` untimed and ``runtime.repeats`` timed times.

It owns the metrics it emits and their methods (:data:`METHODS`): time to first token, per-step
decode latency, throughput, KV bytes, the roofline and, after timing, the fidelity of what was
timed.

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from kvbench.cache import KVCache, cache_for, kv_cache_bytes
from kvbench.config import DTYPE_BYTES, BenchConfig, ConfigError
from kvbench.generate import greedy_generate
from kvbench.measure.memory import ALLOCATION_METHODS, MemoryMonitor, allocation_delta
from kvbench.measure.roofline import ROOFLINE_METHODS, machine_peaks, roofline_metrics
from kvbench.measure.timing import RegionTimer, step_percentiles, sync
from kvbench.model import Decoder
from kvbench.quality.fidelity import FIDELITY_METHODS, fidelity
from kvbench.results import RunResult

Tick = Callable[..., None]

# Units and methods of every metric this workload reports (merged into the record's ``methods``).
METHODS: Dict[str, str] = {
    "prefill_ms": "ms; time to first token: prompt forward + argmax, median over timed trials",
    "decode_ms_p50": "ms; per-token decode step latency, 50th percentile over every step of every timed trial",
    "decode_ms_p90": "ms; per-token decode step latency, 90th percentile",
    "decode_ms_p99": "ms; per-token decode step latency, 99th percentile",
    "decode_ms_mean": "ms; mean per-token decode step latency",
    "tokens_per_s": "tokens/s; batch_size x gen_len / decode time of a trial, median over timed trials",
    "e2e_ms": "ms; prefill + all decode steps of a trial, median over timed trials",
    "kv_cache_bytes": "bytes; storage held by the cache tensors at the end of a trial (untyped_storage().nbytes())",
    "kv_cache_bytes_formula": "bytes; 2 * layers * kv_heads * head_dim * seq_len * batch * bytes_per_element",
    "compile_s": "s; runtime.compile=true: the first short generation through torch.compile (excluded from "
                 "every trial)",
    "series.decode_ms": "ms; every decode step of the last timed trial, in order",
    "energy_mj_per_token": "mJ/token; CUDA with NVML: energy_mj over the timed trials (prefill included) / the "
                           "tokens they produced (batch x (gen_len + 1) per trial); null with energy_reason when "
                           "the counter did not advance",
    **ALLOCATION_METHODS,
    **ROOFLINE_METHODS,
    **FIDELITY_METHODS,
}


@dataclass
class DecodeTimings:
    """Per-trial timings of the decode workload, in milliseconds."""

    prefill_ms: List[float]  # one per timed trial
    decode_ms: List[List[float]]  # per trial, one per decode step


def time_decode(model, prompt: torch.Tensor, gen_len: int, cache: KVCache, warmup: int,
                repeats: int, device, tick: Optional[Tick] = None) -> DecodeTimings:
    """``warmup`` untimed then ``repeats`` timed runs of :func:`greedy_generate` on a reset cache.

    ``tick``, if given, is called once per finished trial (for a progress bar).
    """
    prefill, decode = [], []
    for trial in range(warmup + repeats):
        cache.reset()
        timer = RegionTimer(device)
        greedy_generate(model, prompt, gen_len, cache, timer)
        if trial >= warmup:
            prefill.extend(timer.ms("prefill"))
            decode.append(timer.ms("decode"))
        if tick is not None:
            tick()
    return DecodeTimings(prefill, decode)


def summarize_decode(t: DecodeTimings, batch_size: int) -> Dict[str, float]:
    """Latency metrics (units and methods in :data:`METHODS`)."""
    per_trial_decode = torch.tensor([sum(trial) for trial in t.decode_ms], dtype=torch.float64)
    prefill = torch.tensor(t.prefill_ms, dtype=torch.float64)
    gen_len = len(t.decode_ms[0])
    return {
        "prefill_ms": prefill.median().item(),
        **step_percentiles([ms for trial in t.decode_ms for ms in trial]),
        "tokens_per_s": (batch_size * gen_len / (per_trial_decode / 1e3)).median().item(),
        "e2e_ms": (prefill + per_trial_decode).median().item(),
    }


def compile_model(model: Decoder, device: torch.device, prompt: torch.Tensor, cache,
                  metrics: Dict[str, Any]) -> Decoder:
    """``torch.compile`` the decoder (dynamic shapes: the KV length grows every step) and run
    one short generation so compilation is done, and timed as ``compile_s``, before any trial."""
    compiled = torch.compile(model, dynamic=True)
    t0 = time.perf_counter()
    try:
        greedy_generate(compiled, prompt, 3, cache)
    except Exception as exc:  # noqa: BLE001 — inductor raises many types; the message is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"runtime.compile=True: torch.compile is unavailable here ({first})") from exc
    sync(device)
    metrics["compile_s"] = time.perf_counter() - t0
    cache.reset()
    return compiled


def run(cfg: BenchConfig, model: Decoder, device: torch.device, result: RunResult,
        tick: Optional[Tick] = None) -> None:
    """Prefill then ``gen_len`` decode steps, ``warmup`` + ``repeats`` times; latency, memory,
    roofline and fidelity into ``result.metrics`` as they are measured (a failure keeps them)."""
    w, rt = cfg.workload, cfg.runtime
    metrics = result.metrics
    result.methods.update(METHODS)
    seq_len = w.prompt_len + w.gen_len
    generator = torch.Generator().manual_seed(rt.seed)
    prompt = torch.randint(0, cfg.model.vocab_size, (w.batch_size, w.prompt_len), generator=generator)
    prompt = prompt.to(device)
    metrics["kv_cache_bytes_formula"] = kv_cache_bytes(
        cfg.model.num_layers, cfg.attention.num_kv_heads, cfg.model.head_dim, seq_len, w.batch_size,
        DTYPE_BYTES[rt.dtype])
    with allocation_delta(device) as allocated:
        cache = cache_for(model, cfg.cache.impl, w.batch_size, seq_len)
    if cfg.cache.impl != "static":  # the others allocate as they grow, not at creation
        allocated = {k: None for k in allocated}
        allocated["kv_cache_bytes_alloc_reason"] = (f"cache.impl={cfg.cache.impl} allocates per step; "
                                                    "measured for static only")
    metrics.update(allocated)
    eager = model
    if rt.compile:
        model = compile_model(model, device, prompt, cache, metrics)
    # Warm-up outside the monitor: its one-off costs (kernel loading, per-shape plans: the first GPU
    # check saw a warm-up of 1000 steps take ~45 s of 55) must not count in memory or energy.
    time_decode(model, prompt, w.gen_len, cache, rt.warmup, 0, device, tick)
    with MemoryMonitor(device, rt.nvml_interval_ms) as monitor:
        timings = time_decode(model, prompt, w.gen_len, cache, 0, rt.repeats, device, tick)
    metrics.update(monitor.result())
    metrics["energy_mj_per_token"] = None
    if metrics.get("energy_mj"):
        metrics["energy_mj_per_token"] = metrics["energy_mj"] / (w.batch_size * (w.gen_len + 1) * rt.repeats)
    elif metrics.get("energy_mj") == 0:
        metrics["energy_reason"] = ("the energy counter did not advance over the timed trials "
                                    "(too short for its update rate)")
    metrics["kv_cache_bytes"] = cache.nbytes
    metrics.update(summarize_decode(timings, w.batch_size))
    result.series["decode_ms"] = timings.decode_ms[-1]
    peak, gflops, metrics["peak_method"] = machine_peaks(device, rt.peak_gb_per_s)
    metrics.update(roofline_metrics(eager, w.batch_size, w.prompt_len, w.gen_len,
                                    metrics["decode_ms_p50"], peak, gflops))
    if rt.fidelity:
        metrics.update(fidelity(eager, prompt, w.gen_len, cfg.cache.impl, rt.dtype))
