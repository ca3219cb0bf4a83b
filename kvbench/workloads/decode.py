"""The decode workload (``workload=decode``): prefill ``prompt_len`` tokens, then ``gen_len``
greedy decode steps, ``runtime.warmup`` untimed and ``runtime.repeats`` timed times.

It owns the metrics it emits and their methods (:data:`METHODS`).

Notation: B batch, P prompt length, N decode steps, V vocab.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kvbench.cache import Cache, cache_for
from kvbench.config.bench import BenchConfig
from kvbench.config.model import AttentionConfig, ModelConfig
from kvbench.core.dtypes import DTYPE_BYTES
from kvbench.generate import (
    COMPILE_METRICS,
    FixedShapeStep,
    compile_phase,
    compiled_graphs,
    compiled_step,
    decode_step,
    greedy_generate,
)
from kvbench.measure.memory import ALLOCATION_METRICS, MemoryMonitor, allocation_delta
from kvbench.measure.roofline import (
    ROOFLINE_METRICS,
    attainable_metrics,
    machine_peaks,
    probe_step_gemms,
    roofline_metrics,
)
from kvbench.measure.stats import METHODS as STATS_METHODS
from kvbench.measure.stats import (
    median,
    step_metric_metrics,
    step_metrics,
    step_rate,
    step_rate_metrics,
    trial_metric,
    trial_metric_metrics,
)
from kvbench.measure.timing import RegionTimer
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.mlp.experts import Routing, record_routing
from kvbench.model import Decoder
from kvbench.quality.fidelity import FIDELITY_METRICS, fidelity
from kvbench.results import RunResult

Tick = Callable[..., None]

# A decode record carries no KV cost of its own: on a quiet machine a fit within one decode read
# -1745 µs per 1k positions, [-2062, -1431], a step that got cheaper as it read more.
KV_COST_REASON = ("not measured per record: within one decode the context and the time since the trial began "
                  "rise together, so a drift of the machine would read as KV cost; task=compare times steps "
                  "at chosen contexts in alternating order (compare.contexts), and a sweep over "
                  "workload.prompt_len gives the report's KV cost across prompts")

METRICS: Dict[str, Metric] = metric_table(
    Metric("prefill_ms", "ms", "time to first token: prompt forward + argmax, median over timed trials"),
    Metric("decode_ms_p50", "ms",
           f"per-token decode step latency, 50th percentile over every step of every timed trial "
                     f"({STATS_METHODS['percentiles']})"),
    Metric("decode_ms_p90", "ms", "per-token decode step latency, 90th percentile (as decode_ms_p50)"),
    Metric("decode_ms_p99", "ms", "per-token decode step latency, 99th percentile (as decode_ms_p50)"),
    Metric("decode_ms_mean", "ms", "mean per-token decode step latency"),
    Metric("e2e_ms", "ms", "prefill + all decode steps of a trial, median over timed trials"),
    *step_metric_metrics(),
    *trial_metric_metrics("prefill_ms", "ms"),
    *step_rate_metrics(),
    Metric("trials_run", "count",
           "timed trials actually run: runtime.repeats, or more until runtime.min_time_s of timed "
                  "trials had passed"),
    Metric("decode_ms_at_ctx0", "ms", "null in a decode record (see decode_us_per_1k_ctx_reason)"),
    Metric("decode_us_per_1k_ctx", "µs per 1,000 positions",
           "null in a decode record (see decode_us_per_1k_ctx_reason); task=compare measures it"),
    Metric("decode_us_per_1k_ctx_ci_low", "µs per 1,000 positions",
           "null in a decode record (as decode_us_per_1k_ctx)"),
    Metric("decode_us_per_1k_ctx_ci_high", "µs per 1,000 positions",
           "null in a decode record (as decode_us_per_1k_ctx)"),
    Metric("decode_us_per_1k_ctx_reason", "text", f"why decode_us_per_1k_ctx is null: {KV_COST_REASON}"),
    Metric("kv_cache_bytes", "bytes",
           "storage held by the cache tensors at the end of a trial (untyped_storage().nbytes())"),
    Metric("kv_cache_bytes_formula", "bytes",
           "batch * sum over layers of the layout's bytes per position (K/V heads: 2 * kv_heads * (head_dim "
           "* bytes_per_element + scale bytes)) * the positions it holds (seq_len, or W on a local layer), and a "
           "constant state once (kvbench.layouts): cache.dtype auto: the compute dtype's bytes, no scales; "
           "int8 / float8_e4m3fn: 1 byte and a "
           "4-byte scale per (sequence, head, position); nvfp4 / nvfp4_rotated: half a byte per element and a "
           "1-byte scale per 16 (72 B per 128 values), mxfp4: per 32 (68 B); cache.impl=none: 0, it holds nothing "
           "(each step recomputes K/V of the whole sequence), as in workload=multiturn"),
    Metric("kv_quantized_layers", "text",
           "which layers cache.dtype stores quantized (those holding K/V) and which keep a recurrent state "
           "unquantized (float32; convolution inputs in the compute dtype), from the model's layer layouts"),
    Metric("compile_s", "s", "runtime.compile=default|graph: the first generation through the compiled model or step, "
                 "the whole decode so that every shape (graph: every context bucket) is compiled (twice with CUDA "
                 "graphs, which record a graph at its second call), excluded from every trial"),
    *COMPILE_METRICS.values(),
    Metric("overhead_ms_per_step", "ms",
           "what a decode step costs the host beside reading bytes. CUDA: median host time "
                            "to enqueue one step (perf_counter around the call, nothing synchronising), against "
                            "decode_ms_p50 from CUDA events. CPU: median of 16 steps of the overhead-floor model "
                            "(this model's layers, batch, cache and runtime.compile; one 2-dim head, everything "
                            "else 2 wide; a 1-token prompt), which runs the same operations and reads almost nothing"),
    Metric("overhead_share", "fraction", "overhead_ms_per_step / decode_ms_p50: near 1 (or above, on CUDA) the step is "
                      "bound by Python and kernel launches, not by the bytes it reads"),
    Metric("series.decode_ms", "ms", "every decode step of the last timed trial, in order"),
    Metric("series.routed_experts", "count", "mixture-of-experts models: the distinct experts each decode step of the "
           "last timed trial ran, summed over the MoE layers (counted from the router as the step ran)"),
    Metric("routed_experts_per_step", "count", "mixture-of-experts models: the distinct experts a timed decode step "
           "ran, summed over the MoE layers, mean over every step of every timed trial"),
    Metric("energy_mj_per_token", "mJ/token",
           "CUDA with NVML: the mean power over the energy counter's span (energy_mj / energy_span_s) x "
           "the timed trials' own time (prefill + decode) / the tokens they produced (batch x (gen_len + 1) per "
           "trial): energy and tokens of one span; null with energy_reason when the counter did not advance"),
    *ALLOCATION_METRICS.values(),
    *ROOFLINE_METRICS.values(),
    *FIDELITY_METRICS.values(),
)
METHODS: Dict[str, str] = record_methods(METRICS)
RECORDED = METRICS  # what a record may hold


@dataclass
class DecodeTimings:
    """Per-trial timings of the decode workload, in milliseconds."""

    prefill_ms: List[float]  # one per timed trial
    decode_ms: List[List[float]]  # per trial, one per decode step
    decode_host_ms: List[List[float]]  # the same steps, host time (on CUDA: time to enqueue)


def time_decode(model, prompt: torch.Tensor, gen_len: int, cache: Cache, warmup: int,
                repeats: int, device, tick: Optional[Tick] = None, step=decode_step, min_time_s: float = 0.0,
                clock: Callable[[], float] = time.perf_counter, prefill_tokens: Optional[int] = None,
                copied: bool = False) -> DecodeTimings:
    """``warmup`` untimed then ``repeats`` timed runs of :func:`greedy_generate` on a reset cache, and
    more until ``min_time_s`` has passed since the first timed one started (as optimum-benchmark
    does); ``tick`` once per finished trial; ``prefill_tokens``: the prompt in forwards of at most that
    many tokens over the batch (None: one), ``copied`` as :func:`~kvbench.generate.chunked_prefill`'s."""
    prefill, decode, host = [], [], []
    trial, started = 0, None
    while trial < warmup + repeats or (started is not None and clock() - started < min_time_s):
        if trial == warmup:
            started = clock()
        cache.reset()
        timer = RegionTimer(device)
        greedy_generate(model, prompt, gen_len, cache, timer, step=step, prefill_tokens=prefill_tokens,
                        copied=copied)
        if trial >= warmup:
            prefill.extend(timer.ms("prefill"))
            decode.append(timer.ms("decode"))
            host.append(timer.host_ms("decode"))
        if tick is not None:
            tick()
        trial += 1
    return DecodeTimings(prefill, decode, host)


