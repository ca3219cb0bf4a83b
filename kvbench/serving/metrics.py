"""What a serving run measured, computed from its :class:`~kvbench.serving.trace.Timeline` alone.

The definitions are the serving engines' (vLLM's ``benchmarks/serve.py`` ``calculate_metrics``,
which ``vllm bench serve`` runs), per finished request ``r`` with output tokens at ``t_1..t_n``:

- TTFT = ``t_1 - arrival``; E2E latency = ``t_n - arrival``;
- TPOT = ``(E2E - TTFT) / (n - 1)``, only for ``n > 1`` (a one-token output has none; for goodput
  it counts as 0, as vLLM's ``all_tpots`` does);
- ITL = every gap ``t_{i+1} - t_i``, pooled over requests;
- queueing time = first admission (``scheduled_s``) - arrival;
- request / output-token / total-token throughput: finished requests, their output tokens, their
  prompt + output tokens, over the benchmark duration (the run's start to its last token);
- goodput (vLLM's ``--goodput``): finished requests whose TTFT, TPOT and E2E are each at most the
  target given (``<=``, as ``s >= r`` there), per second of the same duration.

Unfinished requests are excluded from every latency and throughput figure. Percentiles are numpy's
``linear`` method (vLLM's ``np.percentile`` default); the intervals follow :mod:`kvbench.measure.stats`'
rule, by a moving-block bootstrap over requests in arrival order (a queue makes neighbours'
latencies alike) or, for ITL, over gaps within requests.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from kvbench.measure.stats import METHODS as STATS_METHODS
from kvbench.measure.stats import block_bootstrap_ci, degenerate, interval_reason, min_samples, percentile
from kvbench.metrics import Metric, metric_table
from kvbench.serving.trace import RequestTrace, Timeline

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")  # the targets goodput and the rate search judge by
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
CI_QUANTILES = ("p50", "p99")  # the quantiles that get an interval
LATENCIES = {  # name -> what it is, for the methods
    "ttft_ms": "time to first token: first output token - arrival",
    "tpot_ms": "time per output token after the first: (E2E - TTFT) / (output tokens - 1), per request with "
               "more than one output token",
    "itl_ms": "inter-token latency: every gap between consecutive output tokens, pooled over requests",
    "e2e_ms": "end-to-end latency: last output token - arrival",
    "queue_ms": "queueing time: first admission (prefill begins) - arrival",
}


def slo_targets(slo: Any) -> Dict[str, float]:
    """The targets of ``slo`` (a mapping or an ``SloConfig``) that are set."""
    if slo is None:
        return {}
    get = slo.get if isinstance(slo, Mapping) else (lambda k: getattr(slo, k, None))
    return {k: float(get(k)) for k in SLO_KEYS if get(k) is not None}


def _finished(timeline: Timeline) -> List[RequestTrace]:
    """Finished requests in arrival order (ties by id)."""
    return sorted((t for t in timeline.traces if t.finished), key=lambda t: (t.request.arrival_s, t.request.id))


def per_request(trace: RequestTrace) -> Dict[str, Optional[float]]:
    """One finished request's TTFT, TPOT (None for one output token), E2E and queueing time, ms."""
    arrival, tokens = trace.request.arrival_s, trace.token_s[:trace.request.output_len]
    ttft, e2e = tokens[0] - arrival, tokens[-1] - arrival
    return {"ttft_ms": 1e3 * ttft, "e2e_ms": 1e3 * e2e,
            "tpot_ms": 1e3 * (e2e - ttft) / (len(tokens) - 1) if len(tokens) > 1 else None,
            "queue_ms": 1e3 * (trace.scheduled_s - arrival) if trace.scheduled_s is not None else None}


def _quantiles(name: str, groups: Sequence[Sequence[float]], what: str, intervals: bool) -> Dict[str, Any]:
    """Mean and :data:`QUANTILES` of every value of ``groups`` with their sample counts, and the
    intervals of :data:`CI_QUANTILES` (bootstrap blocks are drawn within a group)."""
    values = [v for g in groups for v in g]
    n = len(values)
    out: Dict[str, Any] = {f"{name}_mean": float(np.mean(values)) if n else None}
    for tag, q in QUANTILES.items():
        key = f"{name}_{tag}"
        out[key] = percentile(values, q) if n else None
        out[f"{key}_n"] = n
        if tag not in CI_QUANTILES:
            continue
        low = high = None
        reason = interval_reason(n, q, what)
        if reason is None and not intervals:
            reason = "intervals not computed (intervals=False: a rate search's probe)"
        if reason is None:
            low, high = block_bootstrap_ci([g for g in groups if len(g)], q)
            if degenerate(out[key], low, high, len(set(values)) > 1):
                low = high = None
                reason = "degenerate interval (an end at the estimate)"
        out[f"{key}_ci_low"], out[f"{key}_ci_high"], out[f"{key}_ci_reason"] = low, high, reason
    return out


