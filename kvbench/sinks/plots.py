"""The report's PNG plots: the first charts a person looks at after a sweep.

- ``decode_vs_context``: decode ms/token (p50; band to p90 for up to 4 variants) vs context length
- ``kv_bytes_vs_heads``: KV-cache bytes vs KV heads, measured (solid) and formula (dashed)
- ``tokens_vs_batch``: decode tokens/s vs batch size, one line per variant
- ``ttft_per_turn``: multi-turn time to first token per turn, cache sharing on (solid) vs off (dashed)

A *variant* is one combination of the swept axes other than the x axis. The data behind each
plot is computed by :func:`lines`, separately from drawing, so it can be checked against the
records. Drawing uses matplotlib's object API (a ``Figure`` rendered by Agg, no pyplot state),
so it runs headless and in any thread.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvbench.results import lookup

Point = Tuple[float, float]
Lines = Dict[str, List[Point]]
BYTE_UNITS = (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024), ("bytes", 1))
MAX_BANDS = 4  # more p90 bands than this overlap into a blur


def _ok(records, workload: Optional[str] = None):
    return [r for r in records if r.get("status") == "ok"
            and (workload is None or lookup(r.get("config", {}), "workload.name") == workload)]


def variant_label(record: Dict[str, Any], axes: Sequence[Tuple[str, str]], exclude: Sequence[str]) -> str:
    """``gqa kv=4 B=8``: the attention variant, then every other swept axis not excluded."""
    cfg = record.get("config", {})
    parts = []
    if "attention.type" not in exclude and "attention.num_kv_heads" not in exclude:
        parts.append(f"{lookup(cfg, 'attention.type')} kv={lookup(cfg, 'attention.num_kv_heads')}")
    parts += [f"{title}={lookup(cfg, key)}" for key, title in axes
              if key not in exclude and key not in ("attention.type", "attention.num_kv_heads")]
    return " ".join(parts) or "all jobs"


def lines(records, axes, x_key: str, y: Callable[[Dict[str, Any]], Optional[float]],
          exclude: Sequence[str] = ()) -> Lines:
    """label -> [(x, y)] sorted by x over the records where both are known; a label names only
    the axes that vary among those records."""
    known = [(rec, lookup(rec.get("config", {}), x_key), y(rec)) for rec in records]
    known = [(rec, x, value) for rec, x, value in known if x is not None and value is not None]
    axes = varying([rec for rec, _, _ in known], axes)
    out: Lines = {}
    for rec, x, value in known:
        out.setdefault(variant_label(rec, axes, (x_key, *exclude)), []).append((x, value))
    return {label: sorted(out[label]) for label in sorted(out, key=natural)}


def natural(text: str) -> List[Any]:
    """Sort key that puts ``prompt=64`` before ``prompt=256``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def varying(records, axes: Sequence[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """The axes whose value differs among ``records``."""
    return [(key, title) for key, title in axes
            if len({repr(lookup(r.get("config", {}), key)) for r in records}) > 1]


def metric(key: str) -> Callable[[Dict[str, Any]], Optional[float]]:
    """The metric ``key`` of a record (None when absent)."""
    return lambda rec: (rec.get("metrics") or {}).get(key)


def turn_lines(records, axes) -> Lines:
    """label -> [(turn, TTFT ms)] for every ok multi-turn job with a per-turn table."""
    out: Lines = {}
    chats = [r for r in _ok(records, "multiturn") if (r.get("tables") or {}).get("turns")]
    axes = varying(chats, axes)
    for rec in chats:
        rows = rec["tables"]["turns"]
        points = []
        for i, row in enumerate(rows):
            ttft = row.get("ttft_ms", row.get("prefill_ms"))
            if ttft is not None:
                points.append((row.get("turn", i), ttft))
        if points:
            label = variant_label(rec, axes, ("cache.shared",))
            shared = lookup(rec.get("config", {}), "cache.shared")
            out[f"{label} shared={'on' if shared else 'off'}"] = sorted(points)
    return {label: out[label] for label in sorted(out, key=natural)}


def _excluded_note(records) -> str:
    counts: Dict[str, int] = {}
    for rec in records:
        if rec.get("status") != "ok":
            counts[rec.get("status", "?")] = counts.get(rec.get("status", "?"), 0) + 1
    if not counts:
        return ""
    return "not plotted: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + " (listed in summary.md)"


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, xs, note: str, n_entries: int) -> Path:
    ax.set_ylim(bottom=0)  # every y here is a time, a size or a rate: compare from zero
    xs = sorted(set(xs))
    if len(xs) <= 12:
        ax.set_xticks(xs)
    # The note on left-out jobs goes in the legend's title, where the layout keeps it readable.
    ax.legend(fontsize="small", ncol=1 if n_entries <= 8 else 2, title=note or None,
              title_fontsize="x-small")
    fig.savefig(path, dpi=110)
    return path


def _colors(n: int):
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _line_plot(path: Path, data: Lines, title: str, xlabel: str, ylabel: str, note: str,
               band: Optional[Lines] = None) -> Path:
    if band and len(data) <= MAX_BANDS:
        ylabel += " (p50, band to p90)"
    elif band:
        ylabel, band = ylabel + " (p50)", None
    fig, ax = _figure(title, xlabel, ylabel)
    for color, (label, points) in zip(_colors(len(data)), data.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", color=color, label=label)
        upper = dict(band.get(label, [])) if band else {}
        if all(x in upper for x in xs):
            ax.fill_between(xs, ys, [upper[x] for x in xs], color=color, alpha=0.15)
    return _save(fig, ax, path, [x for pts in data.values() for x, _ in pts], note, len(data))


def _kv_plot(path: Path, measured: Lines, formula: Lines, note: str) -> Path:
    top = max(y for pts in list(measured.values()) + list(formula.values()) for _, y in pts)
    unit, scale = next((u, s) for u, s in BYTE_UNITS if top >= s or s == 1)
    measured, formula = ({k: [(x, y / scale) for x, y in pts] for k, pts in d.items()}
                         for d in (measured, formula))
    fig, ax = _figure("KV-cache memory vs KV heads: measured vs formula", "KV heads (num_kv_heads)",
                      f"KV cache ({unit})")
    labels = sorted(set(measured) | set(formula))
    for color, label in zip(_colors(len(labels)), labels):
        prefix = "" if label == "all jobs" else f"{label}: "
        if label in measured:
            xs, ys = zip(*measured[label])
            ax.plot(xs, ys, marker="o", color=color, label=f"{prefix}measured")
        if label in formula:
            xs, ys = zip(*formula[label])
            ax.plot(xs, ys, marker="x", linestyle="--", color=color, label=f"{prefix}formula")
    xs = [x for pts in list(measured.values()) + list(formula.values()) for x, _ in pts]
    return _save(fig, ax, path, xs, note, 2 * len(labels))


def _turn_plot(path: Path, data: Lines, note: str) -> Path:
    fig, ax = _figure("Time to first token per turn: KV sharing on vs off", "turn",
                      "TTFT (ms)")
    for color, (label, points) in zip(_colors(len(data)), data.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", color=color, linestyle="-" if label.endswith("=on") else "--",
                label=label)
    return _save(fig, ax, path, [x for pts in data.values() for x, _ in pts], note, len(data))


def _distinct_x(data: Lines) -> int:
    return len({x for pts in data.values() for x, _ in pts})


def draw_all(records, axes, out: Path) -> Tuple[List[Path], Dict[str, str]]:
    """Draw every plot the records support into ``out``; returns (PNG paths, {plot: why not})."""
    out = Path(out)
    note = _excluded_note(records)
    drawn: List[Path] = []
    skipped: Dict[str, str] = {}

    def need_x(name: str, data: Lines, x_key: str, which: str) -> bool:
        if _distinct_x(data) >= 2:
            return True
        skipped[name] = f"needs >= 2 values of {x_key} among {which} (found {_distinct_x(data)})"
        return False

    decode = _ok(records, "decode")
    ms = lines(decode, axes, "workload.prompt_len", metric("decode_ms_p50"))
    if need_x("decode_vs_context", ms, "workload.prompt_len", "ok decode jobs"):
        drawn.append(_line_plot(out / "decode_vs_context.png", ms,
                                "Decode latency per token vs context length",
                                "context length at the first decode step (prompt tokens)",
                                "decode ms / token", note,
                                band=lines(decode, axes, "workload.prompt_len", metric("decode_ms_p90"))))

    kv_axes = ("attention.type",)
    measured = lines(_ok(records), axes, "attention.num_kv_heads", metric("kv_cache_bytes"), kv_axes)
    formula = lines(_ok(records), axes, "attention.num_kv_heads", metric("kv_cache_bytes_formula"), kv_axes)
    if need_x("kv_bytes_vs_heads", {**formula, **{(k, "measured"): v for k, v in measured.items()}},
              "attention.num_kv_heads", "ok jobs"):
        drawn.append(_kv_plot(out / "kv_bytes_vs_heads.png", measured, formula, note))

    tps = lines(decode, axes, "workload.batch_size", metric("tokens_per_s"))
    if need_x("tokens_vs_batch", tps, "workload.batch_size", "ok decode jobs"):
        drawn.append(_line_plot(out / "tokens_vs_batch.png", tps, "Decode throughput vs batch size",
                                "batch size (sequences)", "tokens / s", note))

    turns = turn_lines(records, axes)
    if max((len(p) for p in turns.values()), default=0) >= 2:
        drawn.append(_turn_plot(out / "ttft_per_turn.png", turns, note))
    else:
        skipped["ttft_per_turn"] = "needs an ok multiturn job with a per-turn table of >= 2 turns"
    return drawn, skipped