def summarize_decode(t: DecodeTimings, batch_size: int) -> Dict[str, object]:
    """Latency metrics with their intervals and sample counts (units and methods in :data:`METHODS`)."""
    per_trial_decode = [sum(trial) for trial in t.decode_ms]
    steps = step_metrics(t.decode_ms)
    return {
        **trial_metric("prefill_ms", t.prefill_ms),
        **steps,
        **step_rate(steps, batch_size),  # tokens/s from the steps themselves: they cannot disagree
        "e2e_ms": median([p + d for p, d in zip(t.prefill_ms, per_trial_decode)]),
        "trials_run": len(t.decode_ms),
    }


def kv_cost() -> Dict[str, object]:
    """A decode record's KV cost: null with :data:`KV_COST_REASON`."""
    return {"decode_ms_at_ctx0": None, "decode_us_per_1k_ctx": None, "decode_us_per_1k_ctx_ci_low": None,
            "decode_us_per_1k_ctx_ci_high": None, "decode_us_per_1k_ctx_reason": KV_COST_REASON}


def energy_per_token(energy_mj: Optional[float], span_s: Optional[float], timed_s: float,
                     tokens: int) -> Optional[float]:
    """mJ per token with energy and tokens of one span: the counter's mean power over the ``span_s``
    seconds between its two reads, times the time the tokens took. The counter's span is wider than
    the trials; its whole energy over the trials' tokens read 3,197 mJ/token at 568 tok/s: 1.8 kW on
    a 700 W board."""
    if not energy_mj or not span_s or not tokens:
        return None
    return energy_mj / span_s * min(timed_s, span_s) / tokens