def quantiles_warning(metrics: Mapping[str, Any]) -> Optional[str]:
    """One line for every latency quantile computed from too few samples to be more than an extreme
    value, grouped by quantile (a run's quantiles share their requests, so they fall short together)."""
    parts = []
    for tag, q in QUANTILES.items():
        short = [(name, metrics[f"{name}_{tag}_n"]) for name in LATENCIES
                 if f"{name}_{tag}_n" in metrics and metrics[f"{name}_{tag}_n"] < min_samples(q)]
        if short:
            counts = sorted({n for _, n in short})
            parts.append(f"{tag} of {', '.join(name for name, _ in short)} from {'/'.join(map(str, counts))} samples "
                         f"(a {q:.0%} quantile needs {min_samples(q)})")
    if not parts:
        return None
    return "; ".join(parts) + ": each is little more than the run's extreme value (raise workload.num_requests)"


def _rate(count: float, duration_s: float) -> Optional[float]:
    return count / duration_s if duration_s > 0 else None


def good_request(row: Mapping[str, Optional[float]], targets: Mapping[str, float]) -> bool:
    """Whether one finished request meets every target (vLLM: a one-token output's TPOT is 0)."""
    return all((row[k] if row[k] is not None else 0.0) <= v for k, v in targets.items())


def timeline_metrics(timeline: Timeline, slo: Any = None, intervals: bool = True) -> Dict[str, Any]:
    """Every scalar metric of :data:`METRICS` from ``timeline``; ``slo`` sets goodput's targets.
    ``intervals=False`` skips the bootstraps (a rate search's probes)."""
    finished = _finished(timeline)
    rows = [per_request(t) for t in finished]
    total, done = len(timeline.traces), len(finished)
    unfinished = total - done
    out: Dict[str, Any] = {
        "requests": total, "requests_finished": done, "requests_unfinished": unfinished,
        "requests_never_scheduled": sum(t.scheduled_s is None for t in timeline.traces),
        "requests_unfinished_reason": (
            f"{unfinished} of {total} requests had not produced all their output tokens when the run ended: "
            "excluded from every latency, throughput and goodput figure" if unfinished else None),
        "duration_s": float(timeline.duration_s),
    }
    what = "finished requests"
    for name in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        values = [r[name] for r in rows if r[name] is not None]
        out.update(_quantiles(name, [values], what if name != "tpot_ms" else "requests with > 1 output token",
                              intervals))
    gaps = [list(np.diff(t.token_s[:t.request.output_len]) * 1e3) for t in finished]
    out.update(_quantiles("itl_ms", [[float(g) for g in gs] for gs in gaps], "token gaps", intervals))
    out["quantiles_warning"] = quantiles_warning(out)

    output_tokens = sum(t.request.output_len for t in finished)
    prompt_tokens = sum(t.request.prompt_len for t in finished)
    out.update(request_throughput=_rate(done, timeline.duration_s),
               output_throughput=_rate(output_tokens, timeline.duration_s),
               total_token_throughput=_rate(prompt_tokens + output_tokens, timeline.duration_s),
               output_tokens=output_tokens)

    targets = slo_targets(slo)
    good = sum(good_request(r, targets) for r in rows) if targets else None
    out.update(good_requests=good, goodput=_rate(good, timeline.duration_s) if targets else None,
               goodput_slo=", ".join(f"{k} <= {v:g}" for k, v in targets.items()) or None,
               goodput_reason=None if targets else "no SLO target given (slo.ttft_ms / tpot_ms / e2e_ms all null)")

    out["preemptions"] = sum(t.preemptions for t in timeline.traces)
    hits = sum(t.prefix_hit_tokens for t in timeline.traces)
    queries = sum(t.prefix_query_tokens for t in timeline.traces)
    out.update(prefix_hit_tokens=hits, prefix_query_tokens=queries,
               prefix_hit_rate=hits / queries if queries else None)
    out.update(block_metrics(timeline))
    missed = slo_violations(out, slo) if targets else []
    out.update(slo_met=not missed if targets else None, slo_missed=", ".join(missed) or None)
    return out


