"""The highest request rate a variant serves within an SLO: a pure search over ``measure(rate)``.

As vLLM's SLA sweep (``vllm bench sweep serve_sla``) it assumes the SLO's statistics (p99 TTFT,
TPOT, E2E by default: ``slo.stat``) get worse as the rate rises, and finds where they cross their
targets; unlike it, it brackets and bisects instead of interpolating a spline, so each answer is a
rate that was measured to pass, next to one measured to fail:

1. measure ``lo``; a failure there ends the search (no rate in the range meets the SLO);
2. gallop upward by ``growth`` (``lo``, ``2 lo``, ``4 lo``, ... up to ``hi``) until a rate fails;
   none failing up to ``hi`` ends it too (the SLO never binds: the answer is at least ``hi``);
3. measure one rate above the first failure (``check_above``): a pass there is noise or a
   non-monotone system, reported, never taken as the answer;
4. bisect (geometrically: rates span decades) between the highest pass and the lowest failure
   until their ratio is within ``1 + rel_tol`` or ``max_probes`` runs were made.

The answer is the highest passing rate below the lowest failing one, whatever order they were
measured in: a pass above a failure does not move it (``non_monotone`` lists such passes).
``measure`` is the only side effect; the curve of every (rate, metrics) it returned is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from kvbench.metrics import Metric, metric_table
from kvbench.serving.metrics import slo_targets, slo_violations


@dataclass
class RatePoint:
    """One serving run at ``rate`` requests/s: its metrics and the targets it missed."""

    rate: float
    metrics: Dict[str, Any]
    violated: List[str]

    @property
    def ok(self) -> bool:
        return not self.violated


@dataclass
class RateSearch:
    """What :func:`max_rate_under_slo` found: ``bound`` is the targets the lowest failing rate missed
    (what sets the limit); ``curve`` every point in the order measured."""

    max_rate: Optional[float]
    failed_at: Optional[float]
    bound: List[str]
    reason: Optional[str]
    at_least: Optional[float] = None
    non_monotone: List[float] = field(default_factory=list)
    curve: List[RatePoint] = field(default_factory=list)

    @property
    def resolution(self) -> Optional[float]:
        """``failed_at / max_rate``: how far the true limit may lie above the answer."""
        return self.failed_at / self.max_rate if self.max_rate and self.failed_at else None


def _check(lo: float, hi: float, growth: float, rel_tol: float, max_probes: int) -> None:
    if not (lo > 0 and math.isfinite(hi) and hi > lo):
        raise ValueError(f"rate range lo={lo}, hi={hi}: must be 0 < lo < hi, finite")
    if growth <= 1 or rel_tol <= 0 or max_probes < 2:
        raise ValueError(f"growth={growth}, rel_tol={rel_tol}, max_probes={max_probes}: need growth > 1, "
                         "rel_tol > 0, max_probes >= 2")


def max_rate_under_slo(measure: Callable[[float], Mapping[str, Any]], slo: Any, lo: float, hi: float,
                       growth: float = 2.0, rel_tol: float = 0.1, max_probes: int = 10,
                       check_above: bool = True) -> RateSearch:
    """The largest rate in [``lo``, ``hi``] whose run meets every target of ``slo``, to within
    ``1 + rel_tol``, in at most ``max_probes`` calls of ``measure(rate) -> metrics``."""
    _check(lo, hi, growth, rel_tol, max_probes)
    if not slo_targets(slo):
        raise ValueError("the rate search needs an SLO target: set slo.ttft_ms, slo.tpot_ms or slo.e2e_ms")
    curve: List[RatePoint] = []

    def run(rate: float) -> RatePoint:
        metrics = dict(measure(rate))
        point = RatePoint(rate, metrics, slo_violations(metrics, slo))
        curve.append(point)
        return point

    def passes_below_fail():
        fails = [p.rate for p in curve if not p.ok]
        lowest_fail = min(fails, default=None)
        passes = [p.rate for p in curve if p.ok and (lowest_fail is None or p.rate < lowest_fail)]
        return max(passes, default=None), lowest_fail

    first = run(lo)
    if not first.ok:
        return RateSearch(None, lo, first.violated, curve=curve,
                          reason=f"fails even at the lowest rate searched, {lo:g} req/s (missed: "
                                 f"{', '.join(first.violated)}): lower the range's lowest rate or relax the SLO")
    rate = lo
    while len(curve) < max_probes:  # gallop
        rate = min(hi, rate * growth)
        if not run(rate).ok or rate >= hi:
            break
    good, bad = passes_below_fail()
    if bad is None:
        return RateSearch(None, None, [], at_least=good, curve=curve,
                          reason=f"the SLO never binds within the range: every rate measured up to {good:g} req/s "
                                 "met it (raise the range's highest rate)" if good >= hi else
                          f"stopped after {len(curve)} runs (the probe limit) at {good:g} req/s, all passing, "
                          f"below the range's highest rate {hi:g}: raise the probe limit")
    if check_above and bad < hi and len(curve) < max_probes:
        run(min(hi, bad * growth))
    while len(curve) < max_probes:  # bisect
        good, bad = passes_below_fail()
        if bad / good <= 1 + rel_tol:
            break
        run(math.sqrt(good * bad))
    good, bad = passes_below_fail()
    fail_point = next(p for p in curve if p.rate == bad and not p.ok)
    return RateSearch(good, bad, fail_point.violated, reason=None, curve=curve,
                      non_monotone=sorted(p.rate for p in curve if p.ok and p.rate > bad))


CURVE_TABLE = "serving_rate_curve"
# What the record keeps of a point of the curve (tables.serving_rate_curve), beside rate, ok and
# violated; tokens/s per user is one user's stream: 1000 / its median TPOT.
CURVE_COLUMNS = ("requests_finished", "requests_unfinished", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                 "tpot_ms_p99", "itl_ms_p99", "e2e_ms_p99", "queue_ms_p99", "request_throughput",
                 "output_throughput", "goodput", "preemptions", "running_max", "kv_block_usage_max")


def curve_rows(search: RateSearch) -> List[Dict[str, Any]]:
    """The curve as a record's table, one row per rate, in rate order."""
    rows = []
    for p in sorted(search.curve, key=lambda p: p.rate):
        tpot = p.metrics.get("tpot_ms_p50")
        rows.append({"rate": p.rate, "ok": p.ok, "violated": ", ".join(p.violated) or None,
                     **{k: p.metrics.get(k) for k in CURVE_COLUMNS},
                     "tokens_per_s_per_user": 1e3 / tpot if tpot else None})
    return rows


