"""``task=recall`` records side by side: accuracy per condition for each variant with its interval
over seeds, each variant's gap to the first, the condition's floors (chance, MQAR's copy baseline)
and the same models' costs. The data only; console.py and report.py lay it out.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

from kvbench.jsonio import as_int
from kvbench.measure.stats import seed_summary, welch_interval
from kvbench.sinks.tables import Record, fmt
from kvbench.sinks.views import RecordView

COPY_NOTE = ("copy baseline (MQAR): the accuracy of a model that copies any value of its context without learning "
             "which key it belongs to, (1 + (P - 1) / M) / P for P pairs of M values: above chance, and a result "
             "near it is no recall")
# The rows under the conditions: the variants' costs (a state row only where a variant has one).
COST_ROWS = ("KV / token", "state / sequence", "decode p50 ms")
# A row of tables.accuracy is one condition of one stage: these keys say which.
_CONDITION_KEYS = ("stage", "kind", "num_pairs", "seq_len", "distance")


def _label(row: Mapping[str, Any]) -> str:
    parts = [f"pairs={row['num_pairs']}" if row.get("num_pairs") is not None else None, f"len={row['seq_len']}",
             f"distance={row['distance']}" if row.get("distance") is not None else None]
    text = " ".join(p for p in parts if p)
    return text if row.get("stage", "final") == "final" else f"{text} ({row['stage'].replace('_', ' ')})"


def _cell(row: Mapping[str, Any]) -> str:
    """``0.556 [0.000, 1.000] (0.53 1.00 0.30)``: the mean, its interval, each seed's accuracy."""
    text = fmt(row.get("accuracy"), "{:.3f}")
    if row.get("ci_low") is not None:
        text += f" [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"
    if len(row.get("per_seed") or ()) > 1:
        text += " (" + " ".join(f"{acc:.2f}" for acc in row["per_seed"]) + ")"
    return text


def gap_text(base: Sequence[float], other: Sequence[float]) -> str:
    """``-3.1 pts [-5.0, -1.2]``: mean(other) - mean(base) in accuracy points, Welch interval over
    seeds clipped to +-100 points (a t-interval knows no bounds: 3 seeds at 0.08 against 1.00 give
    -105.9); ``*`` when the interval excludes 0."""
    diff, low, high = welch_interval(base, other)
    if low is None:
        return f"{100 * diff:+.1f} pts (no interval: < 2 seeds)"
    low, high = max(low, -1.0), min(high, 1.0)
    real = "*" if low > 0 or high < 0 else ""
    return f"{100 * diff:+.1f} pts [{100 * low:+.1f}, {100 * high:+.1f}]{real}"


def _seed_ids(rec: Record) -> List[int]:
    view = RecordView.of(rec)
    first = view.get("runtime.seed") or 0
    return list(range(first, first + (view.get("recall.seeds") or 1)))


def _is_int(value: Any) -> bool:
    return as_int(value) is not None


def _row_ok(row: Any) -> bool:
    per_seed = row.get("per_seed") if isinstance(row, Mapping) else None
    return (isinstance(row.get("stage", "final"), str) and _is_int(row.get("seq_len"))
            and all(row.get(k) is None or _is_int(row[k]) for k in ("num_pairs", "distance"))
            and isinstance(per_seed, list) and bool(per_seed)
            and all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1 for a in per_seed))


def well_formed(rec: Record) -> bool:
    """An ok recall record whose seeds are integers and each accuracy row a condition with accuracies
    in [0, 1] (a record read back is checked, not trusted)."""
    view = RecordView.of(rec)
    accuracy = view.table("accuracy")
    seed = view.get("runtime.seed")
    seed, seeds = (0 if seed is None else seed), view.get("recall.seeds") or 1
    raw = (view.to_dict().get("tables") or {}).get("accuracy")  # the view leaves out rows that are no mapping
    return (_is_int(seed) and _is_int(seeds) and seeds >= 1 and isinstance(raw, list)
            and len(raw) == len(accuracy) and all(_row_ok(row) for row in accuracy))


def _recall_records(records: Sequence[Record]) -> List[Record]:
    return [rec for rec in map(RecordView.of, records) if rec.task == "recall" and rec.ok and rec.table("accuracy")]


def malformed(records: Sequence[Record]) -> int:
    """How many ok recall records :func:`groups` leaves out (not :func:`well_formed`)."""
    return sum(not well_formed(rec) for rec in _recall_records(records))


