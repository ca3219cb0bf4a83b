"""The report's PNG plots (listed in docs/tracking.md): the first charts a person looks at after a sweep.

Every plot is small multiples: one panel per combination of the other swept axes, one line per
attention variant in the variant's colour in every plot, one legend outside the panels. The data of
each plot is computed apart from drawing (:func:`panels`), so it can be checked against the records.
Drawing uses matplotlib's object API (no pyplot state), so it runs headless and in any thread.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvbench.jsonio import atomic_write
from kvbench.sinks.choose import decode_capacity
from kvbench.sinks.tables import VARIANT_KEYS, Axis, Record, natural
from kvbench.sinks.views import RecordView, Variant, in_order, ordered

Point = Tuple[float, float]
Series = Dict[str, List[Point]]  # attention variant's label -> points sorted by x
Panels = Dict[str, Series]  # panel title ("B=8 dtype=bfloat16", "" for one panel) -> series
BYTE_UNITS = (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024), ("bytes", 1))
MAX_BANDS = 4  # more p90 bands than this in one panel overlap into a blur
# A y axis reaches at most this times the panel's highest line where a band or bar goes further (a
# p90 of 20x the median under load squashed every line to the bottom); a triangle marks the cut.
HEADROOM = 1.6
# A figure of more panels than this is unreadable, and a sweep along a long axis (2,000 seeds)
# would take minutes to draw one: such a plot is not drawn, and summary.md has every value.
MAX_PANELS = 24
# MHA is blue and MQA red in every report (whatever the model's head count: one panel never holds
# two models); GQA counts take the other colours, most KV heads first.
MHA_COLOUR, MQA_COLOUR = "tab:blue", "tab:red"
GQA_COLOURS = ["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
               "tab:gray", "#393b79", "#8c6d31", "#637939", "#843c39", "#7b4173", "#3182bd", "#e6550d",
               "#31a354", "#756bb1", "#636363", "#9c9ede", "#e7ba52", "#b5cf6b", "#e7969c", "#de9ed6"]
_NOT_PANEL = VARIANT_KEYS + ("task", "workload.name")


def palette(variants: Sequence[Variant]) -> Dict[str, str]:
    """One colour per attention variant (by its label), the same in every plot of a report."""
    colours: Dict[str, str] = {}
    gqa = iter(GQA_COLOURS)
    for v in ordered([v.with_sharing(None) for v in variants]):
        if v.label in colours:  # the same variant of another model: one panel never holds two
            continue
        colours[v.label] = ({"mha": MHA_COLOUR, "mqa": MQA_COLOUR}.get(v.layout) if v.plain else None) \
            or next(gqa, "black")
    return colours


def variants_of(records) -> Dict[str, Variant]:
    """label -> variant of every record, and of every chat with its sharing (the per-turn plot's)."""
    out: Dict[str, Variant] = {}
    for view in map(RecordView.of, records):
        out[view.variant.label] = view.variant
        if view.kind == "multiturn":
            shared = view.variant.with_sharing(bool(view.shared))
            out[shared.label] = shared
    return out


def _in_order(series: Dict[str, Any], variants: Dict[str, Variant]) -> Dict[str, Any]:
    return {label: series[label] for label in in_order(list(series), variants)}


def _ok(records, kind_name: Optional[str] = None) -> List[RecordView]:
    return [v for v in map(RecordView.of, records) if v.ok and (kind_name is None or v.kind == kind_name)]


def varying(records, axes: Sequence[Axis]) -> List[Axis]:
    """The axes whose value differs among ``records``."""
    return [(key, title) for key, title in axes
            if len({repr(RecordView.of(r).get(key)) for r in records}) > 1]


def panel_title(record: Record, axes: Sequence[Axis]) -> str:
    """``B=8 dtype=bfloat16``: the record's values of ``axes`` (those it has)."""
    values = [(title, RecordView.of(record).get(key)) for key, title in axes]
    return " ".join(f"{title}={value}" for title, value in values if value is not None)


def panels(records, axes: Sequence[Axis], x: Callable[[Record], Any], y: Callable[[Record], Optional[float]],
           fold: Sequence[str]) -> Panels:
    """panel -> variant -> [(x, y)] sorted by x, where both are known. A panel is a combination of
    the varying axes other than the variant and ``fold`` (the x axis, and what ``y`` divides out)."""
    panel_axes = [a for a in varying(records, axes) if a[0] not in _NOT_PANEL + tuple(fold)]
    out: Panels = {}
    variants: Dict[str, Variant] = {}
    for rec in map(RecordView.of, records):
        xv, yv = x(rec), y(rec)
        if xv is not None and yv is not None:
            variants[rec.variant.label] = rec.variant
            out.setdefault(panel_title(rec, panel_axes), {}).setdefault(rec.variant.label, []).append((xv, yv))
    return {p: {v: sorted(pts) for v, pts in _in_order(out[p], variants).items()} for p in sorted(out, key=natural)}


def config_value(key: str) -> Callable[[Record], Any]:
    """The config value ``key`` of a record (None when absent)."""
    return lambda rec: RecordView.of(rec).get(key)


def metric(key: str) -> Callable[[Record], Optional[float]]:
    """The metric ``key`` of a record (None when absent)."""
    return lambda rec: RecordView.of(rec).number(key)


def metric_interval(key: str) -> Callable[[Record], Optional[Tuple[float, float]]]:
    """The 95% interval (low, high) of the metric ``key`` of a record (None when it has none)."""
    return lambda rec: RecordView.of(rec).interval(key)


def positions_held(rec: Record) -> Optional[int]:
    """Positions a decode run's cache holds at the end: prompt_len + gen_len."""
    return RecordView.of(rec).positions_held


def per_token(key: str) -> Callable[[Record], Optional[float]]:
    """A decode run's metric ``key`` (bytes) per cached token: / (batch_size x positions held)."""
    def value(rec: Record) -> Optional[float]:
        total, held = metric(key)(rec), positions_held(rec)
        batch = RecordView.of(rec).batch_size
        return total / (batch * held) if total is not None and held and batch else None
    return value


def turn_panels(records, axes: Sequence[Axis]) -> Panels:
    """panel -> ``<variant> shared=on|off`` -> [(turn, TTFT ms)] of the ok multi-turn jobs."""
    chats = [r for r in _ok(records, "multiturn") if r.table("turns")]
    panel_axes = [a for a in varying(chats, axes) if a[0] not in _NOT_PANEL + ("cache.shared",)]
    out: Panels = {}
    variants: Dict[str, Variant] = {}
    for rec in chats:
        points = [(row.get("turn", i), row["ttft_ms"]) for i, row in enumerate(rec.table("turns"))
                  if row.get("ttft_ms") is not None]
        if points:
            chat = rec.variant.with_sharing(bool(rec.shared))
            variants[chat.label] = chat
            out.setdefault(panel_title(rec, panel_axes), {})[chat.label] = sorted(points)
    return {p: _in_order(out[p], variants) for p in sorted(out, key=natural)}


def capacity_panels(records, axes: Sequence[Axis], column: str) -> Panels:
    """panel -> variant -> [(context, ``column`` of tables.capacity)] of the ok capacity jobs."""
    jobs = [r for r in _ok(decode_capacity(records)) if r.table("capacity")]
    panel_axes = [a for a in varying(jobs, axes) if a[0] not in _NOT_PANEL]
    out: Panels = {}
    variants: Dict[str, Variant] = {}
    for rec in jobs:
        points = [(row["context"], row[column]) for row in rec.table("capacity") if row.get(column) is not None]
        if points:
            variants[rec.variant.label] = rec.variant
            out.setdefault(panel_title(rec, panel_axes), {})[rec.variant.label] = sorted(points)
    return {p: _in_order(out[p], variants) for p in sorted(out, key=natural)}


def excluded_note(records) -> str:
    counts: Dict[str, int] = {}
    for rec in map(RecordView.of, records):
        if not rec.ok:
            counts[rec.status] = counts.get(rec.status, 0) + 1
    if not counts:
        return ""
    return "not plotted: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + " (listed in summary.md)"


# ---- drawing -----------------------------------------------------------------------------------------

def _grid(n: int, title: str, xlabel: str, ylabel: str, sharey: bool = False):
    """A figure of ``n`` panels (at most 3 columns, 4 past 9 panels) with one title and axis labels."""
    from matplotlib.figure import Figure

    ncols = 1 if n == 1 else 2 if n in (2, 4) else 3 if n <= 9 else 4
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(2.0 + (6.5 if n == 1 else 3.6 * ncols), 1.2 + (4.2 if n == 1 else 2.9 * nrows)),
                 layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=sharey)
    axes = [ax for row in grid for ax in row]
    for i, ax in enumerate(axes):
        if i >= n:
            ax.set_visible(False)
            continue
        # Axis labels on the panels' outer edges (a figure-level x label would sit where the
        # legend goes); the bottom panel of each column may be above an empty cell.
        if i + ncols >= n:
            ax.set_xlabel(xlabel)
            ax.tick_params(labelbottom=True)
        if i % ncols == 0:
            ax.set_ylabel(ylabel)
    fig.suptitle(title)
    return fig, axes[:n]