def block_metrics(timeline: Timeline) -> Dict[str, Any]:
    """Block waste over the samples against its bound, and the peaks of the series."""
    s = timeline.samples
    waste = [x.kv_bytes_used - x.kv_bytes_needed for x in s]
    # a sequence's last block holds at least one token: at most block_size - 1 empty slots each
    # (the bound of an older record, which has no plan's bound of its own)
    per_sequence = timeline.waste_per_sequence
    if per_sequence is None:
        per_sequence = (timeline.block_size - 1) * timeline.bytes_per_token
    bound = [per_sequence * x.running for x in s]
    return {
        "samples": len(s),
        "block_waste_bytes_mean": float(np.mean(waste)) if s else None,
        "block_waste_bytes_max": int(max(waste)) if s else None,
        "block_waste_bound_bytes_max": int(max(bound)) if s else None,
        "block_waste_within_bound": all(w <= b for w, b in zip(waste, bound)) if s else None,
        "block_waste_over_bound_samples": sum(w > b for w, b in zip(waste, bound)),
        "kv_blocks_used_max": max((x.kv_blocks_used for x in s), default=None),
        "kv_blocks_total": timeline.kv_blocks_total,
        "kv_block_usage_max": (max(x.kv_blocks_used for x in s) / timeline.kv_blocks_total
                               if s and timeline.kv_blocks_total else None),
        "running_max": max((x.running for x in s), default=None),
        "waiting_max": max((x.waiting for x in s), default=None),
        "block_size": timeline.block_size,
        "kv_store": timeline.store,
    }


def timeline_series(timeline: Timeline) -> Dict[str, List[float]]:
    """The scheduler's state over time, one value per sample (a record's ``series``)."""
    s = timeline.samples
    return {"serving_t_s": [x.t_s for x in s], "serving_running": [x.running for x in s],
            "serving_waiting": [x.waiting for x in s], "serving_kv_blocks_used": [x.kv_blocks_used for x in s],
            "serving_block_waste_bytes": [x.kv_bytes_used - x.kv_bytes_needed for x in s]}


def slo_violations(metrics: Mapping[str, Any], slo: Any, stat: Optional[str] = None) -> List[str]:
    """Which targets of ``slo`` a run's ``stat`` (default ``slo.stat``, else p99) misses; ``unfinished``
    when requests did not finish (their latency is unknown); a null statistic misses nothing."""
    stat = stat or (slo.get("stat") if isinstance(slo, Mapping) else getattr(slo, "stat", None)) or "p99"
    missed = [k for k, v in slo_targets(slo).items() if (metrics.get(f"{k}_{stat}") or 0.0) > v]
    if metrics.get("requests_unfinished"):
        missed.append("unfinished")
    return missed


def _latency_metrics(name: str, what: str) -> List[Metric]:
    out = [Metric(f"{name}_mean", "ms", f"mean {what}, over finished requests")]
    for tag, q in QUANTILES.items():
        key = f"{name}_{tag}"
        out += [Metric(key, "ms", f"{what}: {q:.0%} quantile over finished requests ({STATS_METHODS['percentiles']}; "
                                  "vLLM bench serve's np.percentile)"),
                Metric(f"{key}_n", "count", f"samples {key} is computed from")]
        if tag in CI_QUANTILES:
            out += [Metric(f"{key}_ci_low", "ms", f"low end of the 95% interval of {key}: moving-block bootstrap "
                                                  "(blocks of round(n^(1/3)), 2000 resamples, seed 0) over requests "
                                                  "in arrival order (ITL: over gaps within requests)"),
                    Metric(f"{key}_ci_high", "ms", f"high end of the 95% interval of {key} (as {key}_ci_low)"),
                    Metric(f"{key}_ci_reason", "text", f"why {key}_ci_low/_ci_high are null: fewer samples than "
                                                       "the interval needs (measure/stats.py min_interval_samples), "
                                                       "a degenerate interval, or intervals not computed")]
    return out


