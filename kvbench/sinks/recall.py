"""``task=recall`` records side by side: accuracy per condition for each variant, with its 95 %
interval over seeds, each variant's gap to the first (MHA where there is one) in points with a
Welch interval over seeds, and the KV bytes per token and decode step of the same models.

The data only; console.py and report.py lay it out.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from kvbench.measure.stats import welch_interval
from kvbench.sinks.tables import fmt, variant, variant_order

Record = Dict[str, Any]
# A row of tables.accuracy is one condition of one stage: these keys say which.
_CONDITION_KEYS = ("stage", "kind", "num_pairs", "seq_len", "distance")


def _label(row: Dict[str, Any]) -> str:
    parts = [f"pairs={row['num_pairs']}" if row.get("num_pairs") is not None else None, f"len={row['seq_len']}",
             f"distance={row['distance']}" if row.get("distance") is not None else None]
    text = " ".join(p for p in parts if p)
    return text if row.get("stage", "final") == "final" else f"{text} ({row['stage'].replace('_', ' ')})"


def _cell(row: Dict[str, Any]) -> str:
    text = fmt(row.get("accuracy"), "{:.3f}")
    if row.get("ci_low") is not None:
        text += f" [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"
    return text


def gap_text(base: Sequence[float], other: Sequence[float]) -> str:
    """``-3.1 pts [-5.0, -1.2]``: mean(other) - mean(base) in accuracy points (x100), Welch
    interval over seeds; ``*`` when the interval excludes 0 (the gap is real at 95 %)."""
    diff, low, high = welch_interval(base, other)
    if low is None:
        return f"{100 * diff:+.1f} pts (no interval: < 2 seeds)"
    real = "*" if low > 0 or high < 0 else ""
    return f"{100 * diff:+.1f} pts [{100 * low:+.1f}, {100 * high:+.1f}]{real}"


def groups(records: Sequence[Record]) -> List[List[Record]]:
    """ok recall records grouped by everything in their config but the variant and the seed."""
    out: Dict[str, List[Record]] = {}
    for rec in records:
        config = rec.get("config") or {}
        if config.get("task") != "recall" or rec.get("status") != "ok" or not (rec.get("tables") or {}).get("accuracy"):
            continue
        key = {k: v for k, v in config.items() if k != "attention"}
        out.setdefault(repr(sorted(key.items(), key=lambda kv: kv[0])), []).append(rec)
    return [sorted(g, key=lambda r: variant_order(variant(r))) for g in out.values()]


def recall_table(group: Sequence[Record]) -> Tuple[List[str], List[List[str]]]:
    """(header, rows): a row per condition, a column per variant: accuracy [95 % interval]; for
    every variant after the first its gap to the first; then chance, KV / token and decode step."""
    labels = [variant(r) for r in group]
    header = ["condition", *labels, *[f"{v} vs {labels[0]}" for v in labels[1:]]]
    by_condition: Dict[Tuple, Dict[str, Dict[str, Any]]] = {}
    for rec, label in zip(group, labels):
        for row in rec["tables"]["accuracy"]:
            by_condition.setdefault(tuple(row.get(k) for k in _CONDITION_KEYS), {})[label] = row
    rows = []
    for cells in by_condition.values():
        first = next(iter(cells.values()))
        base = cells.get(labels[0])
        gaps = [gap_text(base["per_seed"], cells[v]["per_seed"]) if base and v in cells else "-" for v in labels[1:]]
        rows.append([_label(first), *[_cell(cells[v]) if v in cells else "-" for v in labels], *gaps])
    pad = [""] * (len(labels) - 1)
    chance = [fmt((r.get("metrics") or {}).get("chance_accuracy"), "{:.3f}") for r in group]
    rows.append(["chance", *chance, *pad])
    rows.append(["KV / token", *[fmt(r["metrics"].get("kv_bytes_per_token"), "bytes") for r in group], *pad])
    rows.append(["decode p50 ms", *[fmt(r["metrics"].get("decode_ms_p50"), "{:.3f}") for r in group], *pad])
    return header, rows


def title(group: Sequence[Record]) -> str:
    config = group[0].get("config") or {}
    r = config.get("recall") or {}
    steps = (config.get("train") or {}).get("steps")
    return (f"recall ({r.get('kind')}): accuracy on held-out sequences, mean over {r.get('seeds')} seeds "
            f"[95% t-interval]; gaps in points with a Welch interval (* = excludes 0); {steps} training steps")