def _finish(fig, axes, path: Path, handles, labels, note: str, xs) -> Path:
    xs = sorted(set(xs))
    for ax in axes:
        ax.set_ylim(bottom=0)  # every y here is a time, a size or a rate: compare from zero
        ax.grid(True, alpha=0.3)
        if len(xs) <= 12:
            ax.set_xticks(xs)
        ax.tick_params(labelsize="small")
    # One legend for every panel, below them (constrained layout makes room: it never covers
    # data, the axis labels or the title); the note on left-out jobs is its title.
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 4), fontsize="small",
               title=note or None, title_fontsize="x-small", frameon=False)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"), binary=True)  # never through a link
    return path


def _legend(colours: Dict[str, str], labels: Sequence[str], extra: Sequence[Tuple[str, str]] = ()):
    """Legend handles: a coloured line per variant, then grey ``(label, linestyle)`` entries."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colours[v], marker="o", label=v) for v in labels]
    handles += [Line2D([], [], color="0.3", linestyle=style, label=label) for label, style in extra]
    return handles, [h.get_label() for h in handles]


def _used(data: Panels, colours: Dict[str, str]) -> List[str]:
    """The variants drawn in ``data``, in the palette's order (:attr:`Variant.order`)."""
    drawn = {v for series in data.values() for v in series}
    return [label for label in colours if label in drawn]