def groups(records: Sequence[Record]) -> List[List[Record]]:
    """Well-formed recall records grouped by their config but the variant, the seeds and how the job
    was tracked."""
    out: Dict[str, List[Record]] = {}
    for rec in _recall_records(records):
        if not well_formed(rec):
            continue
        key = {k: v for k, v in rec.config.items() if k not in ("attention", "wandb", "rerun")}
        key["runtime"] = {k: v for k, v in (key.get("runtime") or {}).items() if k != "seed"}
        key["recall"] = {k: v for k, v in (key.get("recall") or {}).items() if k != "seeds"}
        out.setdefault(repr(sorted(key.items(), key=lambda kv: kv[0])), []).append(rec)
    return [sorted(g, key=lambda r: (r.variant.order, _seed_ids(r))) for g in out.values()]


def pooled(group: Sequence[Record]) -> Dict[str, Dict[Tuple, Dict[str, Any]]]:
    """variant -> condition -> row, pooled over the variant's records' seeds (a seed measured twice
    counts once) and summarised as the task does (stats.seed_summary)."""
    out: Dict[str, Dict[Tuple, Dict[str, Any]]] = {}
    for rec in map(RecordView.of, group):
        label, ids = rec.variant.label, _seed_ids(rec)
        for row in rec.table("accuracy"):
            cell = out.setdefault(label, {}).setdefault(tuple(row.get(k) for k in _CONDITION_KEYS),
                                                        {**row, "by_seed": {}})
            for seed, acc in zip(ids, row["per_seed"]):
                cell["by_seed"].setdefault(seed, acc)
    for cells in out.values():
        for cell in cells.values():
            per_seed = [cell["by_seed"][s] for s in sorted(cell["by_seed"])]
            cell.update(per_seed=per_seed, **seed_summary(per_seed))
    return out


def recall_table(group: Sequence[Record]) -> Tuple[List[str], List[List[str]]]:
    """(header, rows): a row per condition and a column per variant, then the gaps to the first
    variant and the condition's floors; then the variants' costs (of each one's first record)."""
    rows_by_variant = pooled(group)
    labels = list(rows_by_variant)
    first_record = {label: next(r for r in map(RecordView.of, group) if r.variant.label == label) for label in labels}
    header = ["condition", *labels, *[f"{v} vs {labels[0]}" for v in labels[1:]], "chance", "copy baseline"]
    conditions = list(dict.fromkeys(c for cells in rows_by_variant.values() for c in cells))
    rows = []
    for cond in conditions:
        cells = {v: rows_by_variant[v][cond] for v in labels if cond in rows_by_variant[v]}
        base = cells.get(labels[0])
        gaps = [gap_text(base["per_seed"], cells[v]["per_seed"]) if base and v in cells else "-" for v in labels[1:]]
        first = next(iter(cells.values()))
        rows.append([_label(first), *[_cell(cells[v]) if v in cells else "-" for v in labels], *gaps,
                     fmt(first.get("chance"), "{:.3g}"), fmt(first.get("copy"), "{:.3f}")])  # chance 1e-04: passkey
    pad = [""] * (len(labels) + 1)
    metrics = [first_record[v].metrics for v in labels]
    rows.append(["KV / token", *[fmt(m.get("kv_bytes_per_token"), "bytes") for m in metrics], *pad])
    if any(m.get("kv_state_bytes_per_sequence") for m in metrics):  # a Gated DeltaNet layer's, whatever the length
        rows.append(["state / sequence", *[fmt(m.get("kv_state_bytes_per_sequence"), "bytes") for m in metrics], *pad])
    rows.append(["decode p50 ms", *[fmt(m.get("decode_ms_p50"), "{:.3f}") for m in metrics], *pad])
    return header, rows


def title(group: Sequence[Record]) -> str:
    first = RecordView.of(group[0])
    r = first.config.get("recall") or {}
    steps = first.get("train.steps")
    seeds = max(len(c["per_seed"]) for cells in pooled(group).values() for c in cells.values())
    plural = "s" if seeds != 1 else ""
    return (f"recall ({r.get('kind')}): accuracy on held-out sequences, mean over {seeds} seed{plural} "
            f"[95% t-interval] (each seed); gaps in points with a Welch interval (* = excludes 0); "
            f"{steps} training steps")
