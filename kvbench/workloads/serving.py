"""The serving workload (``workload=serving``): requests arrive open-loop (Poisson, gamma with a
burstiness, or a trace file; :mod:`kvbench.serving.arrivals`) and a continuous-batching scheduler
(:mod:`kvbench.serving.scheduler`) serves them from a KV store of a fixed memory budget, paged
blocks of ``cache.block_size`` tokens or one static slot per request (:mod:`kvbench.serving.paged`).

The same ``workload.seed`` gives every variant the same requests (times, lengths, token ids); the
budget in bytes is the same too, so a layout with a smaller K/V per token gets more blocks, runs
more requests at once and preempts fewer. The record holds the whole timeline
(:mod:`kvbench.serving.record`: tables ``serving_requests``, ``serving_tokens``, ``serving_samples``),
the metrics computed from it (:mod:`kvbench.serving.metrics`: TTFT, TPOT, ITL, E2E, throughput,
goodput against ``slo.*``, preemptions, prefix hit rate, block waste) and its series.

``runtime.warmup`` untimed passes serve the first two requests on a scratch store (kernels and
allocator warmed, nothing of it recorded); then one timed run on the wall clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvbench.config.bench import BenchConfig
from kvbench.config.errors import ConfigError
from kvbench.config.serving import duration_text, kv_budget_note
from kvbench.footprint import kv_bytes_per_token
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.results import RunResult
from kvbench.serving import metrics as serving_metrics
from kvbench.serving.arrivals import make_requests, request_tokens
from kvbench.serving.paged import PagedStore, SlotStore, bytes_per_token, check_model
from kvbench.serving.rate_search import METRICS as SEARCH_METRICS
from kvbench.serving.rate_search import curve_rows, max_rate_under_slo, search_metrics
from kvbench.serving.record import timeline_scalars, timeline_tables
from kvbench.serving.scheduler import FakeClock, Scheduler
from kvbench.serving.trace import Request

Tick = Callable[..., None]

OWN_METRICS: Dict[str, Metric] = metric_table(
    Metric("kv_budget_bytes", "bytes", "the KV memory the store may hold: workload.kv_budget_mb x 1e6, or "
                                       "workload.kv_budget_blocks x the bytes of a block"),
    Metric("kv_bytes_per_token", "bytes", "the KV formula's bytes for one token of one sequence, all layers "
                                          "(the layer layouts' formula at seq_len 1)"),
    Metric("kv_store_bytes", "bytes", "K/V storage the store allocated (untyped_storage().nbytes(), all blocks)"),
    Metric("kv_store_bytes_formula", "bytes", "the KV formula for kv_blocks_total x block_size positions"),
    Metric("iterations", "count", "scheduler iterations (one batched decode and the prefill chunks each)"),
    Metric("timeline_rate", "requests/s", "the arrival rate of the run whose timeline the record holds: "
                                          "workload.rate, or with workload.search.enabled the search's answer (else "
                                          "the highest rate that passed, else the lowest tried)"),
    Metric("tables.serving_requests", "", "one row per request: id, arrival_s, prompt_len, output_len, prefix_id, "
                                          "prefix_len, scheduled_s (first admission), first_token_s, last_token_s, "
                                          "output_tokens, preemptions, prefix_hit_tokens, prefix_query_tokens"),
    Metric("tables.serving_tokens", "s", "every output token's time since the run's start (request, t_s)"),
    Metric("tables.serving_samples", "", "the scheduler after each iteration: t_s, running, waiting, "
                                         "kv_blocks_used, kv_bytes_used, kv_bytes_needed (the formula's bytes "
                                         "for the positions held)"),
)
METRICS: Dict[str, Metric] = metric_table(*serving_metrics.METRICS.values(), *OWN_METRICS.values(),
                                          *SEARCH_METRICS.values())
METHODS: Dict[str, str] = record_methods(METRICS)
RECORDED = METRICS  # what a record may hold
WARMUP_REQUESTS = 2


def slot_len_for(w, requests: Sequence[Request]) -> int:
    """Positions per slot: ``workload.slot_len``, or the longest request's (prompt + output - 1:
    the last output token is never fed back)."""
    longest = max(r.prompt_len + r.output_len - 1 for r in requests)
    if w.slot_len is None:
        return longest
    if w.slot_len < longest:
        raise ConfigError(f"workload.slot_len={w.slot_len}: a request needs {longest} positions; raise it or "
                          "use workload.slot_len=null (the longest request's)")
    return w.slot_len


def store_size(w, block_size: int, requests: Sequence[Request], per_token: int) -> tuple[int, int]:
    """(blocks, tokens per block) of the store ``w`` asks for (slots, and positions per slot, for
    ``store=slots``), as many as the budget holds at ``per_token`` KV bytes a token; a budget that
    cannot hold the largest request is a one-line :class:`ConfigError` naming the budget's key."""
    paged = w.store == "paged"
    size = block_size if paged else slot_len_for(w, requests)
    block_bytes = size * per_token
    blocks = (w.kv_budget_blocks if w.kv_budget_blocks is not None
              else int(w.kv_budget_mb * 1e6 // block_bytes))
    unit = f"blocks of {size} tokens" if paged else f"slots of {size} positions"
    need = max(-(-(r.prompt_len + r.output_len - 1) // size) for r in requests)
    largest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if blocks < need:
        raise ConfigError(f"{kv_budget_note(w.kv_budget_mb, w.kv_budget_blocks)}: holds {blocks} {unit} "
                          f"({block_bytes:,} bytes each for this layout); request {largest.id} "
                          f"(prompt {largest.prompt_len} + output {largest.output_len} tokens) needs {need}; raise it")
    return blocks, size


def build_store(model, w, block_size: int, requests: Sequence[Request]) -> PagedStore:
    """The store ``w`` asks for (:func:`store_size`) on ``model``."""
    blocks, size = store_size(w, block_size, requests, bytes_per_token(model))
    return (PagedStore(model, blocks, size, w.prefix_caching) if w.store == "paged"
            else SlotStore(model, blocks, size))


def check_requests(cfg: BenchConfig) -> List[Request]:
    """The run's requests, checked against the model's config and the KV budget before anything
    is built (or any progress shown): a trace that cannot be read, a request longer than
    ``model.max_seq_len``, a budget that cannot hold the largest request are one line each."""
    requests = _checked_requests(cfg, cfg.workload)
    store_size(cfg.workload, cfg.cache.block_size, requests, kv_bytes_per_token(cfg))
    return requests


def _checked_requests(cfg: BenchConfig, w) -> List[Request]:
    requests = make_requests(w)
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > cfg.model.max_seq_len:
        key = "workload.trace" if w.arrival == "trace" else "workload.prompt"
        raise ConfigError(f"{key}: request {longest.id} needs {longest.prompt_len} + {longest.output_len} positions, "
                          f"more than model.max_seq_len={cfg.model.max_seq_len}")
    return requests


def arrival_note(requests: Sequence[Request]) -> str:
    """`` (arrivals over ~12 min)`` when the requests arrive over a minute or more, so that a run
    that waits for them says so as it starts; empty otherwise."""
    span = max(r.arrival_s for r in requests)
    return f" (arrivals over ~{duration_text(span)})" if span >= 60 else ""


def requests_and_prompts(cfg: BenchConfig, rate: Optional[float] = None) -> tuple[List[Request], List[List[int]]]:
    """The run's requests (at ``rate``, default ``workload.rate``) and their prompt token ids (from
    ``workload.seed``), checked against the model. The same seed at another rate gives the same
    requests with every gap scaled by the ratio of the rates (numpy draws gaps as scale x a
    standard draw)."""
    w = cfg.workload if rate is None else replace(cfg.workload, rate=rate)
    requests = _checked_requests(cfg, w)
    return requests, [request_tokens(r, cfg.model.vocab_size, w.seed) for r in requests]


def progress_total(cfg: BenchConfig, requests: Sequence[Request]) -> int:
    """Ticks a run of ``requests`` gives: one per finished request (a rate search: of every probe, at most)."""
    probes = cfg.workload.search.max_probes if cfg.workload.search.enabled else 1
    return probes * len(requests)


def warm_up(model, cfg: BenchConfig, requests: Sequence[Request], prompts: Sequence[List[int]]) -> None:
    """Serve the first requests untimed on a scratch store (a fake clock: nothing waits)."""
    first = [replace(r, arrival_s=0.0) for r in requests[:WARMUP_REQUESTS]]
    for _ in range(cfg.runtime.warmup):
        w = replace(cfg.workload, kv_budget_mb=None, kv_budget_blocks=sum(
            -(-(r.prompt_len + r.output_len) // cfg.cache.block_size) for r in first), prefix_caching=False,
            slot_len=None)
        store = build_store(model, w, cfg.cache.block_size, first)
        Scheduler(model, store, first, prompts[:WARMUP_REQUESTS], cfg.workload.max_prefill_tokens,
                  cfg.workload.max_running, FakeClock()).run()


def serve_at(cfg: BenchConfig, model, rate: Optional[float] = None, progress=None) -> tuple:
    """One serving run at ``rate`` (default ``workload.rate``) on a fresh store: (scheduler, timeline, store)."""
    w = cfg.workload
    requests, prompts = requests_and_prompts(cfg, rate)
    store = build_store(model, w, cfg.cache.block_size, requests)
    scheduler = Scheduler(model, store, requests, prompts, w.max_prefill_tokens, w.max_running, progress=progress)
    return scheduler, scheduler.run(), store


def run(cfg: BenchConfig, model, device: torch.device, result: RunResult, tick: Optional[Tick] = None) -> None:
    """Build the arrivals and the store, serve them (at ``workload.rate``, or at each rate of a rate
    search), and record the timeline and its metrics."""
    w, metrics = cfg.workload, result.metrics
    result.methods.update(METHODS)
    check_model(model, cfg.cache.dtype)
    requests, prompts = requests_and_prompts(cfg)
    store = build_store(model, w, cfg.cache.block_size, requests)  # checked before the build (check_requests)
    element = torch.empty((), dtype=model.dtype).element_size()
    metrics.update(kv_budget_bytes=(int(w.kv_budget_mb * 1e6) if w.kv_budget_mb is not None
                                    else store.num_blocks * store.block_size * store.bytes_per_token),
                   kv_store_bytes=store.nbytes,
                   kv_store_bytes_formula=model.layouts.cache_bytes(store.num_blocks * store.block_size, 1,
                                                                    element))
    del store
    warm_up(model, cfg, requests, prompts)
    progress = (lambda: tick()) if tick is not None else None
    runs: Dict[float, tuple] = {}
    if w.search.enabled:
        def measure(rate: float) -> Dict:
            runs[rate] = serve_at(cfg, model, rate, progress)[:2]
            return serving_metrics.timeline_metrics(runs[rate][1], cfg.slo, intervals=False)

        s = w.search
        search = max_rate_under_slo(measure, cfg.slo, s.lo, s.hi, s.growth, s.rel_tol, s.max_probes, s.check_above)
        result.tables["serving_rate_curve"] = curve_rows(search)
        metrics.update(search_metrics(search))
        rate = search.max_rate or search.at_least or s.lo
        scheduler, timeline = runs[rate]
    else:
        rate = w.rate
        scheduler, timeline, _ = serve_at(cfg, model, None, progress)
    metrics["timeline_rate"] = rate
    metrics["iterations"] = scheduler.iterations
    metrics.update(timeline_scalars(timeline))
    result.tables.update(timeline_tables(timeline))
    metrics.update(serving_metrics.timeline_metrics(timeline, cfg.slo))
    result.series.update(serving_metrics.timeline_series(timeline))