def routed_steps(routing: Routing, gen_len: int, result: RunResult) -> Tuple[Optional[float], List[int]]:
    """What a mixture of experts' timed decode steps read: (the mean routed-expert bytes of a step,
    the mean distinct experts per MoE layer rounded down), with the routing metrics into ``result``;
    (None, []) for a dense model."""
    forwards, sizes = routing.forwards(), routing.bytes_per_forward()
    if not forwards or not gen_len:
        return None, []
    n = gen_len + 1
    steps = [i for i in range(len(forwards)) if i % n]  # every forward but each trial's prefill
    result.series["routed_experts"] = [sum(forwards[i]) for i in steps[-gen_len:]]
    result.metrics["routed_experts_per_step"] = statistics.mean(sum(forwards[i]) for i in steps)
    per_layer = [int(statistics.mean(forwards[i][layer] for i in steps)) for layer in range(len(forwards[0]))]
    return statistics.mean(sizes[i] for i in steps), per_layer


def floor_model(model: Decoder) -> Decoder:
    """``model``'s layers and dtype with one 2-dim head and everything else 2 wide: a decode step of
    it runs every operation of the real one (the head count and grouping change sizes, not the
    operations) but reads almost nothing, so its time is the per-step cost of Python, dispatch and
    launches. One floor per layer count, so a sweep over attention variants compiles it once."""
    c = model.config
    # a mixture of experts keeps its experts, router and shared expert, each 2 wide
    moe = None if c.moe is None else replace(c.moe, expert_ffn_dim=2, shared_ffn_dim=2 if c.moe.shared_ffn_dim else 0)
    cfg = ModelConfig(name=f"floor-{c.num_layers}-layers", num_layers=c.num_layers, d_model=2, num_heads=1,
                      preset_kv_heads=1, head_dim=2, ffn_dim=2, vocab_size=2, max_seq_len=64, moe=moe)
    with model.device:
        floor = Decoder(cfg, AttentionConfig("mha"))
    return floor.to(model.dtype).eval()


def overhead_floor_ms(model: Decoder, mode: str, bucket: int, batch_size: int, impl: str,
                      device: torch.device, steps: int = 16) -> float:
    """Median decode step of :func:`floor_model` under the same ``runtime.compile``, batch and cache."""
    floor = floor_model(model)
    run_model, step = compiled_step(mode, floor, device, bucket)
    prompt = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    cache = cache_for(floor, impl, batch_size, 1 + steps)
    timings = time_decode(run_model, prompt, steps, cache, warmup=1, repeats=1, device=device, step=step)
    return median(timings.decode_ms[0])


