"""The serving plots: latency against arrival rate, the Pareto of per-user against total throughput
(as vLLM's ``plot_pareto``: a variant's frontier is where raising the rate buys total throughput only
at the users' expense), and the sequences that fit per serving run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from kvbench.jsonio import atomic_write
from kvbench.sinks import capacity
from kvbench.sinks.plots import MAX_PANELS, _grid, _legend, excluded_note, palette
from kvbench.sinks.serving import RATE_KEY, SERVED, Curves, curves, max_rates, pareto_front, slo_targets, xy
from kvbench.sinks.tables import Axis, Record, kind
from kvbench.sinks.views import RecordView


def _save(fig, axes, path: Path, handles, labels, note: str) -> Path:
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize="small")
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 4), fontsize="small",
               title=note or None, title_fontsize="x-small", frameon=False)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"), binary=True)
    return path


def _log_x(ax, xs: Sequence[float]) -> None:
    """Rates from a gallop span decades: a log axis when they span more than 8x, plain numbers."""
    from matplotlib.ticker import ScalarFormatter

    if xs and min(xs) > 0 and max(xs) / min(xs) > 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())


def rate_latency_plot(path: Path, data: Curves, targets: Dict[str, Dict[str, float]], best: Dict[str, Dict[str, float]],
                      colours: Dict[str, str], note: str) -> Path:
    """p99 TTFT and p99 TPOT against the rate, two panels per panel of ``data``."""
    from matplotlib.figure import Figure

    names = list(data)
    fig = Figure(figsize=(11, 1.4 + 3.4 * len(names)), layout="constrained")
    grid = fig.subplots(len(names), 2, squeeze=False, sharex=True)
    axes = [ax for row in grid for ax in row]
    fig.suptitle("Serving latency vs arrival rate (p99)")
    for ax in grid[-1]:
        ax.set_xlabel("arrival rate (requests/s; workload=conversations: conversations/s)")
    for row in grid:
        row[0].set_ylabel("ms")
    for i, name in enumerate(names):
        for ax, key, label in ((axes[2 * i], "ttft_ms_p99", "p99 TTFT"), (axes[2 * i + 1], "tpot_ms_p99", "p99 TPOT")):
            ax.set_title(f"{label} {name}".strip(), fontsize="small")
            xs = []
            for v, rows in data[name].items():
                pts = [(r["rate"], r[key]) for r in rows if r.get(key) is not None]
                if not pts:
                    continue
                ax.plot(*zip(*pts), marker="o", color=colours[v])
                missed = [(r["rate"], r[key]) for r in rows if r.get(key) is not None and r.get("ok") is False]
                if missed:
                    ax.plot(*zip(*missed), marker="x", markersize=9, linestyle="", color="black")
                if best.get(name, {}).get(v) is not None:
                    ax.axvline(best[name][v], color=colours[v], linestyle=":", linewidth=1.5)
                xs += [x for x, _ in pts]
            target = targets.get(name, {}).get(key.rsplit("_", 1)[0])
            if target is not None:
                ax.axhline(target, color="black", linestyle="--", linewidth=1)
            _log_x(ax, xs)
    used = list(dict.fromkeys(v for s in data.values() for v in s))  # curves() lists them in order
    handles, labels = _legend(colours, used, [("SLO target", "--"), ("highest rate within the SLO", ":")])
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], marker="x", linestyle="", color="black", label="missed the SLO"))
    return _save(fig, axes, path, handles, labels + ["missed the SLO"], note)


def pareto_plot(path: Path, data: Curves, colours: Dict[str, str], note: str) -> Path:
    """Tokens/s per user against total output tokens/s: every run a point, the frontier a bold line."""
    names = list(data)
    fig, axes = _grid(len(names), "Per-user vs total throughput (serving runs at each rate)",
                      "output tokens/s, all requests", "tokens/s per user (1000 / p50 TPOT)")
    pts_all = xy(data, "output_throughput", "tokens_per_s_per_user")
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize="small")
        for v, pts in pts_all[name].items():
            if not pts:
                continue
            ax.plot(*zip(*pts), marker="o", markersize=4, color=colours[v], alpha=0.5, linestyle="")
            front = pareto_front(pts)
            ax.plot(*zip(*front), marker="o", color=colours[v], linewidth=2.5)
    used = list(dict.fromkeys(v for s in data.values() for v in s))  # curves() lists them in order
    legend = _legend(colours, used, [("bold: the variant's Pareto frontier (points: every run)", "-")])
    return _save(fig, axes, path, *legend, note)


def capacity_plot(path: Path, rows: Sequence[Dict], note: str) -> Path:
    """Sequences that fit per serving run: by the layouts' formula and by the run's allocator's plan."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 1.6 + 0.5 * len(rows)), layout="constrained")
    ax = fig.subplots()
    names = [f"{r['variant']}  {r['allocator']}  (job {r['job']})" for r in rows]
    for k, (key, label, colour) in enumerate((("kv_sequences_fit_formula", "layouts' formula", "#4477aa"),
                                               ("kv_sequences_fit", "the allocator's plan", "#ee6677"))):
        ys = [i + (k - 0.5) * 0.4 for i in range(len(rows))]
        ax.barh(ys, [r[key] for r in rows], height=0.4, color=colour, label=label)
        for y, r in zip(ys, rows):
            ax.text(r[key], y, f" {r[key]:,}", va="center", fontsize="x-small")
    ax.set_yticks(range(len(rows)), names, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("sequences at the run's longest request that fit its KV budget (computed, not measured)")
    ax.set_title("Serving capacity per layout, KV precision and allocator", fontsize="small")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize="small", title=note or None, title_fontsize="x-small", frameon=False)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"), binary=True)
    return path