def _xs(data: Panels) -> List[Any]:
    return [x for series in data.values() for points in series.values() for x, _ in points]


def line_plot(path: Path, data: Panels, colours: Dict[str, str], title: str, xlabel: str, ylabel: str,
              note: str, band: Optional[Panels] = None, errors: Optional[Panels] = None) -> Path:
    """One line per variant in each panel; ``band``: a shaded band up to it; ``errors`` (points
    ``(x, (low, high))``): error bars."""
    banded = band is not None and all(len(series) <= MAX_BANDS for series in data.values())
    bars = bool(errors) and any(errors.values())
    fig, axes = _grid(len(data), title, xlabel, ylabel + (" (p50, band to p90)" if banded else "")
                      + (", bars: each job's 95% interval" if bars else ""))
    clipped = False
    for ax, (name, series) in zip(axes, data.items()):
        ax.set_title(name, fontsize="small")
        reach: List[Tuple[Any, float, str]] = []  # (x, top of its band or bar, variant)
        for label, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", color=colours[label], label=label)
            ci = dict((errors or {}).get(name, {}).get(label, []))
            at = [(x, y, ci[x]) for x, y in points if x in ci]
            if at:
                # A percentile-bootstrap interval need not hold its point (a p50 over few, skewed steps):
                # matplotlib refuses a negative bar, so such a side is drawn as none.
                ax.errorbar([x for x, _, _ in at], [y for _, y, _ in at], fmt="none", ecolor=colours[label],
                            capsize=3, yerr=[[max(0.0, y - lo) for _, y, (lo, _) in at],
                                             [max(0.0, hi - y) for _, y, (_, hi) in at]])
            upper = dict(band.get(name, {}).get(label, [])) if banded else {}
            if upper and all(x in upper for x in xs):
                ax.fill_between(xs, ys, [upper[x] for x in xs], color=colours[label], alpha=0.15, linewidth=0)
                reach += [(x, upper[x], label) for x in xs]
            reach += [(x, hi, label) for x, _, (_, hi) in at]
        clipped |= _clip(ax, series, reach, colours)
    handles, labels = _legend(colours, _used(data, colours))
    if clipped:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="0.3", marker="^", linestyle="none",
                              label=f"band or bar past the axis (cut at {HEADROOM:g}x the highest line)"))
        labels.append(handles[-1].get_label())
    return _finish(fig, axes, path, handles, labels, note, _xs(data))


def _clip(ax, series: Dict[str, Any], reach: Sequence[Tuple[Any, float, str]], colours: Dict[str, str]) -> bool:
    """Cut the y axis at :data:`HEADROOM` x the highest line where ``reach`` (x, top, variant) goes
    past it, a triangle on each cut; True when one was cut."""
    top = HEADROOM * max((y for points in series.values() for _, y in points), default=0.0)
    past = [(x, label) for x, high, label in reach if high is not None and high > top]
    if top <= 0 or not past:
        return False
    ax.set_ylim(0, top)
    for x, label in past:
        ax.plot([x], [top], marker="^", color=colours[label], linestyle="none", clip_on=False, zorder=5)
    return True