def run(cfg: BenchConfig, model: Decoder, device: torch.device, result: RunResult,
        tick: Optional[Tick] = None) -> None:
    """Prefill then ``gen_len`` decode steps, ``warmup`` + ``repeats`` times; metrics into ``result`` as
    they are measured (a failure keeps them)."""
    w, rt = cfg.workload, cfg.runtime
    metrics = result.metrics
    result.methods.update(METHODS)
    seq_len = w.prompt_len + w.gen_len
    generator = torch.Generator().manual_seed(rt.seed)
    prompt = torch.randint(0, cfg.model.vocab_size, (w.batch_size, w.prompt_len), generator=generator)
    prompt = prompt.to(device)
    # what this run's cache holds: cache.impl=none holds nothing, and the layout's bytes beside
    # kv_cache_bytes=0 would contradict the allocation (and the plausibility check)
    metrics["kv_cache_bytes_formula"] = 0 if cfg.cache.impl == "none" else model.layouts.cache_bytes(
        seq_len, w.batch_size, DTYPE_BYTES[rt.dtype], cfg.cache.dtype)
    metrics["kv_quantized_layers"] = model.layouts.precision_text(cfg.cache.dtype, rt.dtype)
    with allocation_delta(device) as allocated:
        cache = cache_for(model, cfg.cache.impl, w.batch_size, seq_len, cfg.cache.dtype)
    if cfg.cache.impl != "static":  # the others allocate as they grow, not at creation
        allocated = {k: None for k in allocated}
        allocated["kv_cache_bytes_alloc_reason"] = (f"cache.impl={cfg.cache.impl} allocates per step; "
                                                    "measured for static only")
    metrics.update(allocated)
    run_model, step = compiled_step(rt.compile, model, device, rt.graph_bucket)
    compiled = rt.compile != "false"
    if compiled:
        # The whole decode, so that every shape (every context bucket) it meets is compiled before
        # timing; twice with CUDA graphs, which run a graph's first call eagerly and record the second.
        passes = 2 if getattr(step, "cuda_graphs", False) else 1
        metrics.update(compile_phase(lambda: [greedy_generate(run_model, prompt, w.gen_len, cache, step=step)
                                              for _ in range(passes)], device, rt.compile))
        graphs = compiled_graphs()
    # Warm-up outside the monitor: its one-off costs (kernel loading, per-shape plans: a GPU warm-up of
    # 1000 steps took ~45 s of 55) must not count in memory or energy.
    time_decode(run_model, prompt, w.gen_len, cache, rt.warmup, 0, device, tick, step)
    with MemoryMonitor(device, rt.nvml_interval_ms) as monitor, record_routing(model) as routing:
        timings = time_decode(run_model, prompt, w.gen_len, cache, 0, rt.repeats, device, tick, step, rt.min_time_s)
    if compiled:
        metrics["recompiles"] = compiled_graphs() - graphs
    metrics.update(monitor.result())
    tokens = w.batch_size * (w.gen_len + 1) * len(timings.decode_ms)
    timed_s = (sum(timings.prefill_ms) + sum(map(sum, timings.decode_ms))) / 1e3
    metrics["energy_mj_per_token"] = energy_per_token(metrics.get("energy_mj"), metrics.get("energy_span_s"),
                                                      timed_s, tokens)
    if metrics.get("energy_mj") == 0:
        metrics["energy_reason"] = ("the energy counter did not advance over the timed trials "
                                    "(too short for its update rate)")
    metrics["kv_cache_bytes"] = cache.nbytes
    metrics.update(summarize_decode(timings, w.batch_size))
    metrics.update(kv_cost())
    result.series["decode_ms"] = timings.decode_ms[-1]
    if device.type == "cuda":
        metrics["overhead_ms_per_step"] = median([ms for trial in timings.decode_host_ms for ms in trial])
    else:
        metrics["overhead_ms_per_step"] = overhead_floor_ms(model, rt.compile, rt.graph_bucket, w.batch_size,
                                                            cfg.cache.impl, device)
    metrics["overhead_share"] = metrics["overhead_ms_per_step"] / metrics["decode_ms_p50"]
    peaks = machine_peaks(device, rt.peak_gb_per_s, fresh=rt.probe == "run")
    metrics.update(peaks)
    # A fixed-shape step reads its whole context bucket, so that is what the roofline counts.
    positions = range(w.prompt_len, seq_len)
    kv_positions = statistics.mean(step.lengths(cache, positions)) if isinstance(step, FixedShapeStep) else None
    routed_bytes, routed = routed_steps(routing, w.gen_len, result)
    metrics.update(roofline_metrics(model, w.batch_size, w.prompt_len, w.gen_len, metrics["decode_ms_p50"],
                                    peaks["peak_gb_per_s"], peaks["peak_gflops"], kv_positions, cfg.cache.dtype,
                                    routed_bytes))
    metrics.update(attainable_metrics(metrics["decode_ms_p50"], probe_step_gemms(model, w.batch_size, device,
                                                                                 routed=routed),
                                      metrics["kv_bytes_read_per_step"], peaks["peak_gb_per_s"]))
    if rt.fidelity:
        # A compiled fixed-shape step is checked itself, on the cache it was compiled for.
        timed = {"step": step, "cache": cache} if isinstance(step, FixedShapeStep) else {}
        metrics.update(fidelity(model, prompt, w.gen_len, cfg.cache.impl, rt.dtype, cache_dtype=cfg.cache.dtype,
                                **timed))
