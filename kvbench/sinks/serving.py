"""What the serving records hold for the report: every run's point (rate, latency, throughput) and
the highest rate each variant serves within its SLO; the plots are :mod:`kvbench.sinks.serving_plots`'.

A point is one serving run at one rate: a row of a rate search's ``tables.serving_rate_curve``, or
a record's own metrics at its ``workload.rate``. Points are grouped like every other plot: a panel
per combination of the other swept axes, a line per attention variant. Both served workloads are
read (:data:`SERVED`: ``workload=serving`` and ``workload=conversations``, whose rate is
conversations per second); records of both get a panel per workload.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvbench.sinks.markdown import md_text
from kvbench.sinks.tables import VARIANT_KEYS, Axis, Record, fmt, natural
from kvbench.sinks.views import RecordView, Variant

SERVED = ("serving", "conversations")  # the workloads served by the continuous-batching scheduler
RATE_KEY = "workload.rate"
CURVE_TABLE = "serving_rate_curve"
_NOT_PANEL = VARIANT_KEYS + ("task", "workload.name", RATE_KEY)
_ROW_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "output_throughput", "request_throughput",
             "goodput")
Curves = Dict[str, Dict[str, List[Dict[str, Any]]]]  # panel -> variant -> rows sorted by rate


# numbers (or null) in every rate-curve row and in the metrics
_ROW_NUMBERS = _ROW_KEYS + ("tokens_per_s_per_user",)
_SEARCH_NUMBERS = ("max_rate_under_slo", "max_rate_failed_at", "max_rate_at_least", "max_rate_probes")


def _ok_serving(records: Sequence[Record]) -> List[RecordView]:
    return [r for r in map(RecordView.of, records) if r.kind in SERVED and r.ok]


def serving_records(records: Sequence[Record]) -> List[Record]:
    """The ok ``workload=serving`` and ``workload=conversations`` records that are :func:`well_formed`."""
    return [r for r in _ok_serving(records) if well_formed(r)]


def malformed(records: Sequence[Record]) -> int:
    """How many ok serving records :func:`serving_records` leaves out (not :func:`well_formed`)."""
    return sum(not well_formed(r) for r in _ok_serving(records))


def _number(value: Any, none: bool = True) -> bool:
    if value is None:
        return none
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def well_formed(rec: Record) -> bool:
    """An ok serving record whose rates, latencies and throughputs are numbers or null (a record read
    back is checked, not trusted): one that is not would sort text against numbers in the plots."""
    view = RecordView.of(rec)
    raw = (view.to_dict().get("tables") or {}).get(CURVE_TABLE)
    rows = view.table(CURVE_TABLE)
    if raw is not None and (not isinstance(raw, list) or len(raw) != len(rows)):
        return False  # rows that are no mapping: the view leaves them out
    if not all(_number(r.get("rate"), none=False) and r["rate"] > 0 and r.get("ok") in (None, True, False)
               and all(_number(r.get(k)) for k in _ROW_NUMBERS) for r in rows):
        return False
    rate = view.get(RATE_KEY)
    return ((rate is None or (_number(rate) and rate > 0))
            and all(_number(view.metric(k)) for k in _ROW_KEYS + _SEARCH_NUMBERS))


def _m(rec: Record, key: str) -> Any:
    return RecordView.of(rec).metric(key)


def points(rec: Record) -> List[Dict[str, Any]]:
    """One record's runs: its rate curve's rows, or its own metrics at ``workload.rate``."""
    rows = RecordView.of(rec).table(CURVE_TABLE)
    if rows:
        return [dict(r) for r in rows]
    rate = RecordView.of(rec).get(RATE_KEY)
    if rate is None:
        return []
    tpot = _m(rec, "tpot_ms_p50")
    return [{"rate": rate, "ok": _m(rec, "slo_met"), "violated": _m(rec, "slo_missed"),
             **{k: _m(rec, k) for k in _ROW_KEYS}, "tokens_per_s_per_user": 1e3 / tpot if tpot else None}]


def _panel_axes(records: Sequence[Record], axes: Sequence[Axis]) -> List[Axis]:
    shown = [(key, title) for key, title in axes if key not in _NOT_PANEL and not key.startswith("workload.search")
             and len({repr(RecordView.of(r).get(key)) for r in records}) > 1]
    if len({RecordView.of(r).kind for r in records}) > 1:  # requests and conversations per second: never one line
        shown.insert(0, ("workload.name", "workload"))
    return shown


def panel_title(record: Record, axes: Sequence[Axis]) -> str:
    """``model=tiny store=paged``: the record's values of ``axes`` (those it has)."""
    values = [(title, RecordView.of(record).get(key)) for key, title in axes]
    return " ".join(f"{title}={value}" for title, value in values if value is not None)


def curves(records: Sequence[Record], axes: Sequence[Axis]) -> Curves:
    """panel -> variant -> every run's row, sorted by rate (one row per rate: the first record's)."""
    jobs = serving_records(records)
    panel_axes = _panel_axes(jobs, axes)
    out: Dict[str, Dict[str, Dict[float, Dict[str, Any]]]] = {}
    variants: Dict[str, Variant] = {}
    for rec in jobs:
        variants.setdefault(rec.variant.label, rec.variant)
        by_rate = out.setdefault(panel_title(rec, panel_axes), {}).setdefault(rec.variant.label, {})
        for row in points(rec):
            by_rate.setdefault(row["rate"], row)
    return {p: {v: [out[p][v][r] for r in sorted(out[p][v])] for v in sorted(out[p], key=lambda v: variants[v].order)}
            for p in sorted(out, key=natural)}


