"""``workload=serving workload.search.enabled=true``: the highest arrival rate the variant serves
within the SLO (``slo.*``), by :func:`kvbench.serving.rate_search.max_rate_under_slo` over
serving runs of the workload's requests.

Every run serves the same ``workload.num_requests`` requests (lengths and token ids from
``workload.seed``; only their arrival times scale with the rate) from a fresh store of the same
KV budget, on the wall clock. A probe's metrics are :func:`~kvbench.serving.metrics.timeline_metrics`
without intervals; the curve of every probe is ``tables.serving_rate_curve``. Then the answer's
rate (or, when there is none, the highest rate that passed, else the lowest measured) is served
once more by :func:`kvbench.workloads.serving.run`, which records its timeline, metrics and series
as a plain serving run would: ``serving_recorded_rate`` names that rate, and
``max_rate_confirmed`` says whether this second run met the SLO again (a repeat, so noise shows).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable, Dict, Optional

import torch

from kvbench.config import BenchConfig
from kvbench.metrics import Metric, metric_table, record_methods
from kvbench.results import RunResult
from kvbench.serving import rate_search
from kvbench.serving.metrics import timeline_metrics
from kvbench.serving.paged import check_model
from kvbench.serving.scheduler import Scheduler
from kvbench.workloads import serving

Tick = Callable[..., None]

OWN_METRICS: Dict[str, Metric] = metric_table(
    Metric("serving_recorded_rate", "requests/s", "the rate of the run whose timeline, latency metrics and series "
                                                  "the record holds: max_rate_under_slo, else max_rate_at_least, "
                                                  "else the lowest rate measured (the config's workload.rate is not "
                                                  "it)"),
    Metric("max_rate_confirmed", "bool", "the recorded run at max_rate_under_slo met the SLO again (a second run "
                                         "at the same rate: false means the answer sits within the noise)"),
)
METRICS: Dict[str, Metric] = metric_table(*serving.METRICS.values(), *rate_search.METRICS.values(),
                                          *OWN_METRICS.values())
METHODS: Dict[str, str] = record_methods(METRICS)


def at_rate(cfg: BenchConfig, rate: float) -> BenchConfig:
    """``cfg`` with ``workload.rate`` = ``rate`` (nothing else re-resolved)."""
    out = copy.copy(cfg)
    out.workload = replace(cfg.workload, rate=rate)
    return out


def progress_total(cfg: BenchConfig) -> int:
    """Ticks a search gives at most: one per finished request of each run, the recorded run too."""
    return serving.progress_total(cfg) * (cfg.workload.search.max_runs + 1)


def run(cfg: BenchConfig, model, device: torch.device, result: RunResult, tick: Optional[Tick] = None) -> None:
    """Search the rate, record its curve, then serve the answer's rate once more as the record's run."""
    w, s = cfg.workload, cfg.workload.search
    check_model(model, cfg.cache.dtype)
    requests, prompts = serving.requests_and_prompts(cfg)
    serving.warm_up(model, cfg, requests, prompts)
    progress = (lambda: tick()) if tick is not None else None

    def measure(rate: float) -> Dict:
        at = at_rate(cfg, rate)
        reqs, toks = serving.requests_and_prompts(at)
        store = serving.build_store(model, at.workload, cfg.cache.block_size, reqs)
        timeline = Scheduler(model, store, reqs, toks, w.max_prefill_tokens, w.max_running, progress=progress).run()
        return timeline_metrics(timeline, cfg.slo, intervals=False)

    found = rate_search.max_rate_under_slo(measure, cfg.slo, s.min_rate, s.max_rate, s.growth, s.rel_tol, s.max_runs)
    recorded = found.max_rate or found.at_least or min(p.rate for p in found.curve)
    serving.run(at_rate(cfg, recorded), model, device, result, tick)
    result.methods.update(METHODS)
    result.metrics.update(rate_search.search_metrics(found), serving_recorded_rate=recorded,
                          max_rate_confirmed=result.metrics.get("slo_met") if found.max_rate else None)
    result.tables[rate_search.CURVE_TABLE] = rate_search.curve_rows(found)