METRICS: Dict[str, Metric] = metric_table(
    Metric("requests", "count", "requests the arrival process sent"),
    Metric("requests_finished", "count", "requests that produced all their output tokens"),
    Metric("requests_unfinished", "count", "requests still waiting or running when the run ended: excluded from "
                                           "every latency, throughput and goodput figure"),
    Metric("requests_never_scheduled", "count", "requests never admitted (no prefill began)"),
    Metric("requests_unfinished_reason", "text", "present when requests_unfinished > 0: says they are excluded"),
    Metric("duration_s", "s", "benchmark duration: the run's start to its last output token (vLLM's dur_s)"),
    *(m for name, what in LATENCIES.items() for m in _latency_metrics(name, what)),
    Metric("quantiles_warning", "text", "the latency quantiles computed from fewer samples than they need to be more "
                                        "than an extreme value (<name>_n < 10 for a p90, 100 for a p99), in one line; "
                                        "null when every one has enough"),
    Metric("request_throughput", "requests/s", "finished requests / duration_s"),
    Metric("output_throughput", "tokens/s", "output tokens of finished requests / duration_s"),
    Metric("total_token_throughput", "tokens/s", "prompt + output tokens of finished requests / duration_s"),
    Metric("output_tokens", "tokens", "output tokens of finished requests"),
    Metric("good_requests", "count", "finished requests whose TTFT, TPOT and E2E are each <= the SLO target given "
                                     "(a one-token output's TPOT counts as 0, as in vLLM); null without targets"),
    Metric("goodput", "requests/s", "good_requests / duration_s (vLLM bench serve --goodput); null without targets"),
    Metric("goodput_slo", "text", "the targets goodput was judged by"),
    Metric("goodput_reason", "text", "why goodput is null: no SLO target given"),
    Metric("slo_met", "bool", "the run's slo.stat (default p99) of TTFT, TPOT and E2E each <= its target, and every "
                              "request finished (slo_violations); null without targets"),
    Metric("slo_missed", "text", "the targets the run missed (ttft_ms, tpot_ms, e2e_ms, unfinished)"),
    Metric("preemptions", "count", "evictions of a running request (its KV freed, recomputed later), all requests"),
    Metric("prefix_hit_tokens", "tokens", "prompt tokens found in the prefix cache, all requests"),
    Metric("prefix_query_tokens", "tokens", "prompt tokens looked up in the prefix cache, all requests"),
    Metric("prefix_hit_rate", "ratio", "prefix_hit_tokens / prefix_query_tokens (vLLM's prefix cache hit rate); "
                                       "null when nothing was looked up"),
    Metric("samples", "count", "scheduler iterations sampled (one per iteration)"),
    Metric("block_waste_bytes_mean", "bytes", "mean over samples of KV bytes the store holds room for minus the "
                                              "bytes the formula gives for the tokens held"),
    Metric("block_waste_bytes_max", "bytes", "largest block waste of any sample (as block_waste_bytes_mean)"),
    Metric("block_waste_bound_bytes_max", "bytes", "largest bound of any sample: block_waste_per_sequence_bytes x "
                                                   "running sequences"),
    Metric("block_waste_per_sequence_bytes", "bytes", "the most one running sequence's pages reserve beyond the "
                                                      "formula: per K/V group a page less one position ((block_size "
                                                      "- 1) x its bytes per position, plus a page's room raised to "
                                                      "hold a state), per state group a page less its state"),
    Metric("block_waste_within_bound", "bool", "every sample's waste <= its own bound"),
    Metric("block_waste_over_bound_samples", "count", "samples whose waste exceeded their bound (0 when accounted "
                                                      "right)"),
    Metric("kv_blocks_used_max", "count", "most KV blocks (slots, for a slot store) in use at any sample"),
    Metric("kv_blocks_total", "count", "the store's capacity in blocks (slots)"),
    Metric("kv_block_usage_max", "ratio", "kv_blocks_used_max / kv_blocks_total"),
    Metric("running_max", "count", "most requests running at any sample"),
    Metric("waiting_max", "count", "most requests waiting at any sample"),
    Metric("block_size", "tokens", "tokens per KV block (a slot store: the slot's length)"),
    Metric("kv_store", "text", "the KV store: paged (blocks on demand) or slots (a static cache's rows)"),
    Metric("series.serving_t_s", "s", "each sample's time since the run's start (one sample per iteration)"),
    Metric("series.serving_running", "count", "requests running at each sample"),
    Metric("series.serving_waiting", "count", "requests waiting at each sample"),
    Metric("series.serving_kv_blocks_used", "count", "KV blocks in use at each sample"),
    Metric("series.serving_block_waste_bytes", "bytes", "block waste at each sample (kv_bytes_used - kv_bytes_needed)"),
)