def xy(data: Curves, x: str, y: str) -> Dict[str, Dict[str, List[Tuple[float, float]]]]:
    """The (``x``, ``y``) points of each variant's rows where both are known."""
    return {p: {v: [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
                for v, rows in series.items()} for p, series in data.items()}


def pareto_front(pts: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The points no other point beats on both axes (higher is better on each), by x."""
    return sorted(p for p in pts if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in pts))


def max_rates(records: Sequence[Record], axes: Sequence[Axis]) -> List[Dict[str, Any]]:
    """One row per ok serving record that ran a rate search: its panel, variant and answer."""
    jobs = [r for r in serving_records(records) if _m(r, "max_rate_probes")]
    panel_axes = _panel_axes(jobs, axes)
    rows = []
    for rec in sorted(jobs, key=lambda r: (natural(panel_title(r, panel_axes)), r.variant.order)):
        best = next((p for p in points(rec) if p["rate"] == _m(rec, "max_rate_under_slo")), {})
        rows.append({"panel": panel_title(rec, panel_axes), "variant": rec.variant.label,
                     "max_rate": _m(rec, "max_rate_under_slo"), "text": max_rate_text(rec),
                     "failed_at": _m(rec, "max_rate_failed_at"), "bound": _m(rec, "max_rate_bound"),
                     "ttft_ms_p99": best.get("ttft_ms_p99"), "tpot_ms_p99": best.get("tpot_ms_p99"),
                     "goodput": best.get("goodput"), "output_throughput": best.get("output_throughput"),
                     "probes": _m(rec, "max_rate_probes"), "non_monotone": _m(rec, "max_rate_non_monotone_rates"),
                     "reason": _m(rec, "max_rate_under_slo_reason"), "job": rec.job})
    return rows


def max_rate_text(rec: Record) -> str:
    """``4.36 req/s (ttft_ms)``; ``>= 64`` when the SLO never bound; ``< 0.5`` when the lowest failed
    (a conversations search: ``conv/s``, conversations arriving per second)."""
    best, failed, at_least = (_m(rec, k) for k in ("max_rate_under_slo", "max_rate_failed_at", "max_rate_at_least"))
    unit = "conv/s" if RecordView.of(rec).kind == "conversations" else "req/s"
    if best is not None:
        return f"{best:.3g} {unit} ({_m(rec, 'max_rate_bound') or '?'})"
    if at_least is not None:
        return f">= {at_least:.3g} {unit} (SLO never bound)"
    if failed is not None:
        return f"< {failed:.3g} {unit} (fails at the lowest rate: {_m(rec, 'max_rate_bound') or '?'})"
    return "-"


MAX_RATE_HEADER = ["variant", "max rate under SLO", "fails at (req/s)", "p99 TTFT ms at max", "p99 TPOT ms at max",
                   "goodput at max (req/s)", "output tok/s at max", "runs", "noisy passes above a failure"]


def max_rate_table(rows: Sequence[Dict[str, Any]]) -> List[List[str]]:
    return [[r["variant"], r["text"], fmt(r["failed_at"], "{:.3g}"), fmt(r["ttft_ms_p99"], "{:.1f}"),
             fmt(r["tpot_ms_p99"], "{:.1f}"), fmt(r["goodput"], "{:.3g}"), fmt(r["output_throughput"], "{:.1f}"),
             fmt(r["probes"], "{}"), r["non_monotone"] or "-"] for r in rows]


def slo_targets(records: Sequence[Record], axes: Sequence[Axis]) -> Dict[str, Dict[str, float]]:
    """panel -> the SLO's targets (the first record's of the panel)."""
    jobs = serving_records(records)
    panel_axes = _panel_axes(jobs, axes)
    out: Dict[str, Dict[str, float]] = {}
    for rec in jobs:
        slo = {k: rec.get(f"slo.{k}") for k in ("ttft_ms", "tpot_ms")}
        out.setdefault(panel_title(rec, panel_axes), {k: v for k, v in slo.items() if v is not None})
    return out


def markdown(records: Sequence[Record], axes: Sequence[Axis]) -> List[str]:
    """The report's serving section: the highest rate within the SLO per variant, and how many
    serving records were left out."""
    rows, left_out = max_rates(records, axes), malformed(records)
    lines: List[str] = []
    if rows:
        lines += ["## Serving: the highest arrival rate within the SLO", "",
                  "Per variant, the highest request rate whose run met every SLO target (its p99 TTFT / TPOT by "
                  "default, every request finished), next to the lowest rate that failed and what it missed "
                  "(what sets the limit). One search per variant, each rate one run: no confidence interval.", ""]
    for panel in sorted({r["panel"] for r in rows}, key=natural):
        group = [r for r in rows if r["panel"] == panel]
        if panel:
            lines += [f"### {md_text(panel)}", ""]
        lines += ["| " + " | ".join(MAX_RATE_HEADER) + " |", "|" + "---|" * len(MAX_RATE_HEADER)]
        lines += ["| " + " | ".join(md_text(cell) for cell in row) + " |" for row in max_rate_table(group)]
        lines += [f"- {md_text(r['variant'])}: {md_text(r['reason'])}" for r in group if r["reason"]] + [""]
    if left_out:
        lines += [f"{left_out} serving record{'s' if left_out > 1 else ''} left out of the serving tables and plots: "
                  "a rate, latency or throughput in it is not a number (another version's record, or edited).", ""]
    return lines


def max_rate_by_variant(records: Sequence[Record], config_match: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """variant -> :func:`max_rate_text` of the rate searches whose config has ``config_match``."""
    out: Dict[str, str] = {}
    for rec in serving_records(records):
        if _m(rec, "max_rate_probes") and all(rec.get(k) == v for k, v in (config_match or {}).items()):
            out.setdefault(rec.variant.label, max_rate_text(rec))
    return out