def draw(records: Sequence[Record], axes: Sequence[Axis], out: Path) -> Tuple[List[Path], Dict[str, str]]:
    """The serving plots the records support, into ``out``: (PNG paths, {plot: why not})."""
    drawn, skipped = _rate_plots(records, axes, out)
    rows = capacity.rows(records)
    if rows:
        drawn.append(capacity_plot(Path(out) / "serving_capacity.png", rows, excluded_note(records)))
    return drawn, skipped


def _rate_plots(records: Sequence[Record], axes: Sequence[Axis], out: Path) -> Tuple[List[Path], Dict[str, str]]:
    if not any(kind(r) in SERVED for r in records):
        return [], {}
    data = curves(records, axes)
    skipped: Dict[str, str] = {}
    if not data:
        why = "no ok workload=serving or workload=conversations job"
        return [], {"rate_latency": why, "serving_pareto": why}
    if len(data) > MAX_PANELS // 2:
        why = f"{len(data)} panels, more than a figure can show; every value is in summary.md"
        return [], {"rate_latency": why, "serving_pareto": why}
    rates = {r for s in data.values() for rows in s.values() for r in (row["rate"] for row in rows)}
    if len(rates) < 2:
        why = f"needs >= 2 arrival rates among the ok serving jobs (found {len(rates)}): a sweep over " \
              f"{RATE_KEY} or workload.search.enabled=true"
        return [], {"rate_latency": why, "serving_pareto": why}
    colours = palette([RecordView.of(r).variant for r in records])
    note = excluded_note(records)
    best: Dict[str, Dict[str, float]] = {}
    for row in max_rates(records, axes):
        if row["max_rate"] is not None and not math.isnan(row["max_rate"]):
            best.setdefault(row["panel"], {})[row["variant"]] = row["max_rate"]
    out = Path(out)
    drawn = [rate_latency_plot(out / "rate_latency.png", data, slo_targets(records, axes), best, colours, note),
             pareto_plot(out / "serving_pareto.png", data, colours, note)]
    return drawn, skipped