def _byte_unit(*datas: Panels) -> Tuple[str, int]:
    top = max((y for d in datas for series in d.values() for pts in series.values() for _, y in pts), default=1)
    return next((u, s) for u, s in BYTE_UNITS if top >= s or s == 1)


def _scaled(data: Panels, scale: int) -> Panels:
    return {p: {v: [(x, y / scale) for x, y in pts] for v, pts in s.items()} for p, s in data.items()}


def kv_heads_plot(path: Path, measured: Panels, formula: Panels, colours: Dict[str, str], note: str) -> Path:
    """KV bytes per cached token against KV heads: measured points (jobs of other batch sizes and
    lengths fall on one point when the cache holds exactly what it needs), the formula dashed."""
    names = sorted(set(measured) | set(formula), key=natural)
    fig, axes = _grid(len(names), "KV-cache bytes per token vs KV heads: measured vs formula",
                      "KV heads (attention.num_kv_heads)", "KV cache per token, all layers (bytes)")
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize="small")
        for label, points in measured.get(name, {}).items():
            ax.plot(*zip(*points), marker="o", markersize=8, linestyle="", color=colours[label], zorder=2, label=label)
        reference = sorted({point for pts in formula.get(name, {}).values() for point in pts})
        if reference:
            ax.plot(*zip(*reference), color="black", linestyle="--", linewidth=1, zorder=3, label="formula")
    handles = _legend(colours, _used(measured, colours), [("formula (dashed): 2·layers·kv·head_dim·bytes", "--")])
    return _finish(fig, axes, path, *handles, note, _xs(measured) + _xs(formula))


def kv_memory_plot(path: Path, measured: Panels, formula: Panels, colours: Dict[str, str], note: str) -> Path:
    """KV bytes against positions held, a panel per batch size on a shared y axis (growth with the
    batch shows across panels); measured solid, the formula dashed."""
    unit, scale = _byte_unit(measured, formula)
    measured, formula = _scaled(measured, scale), _scaled(formula, scale)
    names = sorted(set(measured) | set(formula), key=natural)
    fig, axes = _grid(len(names), "KV-cache memory vs sequence length and batch size",
                      "positions held (prompt_len + gen_len)", f"KV cache ({unit})", sharey=True)
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize="small")
        for label, points in measured.get(name, {}).items():
            ax.plot(*zip(*points), color=colours[label], linewidth=3, alpha=0.45, zorder=1, label=label)
            ax.plot(*zip(*points), color=colours[label], marker="o", markersize=7, linestyle="", zorder=2, label=label)
        for points in formula.get(name, {}).values():
            ax.plot(*zip(*points), color="black", linestyle="--", linewidth=1.2, zorder=3, label="formula")
    handles = _legend(colours, _used(measured, colours), [("formula (dashed)", "--")])
    return _finish(fig, axes, path, *handles, note, _xs(measured) + _xs(formula))


def turn_plot(path: Path, data: Panels, colours: Dict[str, str], note: str, variants: Dict[str, Variant]) -> Path:
    """TTFT per turn: solid with cache sharing, dashed without."""
    fig, axes = _grid(len(data), "Time to first token per turn: KV sharing on vs off", "turn", "TTFT (ms)")
    for ax, (name, series) in zip(axes, data.items()):
        ax.set_title(name, fontsize="small")
        for label, points in series.items():
            chat = variants[label]
            ax.plot(*zip(*points), marker="o", color=colours[chat.with_sharing(None).label],
                    linestyle="-" if chat.shared else "--", label=label)
    drawn = {variants[label].with_sharing(None).label for s in data.values() for label in s}
    used = [label for label in colours if label in drawn]
    handles = _legend(colours, used, [("cache.shared=true", "-"), ("cache.shared=false", "--")])
    return _finish(fig, axes, path, *handles, note, _xs(data))


def capacity_plot(path: Path, measured: Panels, predicted: Panels, colours: Dict[str, str], note: str) -> Path:
    """Max batch against context length: measured (solid) and the memory-only prediction (weights +
    KV formula + measured activations, dashed)."""
    names = sorted(set(measured) | set(predicted), key=natural)
    fig, axes = _grid(len(names), "Max batch under the memory budget and SLOs vs context length",
                      "context length (prompt tokens)", "max batch (sequences)")
    for ax, name in zip(axes, names):
        ax.set_title(name, fontsize="small")
        for label, points in measured.get(name, {}).items():
            ax.plot(*zip(*points), marker="o", color=colours[label], label=label)
        for label, points in predicted.get(name, {}).items():
            ax.plot(*zip(*points), linestyle="--", color=colours[label], alpha=0.8)
    handles = _legend(colours, _used(measured, colours), [("measured (search under budget and SLOs)", "-"),
                                                 ("memory-only prediction", "--")])
    return _finish(fig, axes, path, *handles, note, _xs(measured) + _xs(predicted))