def search_metrics(search: RateSearch) -> Dict[str, Any]:
    """The search's scalars for a record (see :data:`METRICS`)."""
    return {"max_rate_under_slo": search.max_rate, "max_rate_under_slo_reason": search.reason,
            "max_rate_at_least": search.at_least, "max_rate_failed_at": search.failed_at,
            "max_rate_bound": ", ".join(search.bound) or None, "max_rate_resolution": search.resolution,
            "max_rate_probes": len(search.curve), "max_rate_non_monotone": len(search.non_monotone),
            "max_rate_non_monotone_rates": (", ".join(f"{r:g}" for r in search.non_monotone) or None)}


METRICS: Dict[str, Metric] = metric_table(
    Metric("max_rate_under_slo", "requests/s", "the highest arrival rate measured to meet every SLO target (the "
                                               "slo.stat of TTFT / TPOT / E2E, all requests finished), below the "
                                               "lowest rate measured to fail: gallop by serving.search_growth from "
                                               "the range's lowest rate, then geometric bisection; null with a reason "
                                               "when the range's lowest rate fails or no rate in the range fails"),
    Metric("max_rate_under_slo_reason", "text", "why max_rate_under_slo is null"),
    Metric("max_rate_at_least", "requests/s", "when no rate in the range failed: the highest rate measured (all "
                                              "passed; the limit lies above it)"),
    Metric("max_rate_failed_at", "requests/s", "the lowest rate measured to fail the SLO"),
    Metric("max_rate_bound", "text", "the targets the failing rate missed: what sets the limit (ttft_ms, tpot_ms, "
                                     "e2e_ms, unfinished)"),
    Metric("max_rate_resolution", "ratio", "max_rate_failed_at / max_rate_under_slo: the true limit lies between"),
    Metric("max_rate_probes", "count", "serving runs the search made"),
    Metric("max_rate_non_monotone", "count", "rates that passed above a failing rate (noise or a non-monotone "
                                             "system); never taken as the answer"),
    Metric("max_rate_non_monotone_rates", "text", "those rates"),
    Metric("tables.serving_rate_curve", "", "one row per rate the search measured: rate, ok, violated, p50/p99 "
                                            "TTFT and TPOT, p99 ITL / E2E / queueing, throughputs, goodput, "
                                            "preemptions, peak running and KV block usage, tokens_per_s_per_user "
                                            "(1000 / p50 TPOT)"),
)