def _distinct_x(data: Panels) -> int:
    return len(set(_xs(data)))


def draw_all(records, axes: Sequence[Axis], out: Path) -> Tuple[List[Path], Dict[str, str]]:
    """Draw every plot the records support into ``out``; returns (PNG paths, {plot: why not})."""
    out = Path(out)
    note = excluded_note(records)
    variants = variants_of(records)
    colours = palette(list(variants.values()))
    drawn: List[Path] = []
    skipped: Dict[str, str] = {}

    def need_x(name: str, data: Panels, x_key: str, which: str) -> bool:
        if len(data) > MAX_PANELS:
            skipped[name] = (f"{len(data)} panels (one per combination of the other swept values), more than the "
                             f"{MAX_PANELS} a figure can show; every value is in summary.md")
            return False
        if _distinct_x(data) >= 2:
            return True
        skipped[name] = f"needs >= 2 values of {x_key} among {which} (found {_distinct_x(data)})"
        return False

    decode = _ok(records, "decode")
    prompt = config_value("workload.prompt_len")
    ms = panels(decode, axes, prompt, metric("decode_ms_p50"), ["workload.prompt_len"])
    if need_x("decode_vs_context", ms, "workload.prompt_len", "ok decode jobs"):
        band = panels(decode, axes, prompt, metric("decode_ms_p90"), ["workload.prompt_len"])
        errors = panels(decode, axes, prompt, metric_interval("decode_ms_p50"), ["workload.prompt_len"])
        drawn.append(line_plot(out / "decode_vs_context.png", ms, colours, "Decode latency per token vs context length",
                               "context length at the first decode step (prompt tokens)", "decode ms / token", note,
                               band=band, errors=errors))

    batch = config_value("workload.batch_size")
    tps = panels(decode, axes, batch, metric("tokens_per_s"), ["workload.batch_size"])
    if need_x("tokens_vs_batch", tps, "workload.batch_size", "ok decode jobs"):
        errors = panels(decode, axes, batch, metric_interval("tokens_per_s"), ["workload.batch_size"])
        drawn.append(line_plot(out / "tokens_vs_batch.png", tps, colours, "Decode throughput vs batch size",
                               "batch size (sequences)", "tokens / s", note, errors=errors))

    # Per token: batch size and length divide out, so a panel is a dtype (or model, cache ...).
    heads, fold = config_value("attention.num_kv_heads"), ["workload.batch_size", "workload.prompt_len",
                                                           "workload.gen_len"]
    # a KV-head count on the x axis; MLA's bytes are in kv_memory
    by_heads = [r for r in decode if r.variant.counts_kv_heads]
    measured = panels(by_heads, axes, heads, per_token("kv_cache_bytes"), fold)
    formula = panels(by_heads, axes, heads, per_token("kv_cache_bytes_formula"), fold)
    if need_x("kv_bytes_vs_heads", formula or measured, "attention.num_kv_heads", "ok decode jobs"):
        drawn.append(kv_heads_plot(out / "kv_bytes_vs_heads.png", measured, formula, colours, note))

    fold = ["workload.prompt_len", "workload.gen_len"]
    held = panels(decode, axes, positions_held, metric("kv_cache_bytes"), fold)
    held_formula = panels(decode, axes, positions_held, metric("kv_cache_bytes_formula"), fold)
    if need_x("kv_memory", held_formula or held, "workload.prompt_len + workload.gen_len", "ok decode jobs"):
        drawn.append(kv_memory_plot(out / "kv_memory.png", held, held_formula, colours, note))

    capacity = capacity_panels(records, axes, "max_batch")
    if any(RecordView.of(r).kind == "capacity" for r in records) and need_x("capacity_vs_context", capacity,
                                                               "capacity.context_lens", "ok capacity jobs"):
        drawn.append(capacity_plot(out / "capacity_vs_context.png", capacity,
                                   capacity_panels(records, axes, "predicted_max_batch"), colours, note))

    turns = turn_panels(records, axes)
    if len(turns) > MAX_PANELS:
        skipped["ttft_per_turn"] = f"{len(turns)} panels, more than the {MAX_PANELS} a figure can show"
    elif max((len(p) for s in turns.values() for p in s.values()), default=0) >= 2:
        drawn.append(turn_plot(out / "ttft_per_turn.png", turns, colours, note, variants))
    else:
        skipped["ttft_per_turn"] = "needs an ok multiturn job with a per-turn table of >= 2 turns"
    return drawn, skipped
